"""The compiled model (``compilation_config``, :mod:`paged_attention.models.compilation`): vLLM's
keyword parsed as vLLM parses it, and a compiled engine that gives the eager engine's tokens and
transformers' (float32), for every kind of step, with one graph for every token count, and whose
steps stay transactions."""

from __future__ import annotations

import functools
import re

import pytest
import torch

from paged_attention import LLM, SamplingParams
from paged_attention.engine.llm_engine import LLMEngine
from paged_attention.engine.worker import model_runner
from paged_attention.experiments import fusion
from paged_attention.models import compilation
from paged_attention.models.compilation import CompilationConfig

from .test_transactions import CONFIGS, Injector, check_memory, workload

PROMPTS = [[5, 6, 7], [3, 14, 15, 9, 26, 5, 35, 8, 40, 41, 42, 43, 44], [99], [7, 8, 9, 10, 11, 12]]


@pytest.mark.parametrize(
    ("value", "mode"),
    [
        (None, 0),
        (0, 0),
        (3, 3),
        ({"mode": 2}, 2),
        ({"level": 1}, 1),
        ({"cudagraph_capture_sizes": [1]}, 0),
        (CompilationConfig(mode=3), 3),
        ({"mode": "vllm_compile"}, 3),  # vLLM's CompilationMode names, any case
        ({"mode": "NONE"}, 0),
    ],
)
def test_compilation_config_takes_vllms_forms(value, mode):
    assert CompilationConfig.from_value(value).mode == mode
    assert CompilationConfig.from_value(value, enforce_eager=True).mode == 0  # eager wins, as in vLLM
    assert CompilationConfig.from_value(value).compiles == (mode > 0)


@pytest.mark.parametrize(
    ("value", "eager", "error", "match"),
    [
        (4, False, ValueError, "compilation_config mode must be one of"),
        ({"mode": -1}, False, ValueError, "mode must be one of"),
        ("3", False, TypeError, "compilation_config must be None, an int mode"),
        (True, False, TypeError, "compilation_config must be"),
        (None, "yes", TypeError, "enforce_eager must be a bool"),
        (7, True, ValueError, "mode must be one of"),  # checked before enforce_eager applies
        ({"mode": True}, False, ValueError, "mode must be one of"),
        ({"mode": "3"}, False, ValueError, "mode must be one of"),
        ({"mode": 2.9}, False, ValueError, "mode must be one of"),
    ],
)
def test_compilation_config_refuses_bad_values(value, eager, error, match):
    with pytest.raises(error, match=match):
        CompilationConfig.from_value(value, enforce_eager=eager)


def test_llm_refuses_a_bad_compilation_config():
    with pytest.raises(ValueError, match="mode must be one of"):
        LLM(num_kv_blocks=8, compilation_config=7)


needs_compiler = pytest.mark.skipif(
    compilation.cpp_compiler() is None, reason="inductor needs a C++ compiler"
)


def test_without_a_cpp_compiler_compiling_is_refused_clearly(monkeypatch):
    monkeypatch.setattr(compilation, "cpp_compiler", lambda: None)
    with pytest.raises(RuntimeError, match="needs a C\\+\\+ compiler"):
        LLM(num_kv_blocks=8, compilation_config=3)


#: What AOTAutograd counted while :func:`compiled_and_code` compiled its engine.
AOT: list[dict[str, int]] = []


@functools.cache
def compiled_and_code() -> tuple[LLM, str]:
    """One compiled tiny engine (float32) for the tests below, and the code inductor wrote for it:
    compiling costs ~10 s (~5 s with the graph in the caches on disk)."""
    before = dict(torch._dynamo.utils.counters["aot_autograd"])
    built = fusion.compile_and_read(
        lambda: LLM(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, compilation_config=3)
    )
    after = torch._dynamo.utils.counters["aot_autograd"]
    AOT.append({key: after[key] - before.get(key, 0) for key in after})
    return built


def compiled_llm() -> LLM:
    return compiled_and_code()[0]


def graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@needs_compiler
def test_the_compiled_graph_calls_one_opaque_product_per_merged_group_and_layer():
    """Q/K/V merged, gate/up merged, o_proj, down_proj: four calls of the engine's opaque product per
    layer (a merged group's members share theirs), no product left to inductor (the output layer
    runs outside the graph, on the rows that are sampled)."""
    llm, code = compiled_and_code()
    layers = llm.llm_engine.model.config.num_hidden_layers
    multiplies = re.findall(r"^\s*\w+ = torch\.ops\.paged_attention_linear\.multiply\.", code, re.MULTILINE)
    assert len(multiplies) == 4 * layers
    assert fusion.compiled_calls(code)["matrix products"] == len(multiplies)
    assert fusion.compiled_calls(code)["attention"] == layers


@needs_compiler
def test_the_model_is_traced_once_into_a_graph_the_caches_can_keep():
    """The modules' Python floats are constants from the start: no second trace of the whole model
    to make them so; and the graph is not frozen, so AOTAutograd's cache on disk can keep it (a
    frozen graph bypasses it, and every start traced it again)."""
    compiled_and_code()
    (counted,) = AOT
    assert counted["total"] == 1
    assert counted.get("autograd_cache_bypass", 0) == 0
    assert counted.get("autograd_cache_hit", 0) + counted.get("autograd_cache_saved", 0) == 1


@needs_compiler
def test_compiled_engine_gives_eager_and_transformers_tokens_with_one_graph():
    llm = compiled_llm()
    runner = llm.llm_engine.runner
    assert runner.compiled and runner.compile_seconds > 0
    assert runner.num_fused_norms == 0  # inductor's work now; the products are the engine's (opaque)
    assert runner.num_merged_groups == 2 * llm.llm_engine.model.config.num_hidden_layers
    before = graphs()
    params = SamplingParams(temperature=0, max_tokens=12)
    # one prompt alone (one-token decode steps), then a batch (chunked prefill: 16 tokens a step;
    # a shared prefix: prefix-cache hits), then one again
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": PROMPTS[0]}], params)]
    batch = [{"prompt_token_ids": p} for p in PROMPTS * 2]
    got += [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    assert graphs() == before, "a step of another token count compiled another graph"
    eager = LLM(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    assert not eager.llm_engine.runner.compiled
    outputs = eager.generate([{"prompt_token_ids": PROMPTS[0]}, *batch], params, use_tqdm=False)
    expected = [o.outputs[0].token_ids for o in outputs]
    assert got == expected
    model = eager.llm_engine.model
    for prompt, tokens in zip(PROMPTS, got[1:], strict=False):
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        assert out[0, len(prompt) :].tolist() == tokens


def test_enforce_eager_and_batch_invariance_keep_the_model_eager():
    assert not LLM(num_kv_blocks=8, compilation_config=3, enforce_eager=True).llm_engine.runner.compiled
    with pytest.warns(UserWarning, match="batch-invariant mode runs the model eagerly"):
        llm = LLM(num_kv_blocks=8, compilation_config=3, batch_invariant=True)
    assert not llm.llm_engine.runner.compiled
    with pytest.raises(ValueError, match="prepared for an engine that runs it eager"):  # one model, one way
        LLMEngine(llm.llm_engine.model, llm.llm_engine.tokenizer, num_kv_blocks=8, compilation_config=3)


@needs_compiler
def test_outside_the_engine_a_compiled_engines_model_is_transformers_model():
    """The compiled engine's attention name, called outside the engine (``model.generate``), is
    plain SDPA, and compiling the model elsewhere does not route into the engine's operation."""
    model = compiled_llm().llm_engine.model
    assert model.config._attn_implementation == model_runner.COMPILED_NAME
    ids = torch.tensor([PROMPTS[1]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    plain = LLM(num_kv_blocks=8).llm_engine.model  # the same weights, never compiled
    expected = plain.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert out.tolist() == expected.tolist()


@needs_compiler
def test_compiled_steps_are_transactions(monkeypatch):
    """The transaction tests' workload (samples, beams, n-gram drafts, prefix hits, preemption) on a
    compiled model, with a KeyboardInterrupt in one layer's attention every few steps: the run,
    carried on, gives the unfaulted run's outputs and every block comes back. Dynamo's limit of
    compiled entries per code object is set to 1 here: the engines below compile the forward the
    module's engine compiled already, as the ninth engine of a process would under the default 8."""
    model, tokenizer = compiled_llm().llm_engine.model, compiled_llm().llm_engine.tokenizer
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)

    def serve(injector: Injector | None) -> dict:
        engine = LLMEngine(model, tokenizer, num_kv_blocks=12, block_size=4, max_num_batched_tokens=16,
                           max_num_seqs=6, watermark=0.0, compilation_config=3,
                           **CONFIGS["recompute+prefix+ngram"])  # fmt: skip
        for i, (prompt, params) in enumerate(workload()):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        finals: dict = {}
        saved = model_runner._attend
        if injector is not None:
            model_runner._attend = injector.wrap("attention", saved)
        try:
            while engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except KeyboardInterrupt:
                    check_memory(engine)
                    continue
                for out in outputs:
                    if out.finished:
                        finals[out.request_id] = [c.token_ids for c in out.outputs]
        finally:
            model_runner._attend = saved
        check_memory(engine)
        assert engine.cache_manager.num_free_blocks == engine.cache_manager.num_blocks
        return finals

    clean = serve(None)
    injector = Injector(list(range(5, 4000, 23)), {"attention"}, KeyboardInterrupt)
    assert serve(injector) == clean
    assert injector.fired > 3
