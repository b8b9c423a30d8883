"""vLLM's offline API beyond ``generate``: EngineArgs and its command line, vLLM keywords accepted
or refused by name, default sampling parameters from a generation config, metrics, profiling,
aborting several requests, ``num_cached_tokens``, ``seed=None``, and an interrupted ``generate``."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import random
import signal
import threading
import time

import pytest

from paged_attention import (
    LLM,
    Counter,
    EngineArgs,
    Gauge,
    Histogram,
    LLMEngine,
    SamplingParams,
    TokensPrompt,
)
from paged_attention.engine.engine_args import IGNORED, LLM_ONLY, REFUSED
from paged_attention.models import DEFAULT_MODEL_NAME

PROMPT = [17, 99, 4, 250, 31]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(DEFAULT_MODEL_NAME, num_kv_blocks=64, block_size=4)


def test_engine_args_are_the_engines_keywords() -> None:
    """EngineArgs holds every LLMEngine keyword with the same default (but the two objects that
    are no settings), so that neither can drift from the other."""
    engine = {
        name: p.default
        for name, p in inspect.signature(LLMEngine.__init__).parameters.items()
        if name not in ("self", "cache_manager_factory", "scheduling_policy")
    }
    args = {f.name: f.default for f in dataclasses.fields(EngineArgs) if f.name not in LLM_ONLY}
    assert args == engine


def test_engine_args_from_the_command_line_build_the_engine() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", DEFAULT_MODEL_NAME, "--num-kv-blocks", "40", "--block-size", "8",
                              "--max-model-len", "96", "--no-enable-prefix-caching", "--seed", "3",
                              "--enforce-eager"])  # fmt: skip
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.num_kv_blocks, engine_args.block_size, engine_args.seed) == (40, 8, 3)
    engine = LLMEngine.from_engine_args(engine_args)
    assert engine.cache_manager.num_blocks == 40 and engine.max_model_len == 96
    assert not engine.cache_manager.enable_prefix_caching
    engine.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    llm = LLM(**dataclasses.asdict(dataclasses.replace(engine_args, model=None)))  # LLM(**engine_args)
    assert llm.llm_engine.cache_manager.num_blocks == 40
    assert engine_args.enforce_eager and not engine.runner.compiled
    for text, value in (("3", 3), ('{"mode": 3}', {"mode": 3})):  # vLLM's --compilation-config forms
        assert parser.parse_args(["--compilation-config", text]).compilation_config == value


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_vllm_keywords_this_engine_cannot_honour_are_refused_by_name(name: str) -> None:
    value = {"kv_cache_dtype": "fp8", "enable_lora": True, "task": "embed", "runner": "pooling",
             "quantization": "awq"}.get(name, 2)  # fmt: skip
    with pytest.raises(ValueError, match=rf"LLM\({name}="):
        LLM(**{name: value})


def test_harmless_vllm_keywords_are_accepted_and_unknown_ones_name_llm() -> None:
    LLM(num_kv_blocks=16, **{name: True for name in IGNORED if name != "swap_space"}, swap_space=4)
    with pytest.raises(
        TypeError, match=r"^LLM\(\) got an unexpected keyword argument 'max_model_length'.*max_model_len"
    ):
        LLM(max_model_length=64)
    with pytest.raises(ValueError, match="swap_space must be"):
        LLM(swap_space=-100)


def test_seed_none_draws_differently_from_run_to_run() -> None:
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    def tokens(seed: int | None) -> tuple[int, ...]:
        out = LLM(seed=seed, num_kv_blocks=16).generate([PROMPT], params, use_tqdm=False)
        return tuple(out[0].outputs[0].token_ids)

    assert len({tokens(None) for _ in range(3)}) > 1
    assert len({tokens(7) for _ in range(2)}) == 1


def test_default_sampling_params_come_from_the_generation_config(tmp_path) -> None:
    assert LLM(num_kv_blocks=16).get_default_sampling_params() == SamplingParams()
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 5, "do_sample": True})
    )
    llm = LLM(num_kv_blocks=16, generation_config=str(tmp_path))
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.9, 20, 5)
    assert len(llm.generate([PROMPT], use_tqdm=False)[0].outputs[0].token_ids) <= 5  # used by generate
    assert LLM(num_kv_blocks=16, generation_config="vllm").get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="generation_config"):
        LLM(num_kv_blocks=16, generation_config=str(tmp_path / "nowhere"))


def test_metrics_count_what_happened(llm) -> None:
    before = {(m.name, tuple(m.labels.items())): m for m in llm.get_metrics()}
    prompts = [PROMPT, [3, 4, 5, 6, 7, 8, 9, 10, 11]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    after = {(m.name, tuple(m.labels.items())): m for m in llm.get_metrics()}

    def grew(name: str, labels: tuple = ()) -> float:
        new, old = after[(name, labels)], before[(name, labels)]
        return new.value - old.value if not isinstance(new, Histogram) else new.count - old.count

    assert grew("vllm:generation_tokens") == sum(len(o.outputs[0].token_ids) for o in outs) == 12
    assert grew("vllm:prompt_tokens") == sum(len(p) for p in prompts) - sum(o.num_cached_tokens for o in outs)
    assert grew("vllm:request_success", (("finished_reason", "length"),)) == 2
    assert grew("vllm:time_to_first_token_seconds") == 2 and grew("vllm:e2e_request_latency_seconds") == 2
    assert isinstance(after[("vllm:num_requests_running", ())], Gauge)
    assert isinstance(after[("vllm:prefix_cache_hits", ())], Counter)
    histogram = after[("vllm:request_generation_tokens", ())]
    assert list(histogram.buckets.values()) == sorted(histogram.buckets.values())  # cumulative
    assert histogram.buckets["+Inf"] == histogram.count


def test_profiling_writes_a_chrome_trace(llm, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_TORCH_PROFILER_DIR"):
        llm.start_profile()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "profile"))
    llm.start_profile()
    llm.generate([PROMPT], SamplingParams(max_tokens=3), use_tqdm=False)
    trace = llm.stop_profile()
    assert trace.parent == tmp_path / "profile"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::" in str(e.get("name", "")) for e in events)
    with pytest.raises(RuntimeError, match="no profile"):
        llm.stop_profile()


def test_abort_takes_one_id_or_many_and_int_ids_too(llm) -> None:
    engine = llm.llm_engine
    for request_id in (5, "six", "seven"):
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=PROMPT), SamplingParams(max_tokens=50))
    engine.step()
    engine.abort_request(5)  # stored as "5": found again by the same int
    with pytest.raises(ValueError, match="'nope'"):
        engine.abort_request(["six", "nope"])
    assert engine.request_ids == ["six", "seven"]  # all-or-nothing
    engine.abort_request(["six", "seven"])
    assert not engine.has_unfinished_requests()
    manager = engine.cache_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_num_cached_tokens_counts_the_prefix_cache_hit(llm) -> None:
    prompt = list(range(300, 322))  # 22 tokens: 5 full blocks of 4
    first = llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    second = llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 20


@pytest.mark.parametrize("length", [21, 22, 24])
def test_a_prompt_computed_after_a_prefix_cache_hit_gives_the_bits_of_its_first_run(llm, length) -> None:
    """A hit leaves the prompt's last 1, 2 or 4 tokens to compute (blocks of 4): attention takes the
    prefill path for them as for the whole prompt (not the decode kernel, whose sums run in another
    order), so the second run samples from the first run's very logits."""
    prompt = list(range(100 + length, 100 + 2 * length))
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=2)
    first, second = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, (length - 1) // 4 * 4)
    assert second.outputs[0].logprobs == first.outputs[0].logprobs


def test_an_interrupted_generate_leaves_nothing_of_its_own_behind() -> None:
    """SIGINT at random times, while generate is still adding its prompts or already serving
    them: afterwards the engine serves nothing of that call and holds no block.

    Python's own SIGINT handler is installed for the test (and the previous one put back after):
    a test run earlier in the same worker may leave another (an event loop's, which cancels a task
    instead of raising), and what is tested is generate under a KeyboardInterrupt, as in a notebook."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupt_generate_at_random_times()
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_generate_at_random_times() -> None:
    llm = LLM(num_kv_blocks=64, block_size=4)
    engine = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=2)
    prompts = [[rng.randrange(3, 500) for _ in range(4)] for _ in range(1000)]
    start = time.perf_counter()
    assert len(llm.generate(prompts, params, use_tqdm=False)) == len(prompts)
    whole = time.perf_counter() - start
    interrupted = attempts = 0
    # A SIGINT that lands in a finalizer is printed and lost (Python's rule, not ours): so try until
    # three runs were interrupted, and check every run, interrupted or not.
    while interrupted < 3 and attempts < 20:
        attempts += 1
        timer = threading.Timer(rng.uniform(0.0, 0.8 * whole), os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            try:
                assert len(llm.generate(prompts, params, use_tqdm=False)) == len(prompts)
            finally:
                timer.join()  # the signal is sent by the time this returns
        except KeyboardInterrupt:
            interrupted += 1
        assert not engine.has_unfinished_requests() and engine.request_ids == []
        assert engine.cache_manager.num_free_blocks == engine.cache_manager.num_blocks
    assert interrupted == 3, f"only {interrupted} of {attempts} runs were interrupted"
    out = llm.generate([PROMPT], params, use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("template", ["{% for m in messages %}{{ m.content }", "{{ raise_exception('no') }}"])
def test_a_broken_chat_template_is_a_value_error_naming_it(llm, template: str) -> None:
    with pytest.raises(ValueError, match="chat_template could not render"):
        llm.chat([{"role": "user", "content": "hi"}], chat_template=template, use_tqdm=False)


def test_best_of_reports_the_n_most_likely_of_its_samples(llm) -> None:
    params = SamplingParams(n=2, best_of=5, seed=3, temperature=1.0, max_tokens=6, ignore_eos=True)
    best = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs
    every = llm.generate([PROMPT], dataclasses.replace(params, n=5, best_of=None, logprobs=0),
                         use_tqdm=False)[0].outputs  # fmt: skip
    top = sorted(every, key=lambda o: -o.cumulative_logprob)[:2]
    assert sorted(o.token_ids for o in best) == sorted(o.token_ids for o in top)
    assert [o.index for o in best] == [0, 1]
    for kwargs, match in (({"n": 3, "best_of": 2}, "best_of must be >= n"),
                          ({"best_of": 2, "temperature": 0}, "temperature > 0")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kwargs)


def test_hf_overrides_change_the_config_before_the_weights_load() -> None:
    llm = LLM(num_kv_blocks=16, hf_overrides={"rms_norm_eps": 0.5})
    assert llm.llm_engine.model.config.rms_norm_eps == 0.5
    plain = LLM(num_kv_blocks=16).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )
    moved = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert plain[0].outputs[0].token_ids != moved[0].outputs[0].token_ids  # the norms read it
    called = LLM(num_kv_blocks=16, hf_overrides=lambda config: config)  # a function of the config works too
    assert called.llm_engine.model.config.rms_norm_eps != 0.5


def test_reset_prefix_cache_with_running_requests_recomputes_them(llm) -> None:
    engine = llm.llm_engine
    prompt = list(range(100, 130))
    want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=12))
    for _ in range(4):
        engine.step()
    assert engine.reset_prefix_cache() is False  # a running request still holds cached blocks
    assert engine.reset_prefix_cache(reset_running_requests=True) is True
    assert engine.cache_manager.lookup_prefix(engine.sequences("r")[0]) == 0
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert done["r"].outputs[0].token_ids == want.token_ids


def test_a_seed_seeds_the_programs_own_generators_as_vllm_does() -> None:
    import random

    LLM(num_kv_blocks=16, seed=42)
    first = random.randint(0, 10**9)
    LLM(num_kv_blocks=16, seed=42)
    assert random.randint(0, 10**9) == first


def test_profiler_config_and_cleanup(tmp_path, monkeypatch) -> None:
    from paged_attention import cleanup_dist_env_and_memory

    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    llm = LLM(num_kv_blocks=16, profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path)})
    llm.start_profile()
    llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.stop_profile().parent == tmp_path
    with pytest.raises(ValueError, match="profiler_config"):
        LLM(num_kv_blocks=16, profiler_config={"profiler": "cuda"})
    del llm
    cleanup_dist_env_and_memory()


def test_a_script_without_a_main_guard_runs(tmp_path) -> None:
    """One process here: a top-level script needs no ``if __name__ == "__main__":`` (vLLM's
    spawned engine core does; the README's compatibility table says so)."""
    import subprocess
    import sys

    script = tmp_path / "plain.py"
    script.write_text(
        "from paged_attention import LLM, SamplingParams\n"
        "llm = LLM(model='paged-attention/tiny-llama', num_kv_blocks=16)\n"
        "out = llm.generate(['Hello'], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)\n"
        "print(len(out[0].outputs[0].token_ids))\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "3"
