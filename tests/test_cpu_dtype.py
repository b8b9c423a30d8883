"""bfloat16 on a CPU: what ``dtype="auto"`` picks and why, the packed linear layers, and an engine
whose weights, activations and KV cache are bfloat16 (KV bytes and blocks follow the dtype, the
sampler works in float32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from paged_attention import LLM, LLMEngine, SamplingParams
from paged_attention.engine.sample.sampling import Sampler
from paged_attention.models import cpu_dtype, explain_dtype, load_model, resolve_dtype
from paged_attention.models.cpu_dtype import MARGIN, choose_cpu_dtype, float32_weight_bytes
from paged_attention.models.packed_linear import (
    PackedLinear,
    pack_linear_layers,
    packing_available,
    unpack_linear_layers,
)

CPU = torch.device("cpu")
#: SmolLM2-135M's shapes, stored in bfloat16 (no weights needed to decide)
SMOLLM2_LIKE = LlamaConfig(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, dtype="bfloat16",
)  # fmt: skip
needs_packing = pytest.mark.skipif(not packing_available(), reason="this CPU/torch cannot pack bfloat16")


def _never(*_: object) -> dict:
    raise AssertionError("nothing should have been measured")


def test_the_weight_estimate_matches_smollm2s_135m_parameters():
    assert float32_weight_bytes(SMOLLM2_LIKE) == pytest.approx(4 * 134.5e6, rel=0.01)


@pytest.mark.parametrize(
    ("speedups", "expected"),
    [
        ({1: 1.34, 16: 3.3}, torch.bfloat16),  # this machine
        ({1: 0.98, 16: 0.22}, torch.float32),  # the same CPU with oneDNN capped at AVX2 (measured)
        ({1: 1.05, 16: 3.3}, torch.float32),  # faster in a batch, not alone: never slower at any size
        ({1: MARGIN, 16: MARGIN}, torch.bfloat16),
    ],
)
def test_auto_picks_bfloat16_only_where_it_is_measured_faster_at_every_size(speedups, expected):
    choice = choose_cpu_dtype(SMOLLM2_LIKE, measure=lambda hidden, inter: speedups)
    assert choice.dtype == expected and choice.speedups == speedups
    assert f"{speedups[16]:.2f}x at 16 rows" in choice.reason


def test_auto_keeps_float32_checkpoints_and_small_models_without_measuring():
    stored_full = LlamaConfig(**{**SMOLLM2_LIKE.to_dict(), "dtype": "float32"})
    assert choose_cpu_dtype(stored_full, measure=_never).reason == "the checkpoint is stored in float32"
    tiny = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, vocab_size=512,
                       dtype="bfloat16")  # fmt: skip
    choice = choose_cpu_dtype(tiny, measure=_never)
    assert choice.dtype == torch.float32 and "small model" in choice.reason
    # the embedded model (stored in bfloat16, 10 MB in float32) is served in float32
    assert LLM().llm_engine.spec.dtype == torch.float32
    assert explain_dtype(None).startswith("float32 (auto: a small model")


def test_auto_without_native_bfloat16_is_float32(monkeypatch):
    monkeypatch.setattr(cpu_dtype, "_row_kernel", None)  # no engine loops registered either
    monkeypatch.setattr(cpu_dtype, "native_bfloat16", lambda: False)
    monkeypatch.setattr(cpu_dtype, "measure_speedups", _never)
    monkeypatch.setattr(cpu_dtype, "_chosen", {})
    assert resolve_dtype("auto", CPU, SMOLLM2_LIKE) == torch.float32
    assert resolve_dtype("bfloat16", CPU, SMOLLM2_LIKE) == torch.bfloat16  # forcing it still works


def test_the_choice_is_measured_once_and_cached_on_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGED_ATTENTION_CACHE", str(tmp_path))
    monkeypatch.setattr(
        cpu_dtype, "_row_kernel", None
    )  # oneDNN's product, as on a CPU with bfloat16 arithmetic
    monkeypatch.setattr(cpu_dtype, "native_bfloat16", lambda: True)
    monkeypatch.setattr(cpu_dtype, "_chosen", {})
    calls = []

    def measure(hidden, inter, kernel=None):
        calls.append((hidden, inter))
        return {1: 0.5, 16: 0.6}  # a slow bfloat16

    monkeypatch.setattr(cpu_dtype, "measure_speedups", measure)
    assert resolve_dtype("auto", CPU, SMOLLM2_LIKE) == torch.float32
    assert resolve_dtype(None, CPU, SMOLLM2_LIKE) == torch.float32
    assert calls == [(576, 1536)]
    stored = json.loads((tmp_path / "cpu-dtype.json").read_text())
    (key,) = stored
    assert "576x1536" in key and f"torch {torch.__version__}" in key and stored[key] == {"1": 0.5, "16": 0.6}
    monkeypatch.setattr(cpu_dtype, "_chosen", {})  # a new process: read from disk, not measured again
    assert choose_cpu_dtype(SMOLLM2_LIKE).speedups == {1: 0.5, 16: 0.6} and len(calls) == 1
    (tmp_path / "cpu-dtype.json").write_text("{not json")  # a damaged file is measured again
    monkeypatch.setattr(cpu_dtype, "_chosen", {})
    assert choose_cpu_dtype(SMOLLM2_LIKE).dtype == torch.float32 and len(calls) == 2


class Loops:
    """A stand-in for the engine's bfloat16 loops: counts the rows it multiplies."""

    def __init__(self, wide: bool) -> None:
        self.wide, self.rows = wide, []

    def prepare(self, weight, bias, product):
        return weight

    def __call__(self, x, prepared, bias):
        self.rows.append(x.shape[0])
        return F.linear(x.float(), prepared.float()).to(x.dtype)


def test_without_bfloat16_arithmetic_auto_times_the_loops_the_engine_registered(monkeypatch, tmp_path):
    """Where oneDNN would emulate bfloat16 the engine multiplies it in its own loops and registers
    them: the probe times the products through them (a packed layer trying them first) and decides
    by that, cached under its own key; loops that take few rows only leave the CPU in float32."""
    monkeypatch.setenv("PAGED_ATTENTION_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_dtype, "native_bfloat16", lambda: False)
    monkeypatch.setattr(cpu_dtype, "_chosen", {})
    loops = Loops(wide=True)
    speedups = cpu_dtype.measure_speedups(64, 128, kernel=loops)
    assert set(speedups) == {1, 16} and set(loops.rows) == {1, 16}
    monkeypatch.setattr(cpu_dtype, "_row_kernel", lambda: loops)
    seen = []
    monkeypatch.setattr(
        cpu_dtype, "measure_speedups", lambda h, i, kernel: seen.append(kernel) or {1: 2.5, 16: 1.5}
    )
    choice = choose_cpu_dtype(SMOLLM2_LIKE)
    assert (
        choice.dtype == torch.bfloat16
        and choice.reason.endswith("through the engine's loops")
        and seen == [loops]
    )
    (key,) = json.loads((tmp_path / "cpu-dtype.json").read_text())
    assert "|Loops|" in key  # not the key of oneDNN's product on the same machine
    monkeypatch.setattr(cpu_dtype, "_row_kernel", lambda: Loops(wide=False))
    monkeypatch.setattr(cpu_dtype, "_chosen", {})
    assert choose_cpu_dtype(SMOLLM2_LIKE).reason == "this CPU reports no native bfloat16 arithmetic"
    with pytest.raises(TypeError, match="factory must be callable"):
        cpu_dtype.multiply_bfloat16_with("Streamed")  # a name, not what makes one


def test_the_answer_names_what_it_timed_and_the_top_level_one_is_the_engines(monkeypatch, tmp_path):
    """Timed through oneDNN (no loops registered: the model outside the engine), the reason says so;
    ``paged_attention.explain_dtype`` imports the engine first, which registers its loops where it
    has them, so it answers for ``LLM(...)`` (in a fresh process: this one has the engine loaded)."""
    monkeypatch.setenv("PAGED_ATTENTION_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_dtype, "native_bfloat16", lambda: True)
    monkeypatch.setattr(cpu_dtype, "_row_kernel", None)
    monkeypatch.setattr(cpu_dtype, "_chosen", {})
    monkeypatch.setattr(cpu_dtype, "measure_speedups", lambda h, i, kernel: {1: 0.9, 16: 0.5})
    for packing, timed in ((True, "oneDNN's packed product"), (False, "F.linear")):
        monkeypatch.setattr(cpu_dtype, "packing_available", lambda packing=packing: packing)
        monkeypatch.setattr(cpu_dtype, "_chosen", {})
        choice = choose_cpu_dtype(SMOLLM2_LIKE)
        assert choice.dtype == torch.float32 and choice.reason.endswith(f"through {timed}")
    code = (
        "import paged_attention\n"
        "from paged_attention.models import cpu_dtype, explain_dtype\n"
        "assert cpu_dtype._row_kernel is None  # the models layer alone registers nothing\n"
        "assert paged_attention.explain_dtype is explain_dtype\n"
        "assert cpu_dtype._row_kernel is not None  # importing it loaded the engine's registration\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.skipif(not cpu_dtype.native_bfloat16(), reason="this CPU has no native bfloat16")
def test_a_cpu_forced_to_emulate_bfloat16_measures_it_slower_and_auto_keeps_float32(tmp_path):
    """The real thing, not a stub: oneDNN capped at AVX2 (``ONEDNN_MAX_CPU_ISA``) has no bfloat16
    instructions, so torch reports none, the probe measures bfloat16 slower, and auto says float32."""
    code = (
        "import torch, json; torch.set_num_threads(1)\n"
        "from transformers import LlamaConfig\n"
        "from paged_attention.models import cpu_dtype, resolve_dtype\n"
        "config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,\n"
        "    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, dtype='bfloat16')\n"
        "print(json.dumps([cpu_dtype.native_bfloat16(), cpu_dtype.measure_speedups(576, 1536),\n"
        "    str(resolve_dtype('auto', torch.device('cpu'), config))]))\n"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "PAGED_ATTENTION_CACHE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    native, speedups, chosen = json.loads(run.stdout.strip().splitlines()[-1])
    assert native is False and speedups["16"] < 1 and chosen == "torch.float32"


@needs_packing
@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (2, 7, 64), (40, 64)])
def test_a_packed_linear_equals_f_linear_bit_for_bit(shape):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=True).to(torch.bfloat16)
    x = torch.randn(shape).to(torch.bfloat16)
    packed = PackedLinear(linear)
    with torch.inference_mode():
        assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))
        linear.weight.mul_(2)  # changed in place: noticed and repacked
        assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))
    y = packed(x.requires_grad_())  # with autograd: the ordinary product, which has a gradient
    y.sum().backward()
    assert x.grad is not None


@needs_packing
def test_packing_a_model_keeps_its_parameters_ties_and_results():
    model, tokenizer = load_model(dtype="bfloat16")
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2's are
    before = dict(model.named_parameters(remove_duplicate=False))
    engine = LLMEngine(model, tokenizer, num_kv_blocks=16)
    assert engine.runner.num_merged_groups == 4 * 2  # (q, k, v) and (gate, up): one packed product each
    assert engine.runner.num_packed_layers == 4 * 2 + 1  # o and down per layer, and lm_head
    assert all(type(m) is not torch.nn.Linear for m in model.modules())
    after = dict(model.named_parameters(remove_duplicate=False))
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)  # the same tensors
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert pack_linear_layers(model) == 0  # nothing left to pack
    single = torch.nn.Sequential(torch.nn.Linear(32, 8))  # float32 is packed too, a few ulps from MKL
    x = torch.randn(5, 32)
    with torch.inference_mode():
        expected = single(x)
        assert pack_linear_layers(single) == 1
        torch.testing.assert_close(single(x), expected, rtol=1e-5, atol=1e-5)


def test_a_bfloat16_engine_caches_bfloat16_and_gets_twice_the_blocks():
    budget = 1 << 20
    full = LLMEngine(dtype="float32", kv_cache_memory=budget)
    half = LLMEngine(dtype="bfloat16", kv_cache_memory=budget)
    assert half.spec.dtype == half.kv_cache.data.dtype == torch.bfloat16
    assert half.spec.bytes_per_token * 2 == full.spec.bytes_per_token
    assert half.cache_manager.num_blocks == 2 * full.cache_manager.num_blocks
    half.add_request("a", "The cache", SamplingParams(max_tokens=6, temperature=0, logprobs=2))
    while half.has_unfinished_requests():  # the engine runs end to end in bfloat16
        outputs = half.step()
    answer = outputs[0].outputs[0]
    assert len(answer.token_ids) == 6
    assert all(-50 < lp[t].logprob <= 0 for t, lp in zip(answer.token_ids, answer.logprobs, strict=True))


def test_the_sampler_works_in_float32_from_bfloat16_logits():
    """Log-probabilities come from float32 softmax of the bfloat16 logits, not from a bfloat16 one
    (whose 8-bit mantissa would round -0.0123 to -0.0123046875 and worse)."""
    torch.manual_seed(0)
    logits = (torch.randn(3, 500) * 4).to(torch.bfloat16)
    params = [SamplingParams(temperature=0, logprobs=5)] * 3
    out = Sampler(0, "raw_logprobs")(logits, params, [None] * 3)
    exact = logits.float().log_softmax(-1)
    assert out.tokens == exact.argmax(-1).tolist()
    assert out.logprobs == pytest.approx(exact.max(-1).values.tolist(), abs=1e-6)
    assert out.distributions[0].dtype == torch.float32
    torch.testing.assert_close(out.distributions[0], exact[0], atol=1e-6, rtol=0)


def test_configs_without_a_dtype_and_float16_checkpoints():
    nameless = LlamaConfig(
        **{k: v for k, v in SMOLLM2_LIKE.to_dict().items() if k not in ("dtype", "torch_dtype")}
    )
    nameless.dtype = None
    assert choose_cpu_dtype(nameless, measure=_never).reason == "the checkpoint names no dtype"
    half = LlamaConfig(**{**SMOLLM2_LIKE.to_dict(), "dtype": "float16"})  # served in bfloat16 where faster
    assert choose_cpu_dtype(half, measure=lambda h, i: {1: 2.0, 16: 3.0}).dtype == torch.bfloat16


def test_a_close_call_is_measured_three_times_and_not_stored(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGED_ATTENTION_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_dtype, "_row_kernel", None)
    monkeypatch.setattr(cpu_dtype, "native_bfloat16", lambda: True)
    monkeypatch.setattr(cpu_dtype, "_chosen", {})
    runs = iter([{1: 1.05, 16: 3.0}, {1: 1.30, 16: 3.1}, {1: 1.12, 16: 2.9}])
    monkeypatch.setattr(cpu_dtype, "measure_speedups", lambda h, i, kernel=None: next(runs))
    choice = choose_cpu_dtype(SMOLLM2_LIKE)
    assert choice.speedups == {1: 1.12, 16: 3.0} and choice.dtype == torch.bfloat16  # the medians
    assert not (tmp_path / "cpu-dtype.json").exists()  # the next process measures again


def test_explain_dtype_names_what_was_asked_and_a_model_objects_own():
    model, _ = load_model(dtype="bfloat16")
    assert explain_dtype(model) == "bfloat16 (the model object's own)"
    assert explain_dtype("smollm2", "float16") == "float16 (asked for)"
    with pytest.raises(ValueError, match="unsupported dtype"):
        explain_dtype(None, "int8")


@needs_packing
def test_packing_survives_inference_tensors_new_weights_and_unpacks_for_saving():
    import copy

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100)  # fmt: skip
    from transformers import AutoModelForCausalLM

    with torch.inference_mode():  # weights that are inference tensors: no version counter
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert pack_linear_layers(model) == 2 * 7 + 1
    ids = torch.randint(0, 100, (1, 5))
    with torch.inference_mode():
        packed_logits = model(ids).logits
    layer = model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.inference_mode():
        layer.weight = torch.nn.Parameter(torch.randn(64, 64).to(torch.bfloat16), requires_grad=False)
        assert torch.equal(layer(x), F.linear(x, layer.weight))  # a new tensor: repacked
        layer.weight.data = torch.randn(64, 64).to(torch.bfloat16)
        assert torch.equal(layer(x), F.linear(x, layer.weight))  # new storage: repacked
    assert unpack_linear_layers(model) == 2 * 7 + 1
    assert all(type(m) is not PackedLinear for m in model.modules())
    copy.deepcopy(model)  # an unpacked model copies (a packed one would refuse)
    assert packed_logits.shape == (1, 5, 100)


def test_the_decode_timer_refuses_a_batch_that_cannot_decode_together_and_cleans_up():
    from paged_attention.experiments.dtypes import decode_step_seconds

    engine = LLMEngine(num_kv_blocks=64, max_num_seqs=2)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}] * 3
    with pytest.raises(ValueError, match="at most 2"):
        decode_step_seconds(engine, prompts, steps=2)
    small = LLMEngine(num_kv_blocks=6, block_size=4, max_num_seqs=4)  # 24 slots; 3 sequences need 33
    with pytest.raises(ValueError, match="more blocks"):
        decode_step_seconds(small, prompts, steps=4)
    assert not small.has_unfinished_requests()  # aborted, blocks back
    assert small.cache_manager.num_free_blocks == small.cache_manager.num_blocks
    row = decode_step_seconds(LLMEngine(num_kv_blocks=64), prompts, steps=3)
    assert row["batch"] == 3 and row["step_s"] > 0 and row["tokens_per_s"] == pytest.approx(3 / row["step_s"])


def test_the_dtype_comparison_compiles_its_engines_only_when_asked(monkeypatch):
    """``bench engine --dtype A B --compile`` reaches each engine as ``compilation_config=3``
    (``compare`` stopped at the first engine: the rest is the decode timer's, tested above)."""
    from paged_attention.cli.bench import engine as command
    from paged_attention.experiments import dtypes

    class Stop(Exception):
        pass

    seen = []

    def engine(*args, **kwargs):
        seen.append(kwargs["compilation_config"])
        raise Stop

    monkeypatch.setattr(dtypes, "LLMEngine", engine)
    monkeypatch.setattr(
        dtypes, "chat_prompts", lambda tokenizer, count: [{"prompt_token_ids": [5, 6]}] * count
    )
    monkeypatch.setattr(dtypes, "memory_bandwidth", lambda: {"read": 1e10, "copy": 1e10})
    for compiled in (False, True):
        with pytest.raises(Stop):
            dtypes.compare(None, ["float32"], [1], compiled=compiled)
    assert seen == [None, 3]
    runs = []
    monkeypatch.setattr(command.dtypes, "run", lambda *args: runs.append(args))
    command.main(["--dtype", "float32", "bfloat16", "--compile", "--no-save", "--threads", "1"])
    command.main(["--dtype", "float32", "bfloat16", "--no-save", "--threads", "1"])
    assert [r[-1] for r in runs] == [True, False] and all(r[-2] is False for r in runs)  # (save)
    with pytest.raises(SystemExit):  # one dtype: the engine benchmark, which --compile does not apply to
        command.main(["--dtype", "float32", "--compile", "--no-save"])


def test_the_products_timer_calls_every_product_the_engine_calls_once_a_pass(monkeypatch):
    """A merged group once (not once per member), every other layer once, ``repeats`` passes; the
    floor of a step is the larger of the weight-read bound and the products."""
    from paged_attention.experiments.dtypes import floor_seconds, products_seconds
    from paged_attention.models.merged_projections import MergedProduct

    engine = LLMEngine(num_kv_blocks=16)
    layers = engine.model.config.num_hidden_layers
    rows: list[int] = []
    for kind in (MergedProduct, PackedLinear):
        original = kind.product
        monkeypatch.setattr(kind, "product", lambda self, x, f=original: rows.append(len(x)) or f(self, x))
    seconds = products_seconds(engine.model, rows=3, repeats=2)
    assert seconds > 0 and rows == [3] * 2 * (4 * layers + 1)  # Q/K/V, o, gate/up, down; the output layer
    assert floor_seconds({"bound_s": 0.5, "products_s": 0.75}) == 0.75
    assert floor_seconds({"bound_s": 0.5}) == 0.5  # a row measured before products were


def test_the_arithmetic_bound_counts_every_layers_multiply_adds_once_at_a_measured_rate():
    """multiply_adds of the engine's model (packed, merged) is the plain model's in x out summed over
    its linear layers (the output layer included); the rate is of one product; the roof is the
    larger of the two bounds."""
    from paged_attention.experiments.dtypes import matmul_rate, multiply_adds, roof_seconds
    from paged_attention.models import load_model

    engine = LLMEngine(num_kv_blocks=16)
    plain, _ = load_model(None)
    linear = [m for m in plain.modules() if isinstance(m, torch.nn.Linear)]
    assert multiply_adds(engine.model) == sum(m.in_features * m.out_features for m in linear) > 0
    assert matmul_rate(torch.float32, rows=32, size=64, repeats=1) > 0
    assert roof_seconds({"bound_s": 0.5, "arithmetic_s": 0.75}) == 0.75
    assert roof_seconds({"bound_s": 0.5}) == 0.5  # a row measured before the arithmetic bound was


def test_the_step_figure_marks_the_arithmetic_bound_where_it_was_measured():
    """One tick per bar where every row has its arithmetic bound; none for a result measured before."""
    from paged_attention.viz.dtypes import step_vs_bound

    rows = [
        {"dtype": d, "batch": b, "step_s": 0.02 * b, "bound_s": 0.01, "arithmetic_s": 0.001 * b}
        for d in ("float32", "bfloat16")
        for b in (1, 16)
    ]
    ticks = step_vs_bound({"rows": rows}).axes[0].collections
    assert [len(t.get_offsets()) for t in ticks] == [2, 2]
    old = [{k: v for k, v in r.items() if k != "arithmetic_s"} for r in rows]
    assert not step_vs_bound({"rows": old}).axes[0].collections
