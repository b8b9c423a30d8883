"""Batch-invariant mode (:mod:`paged_attention.models.invariant`): a row's result, bit for bit, does
not depend on what shares its batch: in each kind of linear layer, in attention (one query alone,
or inside a prefill chunk beside other sequences), and in the engine (a request alone or in a
batch, with or without speculative drafts, in bfloat16)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from paged_attention import LLM, SamplingParams
from paged_attention.kernels import reference
from paged_attention.models import invariant
from paged_attention.models.merged_projections import merge_projections
from paged_attention.models.packed_linear import PackedLinear, packing_available

from .kernel_cases import make_paged_case, query_start_loc


def rows_alone_and_batched(layer: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer`` over the batch ``x``, and over each row on its own, in batch-invariant mode."""
    with torch.inference_mode(), invariant.batch_invariant():
        batched = layer(x)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    return batched, alone


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_linear_layers_rows_do_not_depend_on_the_batch(rows: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(96, 200, bias=True).to(dtype)
    layers = [invariant.InvariantLinear(linear)]
    if dtype == torch.bfloat16 and packing_available():
        layers.append(PackedLinear(linear))
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    for layer in layers:
        batched, alone = rows_alone_and_batched(layer, x)
        assert torch.equal(batched, alone), type(layer).__name__
        with torch.inference_mode():  # outside the mode: the plain product, any leading dims
            assert torch.equal(layer(x[None])[0], F.linear(x, linear.weight, linear.bias))
        with torch.inference_mode(), invariant.batch_invariant():
            assert layer(x[None]).shape == (1, rows, 200) and layer(x[:0]).shape == (0, 200)


def test_a_merged_groups_rows_do_not_depend_on_the_batch() -> None:
    """Q, K and V merged into one product (:mod:`~paged_attention.models.merged_projections`)."""

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(64, n, bias=False) for n in (64, 32, 32))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)

    block = Attention().to(torch.bfloat16)
    assert merge_projections(block) == 1
    x = torch.randn(23, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    batched, alone = rows_alone_and_batched(block, x)
    assert torch.equal(batched, alone)


def test_the_row_count_changes_a_plain_products_bits_here() -> None:
    """Why the mode exists: without it, this machine's products round a row differently at
    another row count (SmolLM2's shapes). Skipped where the libraries happen not to."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(576, 1536, generator=gen) * 0.05).float()
    x = torch.randn(64, 1536, generator=gen)
    full = F.linear(x, weight)
    differs = sum(not torch.equal(F.linear(x[:m], weight)[0], full[0]) for m in (1, 3, 17))
    if not differs:
        pytest.skip("this CPU's float32 products do not depend on the row count")
    with invariant.batch_invariant():
        layer = invariant.InvariantLinear(torch.nn.Linear(1536, 576, bias=False))
        layer.weight.data = weight
        assert all(torch.equal(layer(x[:m])[0], layer(x)[0]) for m in (1, 3, 17))


def test_attention_of_a_query_is_the_same_alone_and_inside_a_prefill_chunk() -> None:
    """The float64 path (``compute=torch.float64``): sequence 1's last token as a decode query on its
    own, and as the last row of a 6-token chunk beside two other sequences: the same bits."""
    dtype = torch.bfloat16
    lens = [9, 30, 17]
    case = make_paged_case(lens, 4, 2, 32, dtype, seed=1)
    gen = torch.Generator().manual_seed(2)
    q_lens = [1, 6, 17]
    q = torch.randn(sum(q_lens), 4, 32, generator=gen).to(dtype)
    args = (case.key_cache, case.value_cache)
    chunk = reference.paged_prefill(
        q, *args, case.block_tables, case.seq_lens, query_start_loc(q_lens), compute=torch.float64
    )
    row = sum(q_lens[:2]) - 1  # sequence 1's last token
    alone = reference.paged_prefill(
        q[row : row + 1], *args, case.block_tables[1:2], case.seq_lens[1:2], query_start_loc([1]),
        compute=torch.float64,
    )  # fmt: skip
    assert torch.equal(chunk[row], alone[0])
    # and it is attention: the float64 oracle on float64 copies, rounded the same way
    oracle = reference.paged_prefill(
        q.double(), case.key_cache.double(), case.value_cache.double(), case.block_tables, case.seq_lens,
        query_start_loc(q_lens),
    )  # fmt: skip
    assert torch.equal(chunk, oracle.to(dtype))


@functools.cache
def tiny_bf16() -> tuple[torch.nn.Module, object]:
    engine = LLM(num_kv_blocks=8, block_size=4).llm_engine
    return engine.model.to(torch.bfloat16), engine.tokenizer


PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 1, 1, 2, 3], [3, 14, 15, 9, 26, 5, 35, 8, 3, 14, 15], [42] * 3]
GREEDY = SamplingParams(temperature=0, max_tokens=40, logprobs=0)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def answers(prompts: list[list[int]], **engine: object) -> list[tuple[list[int], list[float]]]:
    model, tokenizer = tiny_bf16()
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=64, block_size=4, batch_invariant=True, **engine)
    outs = [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    return [(o.token_ids, [next(iter(e.values())).logprob for e in o.logprobs]) for o in outs]


def test_the_engine_in_bfloat16_gives_each_request_the_same_bits_whatever_shares_its_steps() -> None:
    """Token ids and every chosen token's logprob, exactly: each request alone, all four in one
    batch, and all four with n-gram drafts verified (several tokens of a sequence in one step)."""
    batched = answers(PROMPTS)
    assert [answers([p])[0] for p in PROMPTS] == batched
    assert answers(PROMPTS, speculative_config=NGRAM) == batched


def test_the_switch_is_vllms_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert invariant.requested(None) is False
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert invariant.requested(None) is True
    assert invariant.requested(False) is False  # an explicit argument wins
    model, tokenizer = tiny_bf16()
    assert LLM(model, tokenizer=tokenizer, num_kv_blocks=8).llm_engine.runner.batch_invariant
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "yes")
    with pytest.raises(ValueError, match="VLLM_BATCH_INVARIANT must be 0 or 1"):
        invariant.requested(None)
    with pytest.raises(TypeError, match="batch_invariant must be True, False or None"):
        invariant.requested("1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rows must be a positive int"), invariant.batch_invariant(0):
        pass


def test_serve_takes_the_switch_as_a_flag_or_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve --batch-invariant`` turns the mode on, ``--no-batch-invariant`` off; without either,
    vLLM's variable decides."""
    from paged_attention.cli.serve import build_engine, parser

    args = ["--model", "tiny", "--num-kv-blocks", "8"]
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert build_engine(parser().parse_args([*args, "--batch-invariant"])).runner.batch_invariant
    assert not build_engine(parser().parse_args(args)).runner.batch_invariant
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert build_engine(parser().parse_args(args)).runner.batch_invariant
    assert not build_engine(parser().parse_args([*args, "--no-batch-invariant"])).runner.batch_invariant
