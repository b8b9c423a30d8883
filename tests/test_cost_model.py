import dataclasses

import pytest
import torch
from transformers import GPT2Config

from paged_attention.experiments import paper
from paged_attention.experiments.cost_model import (
    GPUS,
    MODEL_CONFIGS,
    PAPER_KV_BYTES,
    CostModel,
    ModelSpec,
    gpu_spec,
    model_spec,
    paper_kv_slots,
)


@pytest.fixture(scope="module")
def a100_opt() -> CostModel:
    return CostModel.named("A100-40GB", "OPT-13B")


@pytest.mark.parametrize(
    ("name", "params", "kv_bytes"),
    [("OPT-13B", 12.85e9, 819_200), ("Llama-2-7B", 6.74e9, 524_288), ("Llama-3-8B", 8.03e9, 131_072)],
)
def test_named_models_have_published_sizes(name: str, params: float, kv_bytes: int):
    spec = model_spec(name)
    assert spec.num_params == pytest.approx(params, rel=0.01)
    assert spec.kv_bytes_per_token == kv_bytes  # fp16
    assert spec.weight_bytes == 2 * spec.num_params
    assert spec.max_model_len == MODEL_CONFIGS[name]().max_position_embeddings


def test_from_config_reads_any_config_and_dtype():
    gpt2 = ModelSpec.from_config("gpt2", GPT2Config(), torch.float32)
    assert gpt2.num_params == pytest.approx(124.4e6, rel=0.01)  # biases/norms left out
    assert (gpt2.dtype_bytes, gpt2.kv_bytes_per_token) == (4, 2 * 12 * 768 * 4)
    llama_fp32 = model_spec("Llama-3-8B", torch.float32)
    assert llama_fp32.weight_bytes == 2 * model_spec("Llama-3-8B").weight_bytes


def test_paper_kv_slots():
    assert paper_kv_slots() == 12 * 2**30 // 819_200 == 15728
    assert model_spec("OPT-13B").kv_slots(PAPER_KV_BYTES) == 15728
    assert paper_kv_slots() == paper.KV_SLOTS  # paper.py's own arithmetic, kept free of transformers
    assert model_spec("OPT-13B").kv_slots(0) == 0


def test_kv_budget_after_weights_is_about_12_gib_as_in_the_paper(a100_opt: CostModel):
    assert a100_opt.kv_cache_bytes() / 2**30 == pytest.approx(12, rel=0.05)
    tiny_gpu = dataclasses.replace(GPUS["A100-40GB"], memory_bytes=2**30)
    with pytest.raises(ValueError, match="does not fit"):
        dataclasses.replace(a100_opt, gpu=tiny_gpu).kv_cache_bytes()


def test_pure_roofline_is_exact():
    model = CostModel.named("A100-40GB", "OPT-13B", bandwidth_efficiency=1.0, flops_efficiency=1.0)
    spec = model.model
    cost = model.step_cost(4, 1000)
    assert cost.bytes_moved == spec.weight_bytes + (1000 + 4) * spec.kv_bytes_per_token
    assert cost.flops == 2 * spec.num_params * 4
    assert cost.time == cost.bytes_moved / 1555e9 and cost.bound == "memory"
    assert model.step_cost(2048, 2048).time == 2 * spec.num_params * 2048 / 312e12


def test_decode_at_batch_one_is_reading_the_weights(a100_opt: CostModel):
    weights_time = a100_opt.model.weight_bytes / 1555e9  # ~16.5 ms at peak bandwidth
    assert weights_time == pytest.approx(16.5e-3, rel=0.01)
    # One token of context adds 2 x 800 KiB to 26 GB: within 0.1% of weights / (0.8 x bandwidth).
    assert a100_opt.decode_step_time(1, 1) == pytest.approx(weights_time / 0.8, rel=1e-3)


def test_decode_time_grows_with_batch_and_context(a100_opt: CostModel):
    batches, contexts = (1, 8, 32, 128), (100, 500, 2000)
    for c in contexts:  # strictly increasing in batch size at fixed context ...
        times = [a100_opt.decode_step_time(b, c) for b in batches]
        assert times == sorted(set(times))
    for b in batches:  # ... and in context at fixed batch size
        times = [a100_opt.decode_step_time(b, c) for c in contexts]
        assert times == sorted(set(times))
    # Ordered by the KV tokens read (batch x context) while memory bound.
    steps = sorted((b * c, b, a100_opt.decode_step_time(b, c)) for b in batches for c in contexts)
    assert [t for *_, t in steps] == sorted(t for *_, t in steps)
    # Batching is nearly free while memory bound: 32x the sequences cost well under 2x the time.
    assert a100_opt.decode_step_time(32, 500) < 2 * a100_opt.decode_step_time(1, 500)


def test_long_prefill_is_compute_bound_short_decode_memory_bound(a100_opt: CostModel):
    prefill = a100_opt.step_cost(2048, 2048)
    assert prefill.compute_time > prefill.memory_time and prefill.bound == "compute"
    assert a100_opt.prefill_time(2048) == prefill.time
    assert a100_opt.step_cost(8, 4000).bound == "memory"


def test_h200_is_faster_than_a100():
    a100, h200 = CostModel.named("A100-40GB", "OPT-13B"), CostModel.named("H200", "OPT-13B")
    for tokens, kv in [(1, 500), (32, 16000), (2048, 2048)]:
        assert h200.step_time(tokens, kv) < a100.step_time(tokens, kv)


def test_empty_step_costs_nothing(a100_opt: CostModel):
    assert a100_opt.step_time(0, 0) == 0.0


def test_bad_input_names_the_argument(a100_opt: CostModel):
    with pytest.raises(ValueError, match="num_tokens"):
        a100_opt.step_time(-1, 0)
    with pytest.raises(ValueError, match="kv_tokens_read"):
        a100_opt.step_time(1, -5)
    with pytest.raises(ValueError, match="batch_size"):
        a100_opt.decode_step_time(0, 10)
    with pytest.raises(ValueError, match="mean_context"):
        a100_opt.decode_step_time(1, -1.0)
    with pytest.raises(ValueError, match="prompt_len"):
        a100_opt.prefill_time(0)
    with pytest.raises(TypeError, match="num_tokens"):
        a100_opt.step_time(1.5, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bandwidth_efficiency"):
        CostModel.named("H200", "OPT-13B", bandwidth_efficiency=1.5)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        a100_opt.kv_cache_bytes(0.0)


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="A100-40GB, H100-SXM, H200"):
        gpu_spec("A100")
    with pytest.raises(ValueError, match="OPT-13B, Llama-2-7B, Llama-3-8B"):
        model_spec("opt-13b")
