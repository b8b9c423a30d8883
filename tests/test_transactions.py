"""A step is a transaction: faults injected anywhere inside ``LLMEngine.step`` change nothing.

Exceptions (KeyboardInterrupt, RuntimeError, MemoryError) are raised at points hypothesis picks:
in the model forward (before it, or after it has written its K/V), in the K/V store of one layer,
the sampler, a block allocation, a copy-on-write or swap copy, a fork, a detokenization, a stop
check and a finish (the last four inside the scheduler's end of the step, ``update_from_output``),
and a request's output. After
every fault the engine must hold exactly the memory its page tables say, and the run, carried on,
must finish with the outputs of the same run without faults: every request, token for token.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_attention import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from paged_attention.engine.llm_engine import LLMEngine
from paged_attention.engine.parallel_sampling import SamplingRequest
from paged_attention.engine.sample.sampling import RequestOutputKind, Sampler
from paged_attention.engine.worker import model_runner
from paged_attention.memory.paged_manager import PagedKVCacheManager

SITES = ("forward", "forward_after", "store", "sampler", "allocate", "copy", "swap", "fork", "detokenize",
         "stop", "finish", "output")  # fmt: skip
ERRORS = (KeyboardInterrupt, RuntimeError, MemoryError)

# (name, engine settings): tiny caches, so that requests preempt each other.
CONFIGS = {
    "recompute+prefix": dict(preemption_mode="recompute", enable_prefix_caching=True),
    "recompute": dict(preemption_mode="recompute", enable_prefix_caching=False),
    "swap+prefix": dict(preemption_mode="swap", enable_prefix_caching=True, num_cpu_blocks=12),
    "recompute+prefix+ngram": dict(
        preemption_mode="recompute",
        enable_prefix_caching=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    ),
    # quantized pages: int8 scales per block go with swapped and copied blocks; fp8 scales are set
    # by the first step (calculate_kv_scales), and a rolled-back first step sets them again
    "int8+swap+prefix+ngram": dict(
        preemption_mode="swap",
        enable_prefix_caching=True,
        num_cpu_blocks=12,
        kv_cache_dtype="int8",
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    ),
    "fp8+recompute+prefix": dict(
        preemption_mode="recompute",
        enable_prefix_caching=True,
        kv_cache_dtype="fp8",
        calculate_kv_scales=True,
    ),
}
SHARED = [3, 14, 15, 9, 26, 5, 35, 8]  # a common prefix: prefix-cache hits
MISSING = object()
DELTA = RequestOutputKind.DELTA
SEEN: dict[str, Counter] = {config: Counter() for config in CONFIGS}  # what the unfaulted runs did


def workload() -> list[tuple[list[int], SamplingParams | BeamSearchParams]]:
    """Samples (seeded and not), greedy requests, a beam search, stop tokens and strings, a shared
    prefix, log-probabilities (sampled and prompt), penalties and structured outputs (a grammar's
    matcher must step back with the step)."""
    return [
        ([*SHARED, 40, 41], SamplingParams(max_tokens=8, n=3, seed=7, temperature=0.9)),
        ([7, 8, 9], SamplingParams(max_tokens=9, temperature=0.0)),
        ([*SHARED, 50], SamplingParams(max_tokens=7, n=2, temperature=1.0, top_k=20, output_kind=DELTA)),
        ([11, 12, 13, 14, 15], BeamSearchParams(beam_width=2, max_tokens=5)),
        ([*SHARED, 60, 61, 62], SamplingParams(max_tokens=8, seed=3, stop_token_ids=[17, 101])),
        ([21, 22], SamplingParams(max_tokens=6, temperature=0.7, seed=11, min_tokens=2, stop=["e"])),
        (
            [*SHARED, 70, 71],
            SamplingParams(
                max_tokens=6,
                temperature=0.8,
                seed=5,
                logprobs=2,
                prompt_logprobs=1,
                repetition_penalty=1.3,
                frequency_penalty=0.5,
                output_kind=DELTA,
            ),
        ),
        ([31, 32, 33], SamplingParams(max_tokens=16, seed=13, structured_outputs=GRAMMAR)),
        ([*SHARED, 80], SamplingParams(max_tokens=14, n=2, seed=2, structured_outputs=CHOICE)),
    ]


GRAMMAR = StructuredOutputsParams(regex="(ab|cd)+[0-9]")
CHOICE = StructuredOutputsParams(choice=["alpha", "gamma", "delta zeta"])


@functools.cache
def engine_model():
    """One tiny model for every engine here (the engines differ only in their caches)."""
    engine = LLM(num_kv_blocks=8, block_size=4).llm_engine
    return engine.model, engine.tokenizer


def make_engine(config: str) -> LLMEngine:
    model, tokenizer = engine_model()
    return LLMEngine(model, tokenizer, num_kv_blocks=12, block_size=4, max_num_batched_tokens=16,
                     max_num_seqs=6, watermark=0.0, **CONFIGS[config])  # fmt: skip


def check_memory(engine: LLMEngine) -> None:
    """Every device block is free or held exactly as often as the page tables say; every CPU block
    likewise for the swapped sequences; every running sequence's table holds its computed tokens."""
    manager = engine.cache_manager
    assert isinstance(manager, PagedKVCacheManager)
    held = Counter(b for table in manager.page_tables.values() for b in table.block_ids)
    allocator = manager.allocator
    for block in allocator.blocks:
        assert block.ref_cnt == held[block.block_id], (block, held[block.block_id])
    assert sorted(allocator.free_block_ids()) == [b for b in range(manager.num_blocks) if not held[b]]
    assert allocator.num_free_blocks == manager.num_blocks - len(held)
    running = {s.seq_id: s for s in engine.scheduler.running}
    for seq_id, table in manager.page_tables.items():
        assert seq_id in running, f"sequence {seq_id} holds blocks but is not running"
        assert table.num_tokens == running[seq_id].num_computed_tokens
    if manager.cpu_allocator is not None:
        cpu = manager.cpu_allocator
        assert cpu.num_free_blocks + sum(1 for b in cpu.blocks if b.ref_cnt) == cpu.num_blocks
        assert manager.num_swapped == len(engine.scheduler.swapped)


class Injector:
    """Raises ``error`` at the ``fault``-th call of any instrumented site in ``sites`` (then again at
    each later point in ``faults``); counts every call."""

    def __init__(self, faults: list[int], sites: set[str], error: type[BaseException]) -> None:
        self.faults, self.sites, self.error = set(faults), sites, error
        self.calls = 0
        self.fired = 0

    def tick(self, site: str) -> None:
        if site not in self.sites:
            return
        self.calls += 1
        if self.calls in self.faults:
            self.fired += 1
            raise self.error(f"injected at {site}, call {self.calls}")

    def wrap(self, site: str, fn: Callable, after: str | None = None) -> Callable:
        def wrapped(*args, **kwargs):
            self.tick(site)
            result = fn(*args, **kwargs)
            if after is not None:
                self.tick(after)
            return result

        return wrapped


class FaultySampler:
    """The engine's sampler, with a fault point before each call (its generator is the same)."""

    def __init__(self, sampler: Sampler, injector: Injector) -> None:
        self.sampler, self.injector = sampler, injector
        self.shared_generator = sampler.shared_generator

    def __call__(self, *args, **kwargs):
        self.injector.tick("sampler")
        return self.sampler(*args, **kwargs)

    def draw(self, *args, **kwargs):  # what the engine calls: the same fault point
        self.injector.tick("sampler")
        return self.sampler.draw(*args, **kwargs)

    def targets(self, *args, **kwargs):  # what speculative verification calls: mid-verification
        self.injector.tick("sampler")
        return self.sampler.targets(*args, **kwargs)

    def __getattr__(self, name: str):  # begin, commit, rollback: the sampler's own
        return getattr(self.sampler, name)


def instrument(engine: LLMEngine, injector: Injector) -> Callable[[], None]:
    """Patch the engine's parts to call the injector; returns the undo."""
    manager = engine.cache_manager
    runner, kv = engine.runner, engine.kv_cache
    allocator = getattr(manager, "allocator", None)  # a contiguous manager has none: its slots, then
    allocation = (allocator, "allocate") if allocator is not None else (manager, "allocate_slots")
    patches = [
        (runner, "execute", injector.wrap("forward", runner.execute, after="forward_after")),
        (engine, "sampler", FaultySampler(engine.sampler, injector)),
        (*allocation, injector.wrap("allocate", getattr(*allocation))),
        (kv, "copy_blocks", injector.wrap("copy", kv.copy_blocks)),
        (kv, "copy_blocks_to", injector.wrap("swap", kv.copy_blocks_to)),
        (manager, "fork", injector.wrap("fork", manager.fork)),
        (engine.detokenizer, "update", injector.wrap("detokenize", engine.detokenizer.update)),
        (engine.stop_rules, "check", injector.wrap("stop", engine.stop_rules.check)),
        (engine.scheduler, "finish", injector.wrap("finish", engine.scheduler.finish)),
        (SamplingRequest, "output", injector.wrap("output", SamplingRequest.output)),
    ]
    if engine.cpu_cache is not None:
        cpu = engine.cpu_cache
        patches.append((cpu, "copy_blocks_to", injector.wrap("swap", cpu.copy_blocks_to)))
    store = model_runner.kernels.store_kv
    patches.append((model_runner.kernels, "store_kv", injector.wrap("store", store)))
    # What each attribute was, or that it was none of the instance's own (a method of its class).
    saved = [(obj, name, vars(obj).get(name, MISSING)) for obj, name, _ in patches]
    for obj, name, fn in patches:
        setattr(obj, name, fn)

    def undo() -> None:
        for obj, name, fn in reversed(saved):
            if fn is MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, fn)

    return undo


def serve(config: str, injector: Injector | None = None) -> tuple[dict, int]:
    """Serve the workload to the end, carrying on after every injected fault; checks memory after
    each fault and at the end. Returns every streamed output by request, and the number of faults."""
    engine = make_engine(config)
    for i, (prompt, params) in enumerate(workload()):
        engine.add_request(str(i), prompt, params)
    undo = instrument(engine, injector) if injector else (lambda: None)
    outputs, faults = {}, 0
    schedule = engine.scheduler.schedule

    def counted():  # what the steps did, for the test that the faults strike where it matters
        out = schedule()
        SEEN[config].update(
            copies=len(out.block_copies),
            swaps=len(out.swap_out),
            preempted=len(out.preempted),
            drafts=sum(len(s.drafts) for s in out.scheduled),
        )
        return out

    if injector is None:
        engine.scheduler.schedule = counted
    try:
        for _ in range(500):
            if not engine.has_unfinished_requests():
                break
            try:
                step = engine.step()
            except (KeyboardInterrupt, RuntimeError, MemoryError) as err:
                assert "injected" in str(err)
                faults += 1
                check_memory(engine)
                continue
            for out in step:  # the whole stream, every step's output (one request's are DELTAs)
                stream = outputs.setdefault(out.request_id, [])
                stream.append(
                    [(c.index, c.text, list(c.token_ids), c.finish_reason, c.cumulative_logprob,
                      repr(c.logprobs)) for c in out.outputs] + [repr(out.prompt_logprobs)]
                )  # fmt: skip
    finally:
        undo()
    assert not engine.has_unfinished_requests()
    assert engine.cache_manager.num_free_blocks == engine.cache_manager.num_blocks
    check_memory(engine)
    if injector is None:
        SEEN[config]["prefix_hits"] += engine.cache_manager.prefix_cache_stats.hits
    return outputs, faults


@functools.cache
def unfaulted(config: str) -> tuple[dict, int]:
    outputs, _ = serve(config)
    engine = make_engine(config)
    return outputs, engine.cache_manager.num_blocks


@pytest.mark.parametrize("config", sorted(CONFIGS))
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    faults=st.lists(st.integers(1, 60), min_size=1, max_size=4),
    sites=st.sets(st.sampled_from(SITES), min_size=1, max_size=4),
    error=st.sampled_from(ERRORS),
)
def test_a_fault_anywhere_in_a_step_changes_no_output(config, faults, sites, error) -> None:
    want, _ = unfaulted(config)
    got, _ = serve(config, Injector(faults, sites, error))
    assert got == want


def test_the_workload_preempts_forks_swaps_and_hits_the_prefix_cache() -> None:
    """The faults above strike where it matters: the unfaulted runs preempt, swap, fork, copy on
    write and hit the prefix cache."""
    for config in ("recompute+prefix", "swap+prefix"):
        unfaulted(config)
        seen = SEEN[config]
        assert seen["copies"] and seen["preempted"] and seen["prefix_hits"], seen
        assert bool(seen["swaps"]) == config.startswith("swap"), seen
    for config in ("recompute+prefix+ngram", "int8+swap+prefix+ngram"):
        unfaulted(config)  # and drafts are verified (and truncated) mid-workload
        assert SEEN[config]["drafts"] > 0
    seen = SEEN["int8+swap+prefix+ngram"]  # quantized pages are swapped, copied and shared too
    assert seen["copies"] and seen["swaps"] and seen["prefix_hits"], seen


def test_the_structured_requests_of_the_workload_match_their_grammars() -> None:
    """Whatever the cache does to them (preempted, swapped, drafted for), the two structured
    requests end with text their grammar matches, every sample of them."""
    for config in CONFIGS:
        outputs, _ = unfaulted(config)
        for request_id, matches in ((str(len(workload()) - 2), lambda t: re.fullmatch(GRAMMAR.regex, t)),
                                    (str(len(workload()) - 1), lambda t: t in CHOICE.choice)):  # fmt: skip
            last = outputs[request_id][-1]
            for index, text, _, reason, *_ in last[:-1]:
                assert reason == "stop" and matches(text), (config, request_id, index, text, reason)


def test_a_swapped_victim_whose_blocks_the_step_reused_gets_its_kv_back() -> None:
    """A step swaps a sequence out, gives its device blocks to another, writes there, and fails. The
    rollback brings the victim back on the device: its blocks must hold its own K/V again, or the
    redone step would copy the other's K/V to the CPU in its place."""
    model, tokenizer = engine_model()

    def run(faults: list[int]) -> tuple[dict, int]:
        engine = LLMEngine(model, tokenizer, num_kv_blocks=24, block_size=4, max_num_batched_tokens=64,
                           preemption_mode="swap", max_model_len=64)  # fmt: skip
        for i in range(6):
            prompt = [1 + i, 5, 7, 9, 11, 13][: 3 + i % 3] * 2
            params = SamplingParams(max_tokens=8, n=1 + i % 3, seed=i, temperature=0.8)
            engine.add_request(str(i), prompt, params)
        undo = instrument(engine, injector := Injector(faults, {"forward_after"}, KeyboardInterrupt))
        outputs = {}
        while engine.has_unfinished_requests():
            try:
                done = [o for o in engine.step() if o.finished]
                outputs |= {o.request_id: [c.token_ids for c in o.outputs] for o in done}
            except KeyboardInterrupt:
                check_memory(engine)
        undo()
        assert engine.scheduler.num_preemptions > 0
        return outputs, injector.fired

    want, _ = run([])
    got, fired = run([1, 2, 6])
    assert fired == 3 and got == want


def interrupt_at_call(engine, call: int) -> None:
    """Make the engine's model runner raise KeyboardInterrupt (Ctrl-C) on its ``call``-th forward;
    ``del engine.runner.execute`` restores it."""
    execute, calls = engine.runner.execute, 0

    def interrupted(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == call:
            raise KeyboardInterrupt
        return execute(*args, **kwargs)

    engine.runner.execute = interrupted


def test_an_interrupted_generate_aborts_its_requests_and_the_next_one_works() -> None:
    llm = LLM(num_kv_blocks=32, block_size=4, max_model_len=64)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=8, temperature=0.0)
    want = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)]
    engine.add_request("mine", [1, 2, 3], params)  # a request of the caller's own, not generate's
    interrupt_at_call(engine, 3)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    del engine.runner.execute
    assert engine.request_ids == ["mine"]  # generate's requests are gone, the caller's stays
    engine.abort_request("mine")
    assert engine.cache_manager.num_free_blocks == engine.cache_manager.num_blocks
    got = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)]
    assert got == want


def test_an_interrupted_beam_search_leaves_nothing_held() -> None:
    llm = LLM(num_kv_blocks=64, block_size=4, max_model_len=64)
    engine = llm.llm_engine
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    want = [[s.tokens for s in o.sequences] for o in llm.beam_search([[5, 6, 7]], params)]
    interrupt_at_call(engine, 4)
    with pytest.raises(KeyboardInterrupt):
        llm.beam_search([[5, 6, 7]], params)
    del engine.runner.execute
    assert not engine.has_unfinished_requests()
    assert engine.cache_manager.num_free_blocks == engine.cache_manager.num_blocks
    assert [[s.tokens for s in o.sequences] for o in llm.beam_search([[5, 6, 7]], params)] == want


def test_a_rolled_back_step_gives_evicted_prefix_blocks_their_kv_back() -> None:
    """A step evicts a cached prefix to make room, writes there, and fails; its request is then
    aborted, so no step redoes the work. The cached prefix must still hold its own K/V: a later
    request that hits it must produce what it would have produced anyway."""
    model, tokenizer = engine_model()
    prompt = [3, 14, 15, 9, 26, 5, 35, 8, 97, 93, 23, 84, 62]  # three full blocks of 4, and one more
    params = SamplingParams(max_tokens=6, temperature=0.0)

    def run(fault: bool) -> list[int]:
        engine = LLMEngine(model, tokenizer, num_kv_blocks=8, block_size=4, watermark=0.0, max_model_len=32)
        engine.add_request("first", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()  # its blocks are free now, and cached
        engine.add_request("other", list(range(40, 70)), SamplingParams(max_tokens=2))  # takes every block
        if fault:
            injector = Injector([1], {"forward_after"}, KeyboardInterrupt)
            undo = instrument(engine, injector)
            with pytest.raises(KeyboardInterrupt):
                engine.step()
            undo()
            engine.abort_request("other")
        else:
            engine.abort_request("other")
        engine.add_request("again", prompt, params)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
        assert engine.cache_manager.prefix_cache_stats.hits >= 12  # the prefix was found again
        return outputs[0].outputs[0].token_ids

    assert run(fault=True) == run(fault=False)
