"""The step profile (:mod:`paged_attention.experiments.step_profile`): its four parts cover the
profiled steps, attention is found under the engine's profiler range for either CPU backend, and
the sequences it added are gone afterwards."""

from __future__ import annotations

import pytest

from paged_attention.engine.llm_engine import LLMEngine
from paged_attention.experiments import step_profile


@pytest.mark.parametrize("backend", ["compiled", "torch"])
def test_the_parts_cover_the_step_and_attention_is_found(backend):
    engine = LLMEngine(None, num_kv_blocks=64, max_num_seqs=8, attention_backend=backend)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 400 + 3 for j in range(30 + 5 * i)]} for i in range(6)]
    result = step_profile.profile_decode(engine, prompts, steps=3, warmup=1)
    share = result["share"]
    assert list(share) == list(step_profile.PARTS) and result["batch"] == 6 and result["step_s"] > 0
    assert all(value >= 0 for value in share.values())  # the operations found fit in the steps' time
    assert share["attention"] > 0 and share["matrix products"] > 0
    assert not engine.has_unfinished_requests()


def test_products_of_the_row_kernels_count_as_products():
    """bfloat16, compiled backend: decode steps of 3 sequences go to the row loops (no PyTorch
    operation); the packed layers' profiler range still puts them among the products."""
    engine = LLMEngine(None, dtype="bfloat16", num_kv_blocks=64, max_num_seqs=8, attention_backend="compiled")
    prompts = [{"prompt_token_ids": [(5 * i + j) % 400 + 3 for j in range(20)]} for i in range(3)]
    owners = [m for m in engine.model.modules() if type(m).__name__ == "PackedLinear"]
    assert owners and all(o.prepared is not None for o in owners)  # (the tiny model keeps the loops)
    share = step_profile.profile_decode(engine, prompts, steps=3, warmup=1)["share"]
    assert share["matrix products"] > 0.05, share


def test_too_many_sequences_for_the_cache_is_a_clear_error():
    engine = LLMEngine(None, num_kv_blocks=4, max_num_seqs=8)
    prompts = [{"prompt_token_ids": list(range(3, 40))} for _ in range(6)]
    with pytest.raises(ValueError, match="never decoded together"):
        step_profile.profile_decode(engine, prompts, steps=2)
