"""A rolled-back step leaves *every* part of the engine as it was: found by walking, not by listing.

``state_of`` walks everything reachable from a live engine (scheduler, policy, cache manager, page
tables, allocator and its linked free queue, prefix cache, requests, sequences, generators, KV
tensors, sampler, runner timings) and turns it into one nested value in which shared objects are
named by the order they were first reached. A fault is injected at a point of a step; the state
after the rollback must equal the state before the step, whole. A part that forgets to restore
itself, or a new field nobody saves, fails here without anyone having to list it.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import itertools
import sys
from collections import Counter, deque
from types import FunctionType, MappingProxyType, MethodType, ModuleType

import pytest
import torch
import xgrammar
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from paged_attention.baselines.contiguous import ContiguousKVCacheManager
from paged_attention.baselines.engines import baseline_engine
from paged_attention.engine.beam_search import BeamSearchRequest
from paged_attention.engine.core.scheduler import Scheduler
from paged_attention.engine.llm_engine import LLMEngine
from paged_attention.engine.parallel_sampling import SamplingRequest
from paged_attention.engine.sample.sampling import SamplingParams
from paged_attention.engine.sequence import Sequence
from paged_attention.engine.worker.kv_cache import KVCache
from paged_attention.memory.allocator import BlockAllocator, KVCacheBlock
from paged_attention.memory.page_table import PageTable
from paged_attention.memory.paged_manager import PagedKVCacheManager

from .test_transactions import SITES, Injector, engine_model, instrument, make_engine, workload

SKIPPED = (
    torch.nn.Module,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    FunctionType,
    MethodType,
    ModuleType,
    type,
    # xgrammar's objects (C++, opaque): a Grammar's state is the output tokens its matcher consumed
    xgrammar.GrammarMatcher,
    xgrammar.CompiledGrammar,
    xgrammar.GrammarCompiler,
)


def live_kv(engine: LLMEngine, cache: KVCache) -> str:
    """A digest of the K/V that mean something: the slots each page table (or contiguous
    reservation) has written, every slot of a block the prefix cache names, and on the CPU the
    slots of the swapped sequences. The rest of the tensor is garbage by design (a step writes free
    blocks, and slots past what is computed, without saving them): it may differ after a rollback."""
    manager = engine.cache_manager
    written: dict[int, int] = {}
    if isinstance(manager, ContiguousKVCacheManager):  # one-slot blocks, one range per request
        for res in manager.reservations.values():
            written |= {slot: 1 for slot in range(res.start, res.start + res.num_tokens)}
    elif cache is engine.kv_cache:
        assert isinstance(manager, PagedKVCacheManager)
        for table in manager.page_tables.values():
            for block, count in table.filled_slots():
                written[block] = max(written.get(block, 0), count)
        for block in getattr(manager.allocator, "cached_blocks", {}).values():
            written[block] = cache.block_size
    else:
        assert isinstance(manager, PagedKVCacheManager)
        for cpu_blocks, num_tokens in manager._swapped.values():  # a test may read private state
            for i, block in enumerate(cpu_blocks):
                written[block] = min(cache.block_size, num_tokens - i * cache.block_size)
    digest = hashlib.sha256()
    for block in sorted(written):
        data = cache.data[:, :, block, : written[block]].contiguous()
        digest.update(repr((block, written[block])).encode())
        digest.update(data.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def state_of(root: object) -> tuple[object, dict[type, int]]:
    """``root``'s whole reachable state as one comparable value, and how many objects of each type
    the walk met (so that a test can show it reached every part). A KV cache is compared by its
    live slots (:func:`live_kv`), with its other attributes."""
    labels: dict[int, int] = {}
    seen: dict[type, int] = {}
    keep: list[object] = []  # holds what was walked, so that no id is reused during the walk

    def walk(obj: object) -> object:
        if obj is None or isinstance(obj, (bool, int, float, str, bytes, enum.Enum)):
            return obj
        if isinstance(obj, (torch.dtype, torch.device)):
            return repr(obj)
        if isinstance(obj, SKIPPED):
            return ("skipped", type(obj).__name__)
        if id(obj) in labels:
            return ("ref", labels[id(obj)])
        labels[id(obj)] = len(labels)
        keep.append(obj)
        seen[type(obj)] = seen.get(type(obj), 0) + 1
        if isinstance(obj, KVCache) and isinstance(root, LLMEngine):
            rest = {k: v for k, v in vars(obj).items() if k != "data"}
            return ("KVCache", live_kv(root, obj), walk(rest))
        if isinstance(obj, torch.Tensor):
            data = obj.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
            return ("tensor", tuple(obj.shape), str(obj.dtype), hashlib.sha256(data).hexdigest())
        if isinstance(obj, torch.Generator):
            return ("generator", hashlib.sha256(obj.get_state().numpy().tobytes()).hexdigest())
        if isinstance(obj, (list, tuple, deque)):
            return (type(obj).__name__, [walk(x) for x in obj])
        if isinstance(obj, (dict, MappingProxyType)):  # a map: its order means nothing (queues
            return ("dict", sorted((repr(walk(k)), walk(v)) for k, v in obj.items()))  # are lists)
        if isinstance(obj, (set, frozenset)):
            return ("set", sorted(repr(walk(x)) for x in obj))
        if isinstance(obj, itertools.count):
            return ("count", repr(obj))
        slots = [name for cls in type(obj).__mro__ for name in getattr(cls, "__slots__", ())]
        assert hasattr(obj, "__dict__") or slots, f"cannot see inside {type(obj).__name__}"
        attributes = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
        for name in slots:  # __slots__ classes (the allocator's blocks) too
            if hasattr(obj, name):
                attributes[name] = getattr(obj, name)
        return (type(obj).__name__, [(name, walk(value)) for name, value in sorted(attributes.items())])

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20_000))  # the free queue is a linked list
    try:
        return walk(root), seen
    finally:
        sys.setrecursionlimit(limit)


def first_difference(a: object, b: object, path: str = "engine") -> str:
    """Where two walked states first differ, as an attribute path (for the failure message)."""
    if type(a) is not type(b) or not isinstance(a, (tuple, list)) or len(a) != len(b):
        return f"at {path}: {a!r:.200} != {b!r:.200}"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            name = x[0] if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) else i
            return first_difference(x, y, f"{path}.{name}" if isinstance(name, str) else f"{path}[{i}]")
    return f"at {path}"


def faulted_run(config: str, site: str, call: int) -> tuple[int, set[type]]:
    return faulted_engine_run(make_engine(config), workload(), site, call)


def faulted_engine_run(engine: LLMEngine, requests: list, site: str, call: int) -> tuple[int, set[type]]:
    """Serve the workload; fault every step at the ``call``-th pass through ``site`` and compare
    the whole state after the rollback with the state before, then run the step for real. Returns
    how many faults fired and the types the walks met."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    fired, met = 0, set()
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        before, seen = state_of(engine)
        met |= set(seen)
        order = engine.request_ids  # the one map whose order shows: outputs come in it
        undo = instrument(engine, Injector([call], {site}, KeyboardInterrupt))
        try:
            engine.step()
            continue  # the point was not reached in this step: it ran whole
        except KeyboardInterrupt:
            fired += 1
        finally:
            undo()
        after, _ = state_of(engine)
        assert after == before, f"{site} call {call}: the rollback left the state changed " + (
            first_difference(before, after)
        )
        assert engine.request_ids == order
        engine.step()
    assert not engine.has_unfinished_requests()
    return fired, met


#: Points a step passes once (one forward, one sampler call, one copy-on-write batch, one swap
#: batch), and points it passes many times (every layer's store, every block, fork, token, finish,
#: request output).
ONCE, OFTEN = (
    ("forward", "forward_after", "sampler", "copy", "swap"),
    ("store", "allocate", "fork", "detokenize", "stop", "finish", "output"),
)


@pytest.mark.parametrize("config", ["recompute+prefix", "swap+prefix"])
def test_a_rolled_back_step_restores_every_reachable_part(config) -> None:
    assert sorted(ONCE + OFTEN) == sorted(SITES)
    fired, met = Counter(), set()
    for site, call in [(site, 1) for site in SITES] + [(site, 2) for site in OFTEN]:
        fired[site, call], seen = faulted_run(config, site, call)
        met |= seen
    missed = {key for key, n in fired.items() if not n}
    assert missed == (set() if config.startswith("swap") else {("swap", 1)}), fired
    parts = (LLMEngine, Scheduler, PagedKVCacheManager, BlockAllocator, KVCacheBlock, PageTable,
             SamplingRequest, BeamSearchRequest, Sequence, KVCache, torch.Generator)  # fmt: skip
    assert all(any(issubclass(cls, part) for cls in met) for part in parts), met


@pytest.mark.parametrize(
    ("policy", "placement", "static"), [("max", "buddy", True), ("oracle", "first-fit", False)]
)
def test_a_contiguous_cache_and_a_static_batch_roll_back_whole_too(policy, placement, static) -> None:
    """The baselines' parts (a reserved range per request, buddy or first-fit holes, the static
    batching policy's batch) own their undo as well."""
    model, tokenizer = engine_model()
    requests = [(p, params) for p, params in workload() if isinstance(params, SamplingParams)]  # no beams
    fired = Counter()
    for site in ("forward", "forward_after", "store", "sampler", "allocate", "detokenize", "stop"):
        engine = baseline_engine(model, tokenizer, kv_manager=policy, placement=placement,
                                 static_batching=static, num_kv_blocks=24, block_size=4,
                                 max_num_batched_tokens=16, max_num_seqs=6, max_model_len=24)  # fmt: skip
        fired[site], _ = faulted_engine_run(engine, requests, site, 1)
    assert all(fired.values()), fired


def test_the_walk_catches_a_part_that_does_not_restore_itself(monkeypatch) -> None:
    """The check above can fail: a sequence that forgets its undo is caught at once."""
    monkeypatch.setattr(Sequence, "rollback", lambda self: setattr(self, "_saved", None))
    with pytest.raises(AssertionError, match="the rollback left the state changed"):
        faulted_run("recompute", "stop", 1)


def test_a_sequence_names_every_field_it_has_as_mutable_or_fixed() -> None:
    fields = {f.name for f in dataclasses.fields(Sequence)} - {"_saved"}
    split = [*Sequence.MUTABLE, *Sequence.APPEND_ONLY, *Sequence.FIXED]
    assert sorted(split) == sorted(fields) and len(split) == len(set(split))


def interrupt_once(monkeypatch, obj: object, method: str, after: bool = False) -> list[int]:
    """``obj.method`` raises KeyboardInterrupt on its first call (before it runs, or ``after``);
    returns a list that counts the interrupts."""
    fired, original = [], getattr(obj, method)

    def interrupted(*args, **kwargs):
        if not fired and not after:
            fired.append(1)
            raise KeyboardInterrupt
        result = original(*args, **kwargs)
        if not fired:
            fired.append(1)
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(obj, method, interrupted)
    return fired


def streams(engine: LLMEngine, interrupted: bool = False, seen: dict | None = None) -> dict[str, list]:
    """Serve the workload (added first, unless ``seen`` holds what was streamed so far); every
    streamed output by request, carrying on after a KeyboardInterrupt if ``interrupted``."""
    if seen is None:
        seen = {}
        for i, (prompt, params) in enumerate(workload()):
            engine.add_request(str(i), prompt, params)
    for _ in range(300):
        if not engine.has_unfinished_requests():
            break
        try:
            step = engine.step()
        except KeyboardInterrupt:
            assert interrupted
            continue
        for out in step:
            seen.setdefault(out.request_id, []).append([(c.text, list(c.token_ids)) for c in out.outputs])
    assert not engine.has_unfinished_requests()
    assert engine.cache_manager.num_free_blocks == engine.cache_manager.num_blocks
    return seen


def test_an_interrupt_while_committing_loses_no_output(monkeypatch) -> None:
    """Ctrl-C after a step's results stand, while its parts drop their undo records: nothing is undone,
    and the step's outputs come with the next step, so every stream is whole."""
    want = streams(make_engine("recompute+prefix"))
    engine = make_engine("recompute+prefix")
    fired = interrupt_once(monkeypatch, engine.scheduler, "commit", after=True)
    assert streams(engine, interrupted=True) == want and fired


@pytest.mark.parametrize("part", ["scheduler", "cache_manager"])
def test_an_interrupt_while_beginning_changes_nothing(monkeypatch, part) -> None:
    """Ctrl-C while the step's parts record their undo (some have, some have not): the state is as
    before, and the run carries on to the same streams as a run never interrupted."""
    want = streams(make_engine("swap+prefix"))
    engine = make_engine("swap+prefix")
    for i, (prompt, params) in enumerate(workload()):
        engine.add_request(str(i), prompt, params)
    seen: dict[str, list] = {}
    for out in engine.step():
        seen.setdefault(out.request_id, []).append([(c.text, list(c.token_ids)) for c in out.outputs])
    before, _ = state_of(engine)
    interrupt_once(monkeypatch, getattr(engine, part), "begin")
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    monkeypatch.undo()  # (the patched method is no part of the state)
    after, _ = state_of(engine)
    assert after == before, first_difference(before, after)
    assert streams(engine, seen=seen) == want


def test_a_rollback_that_fails_in_one_part_still_restores_the_others(monkeypatch) -> None:
    """A second error while rolling back (a device error writing K/V back, another Ctrl-C) stops
    only that part: the bookkeeping is restored, and the first error of the rollback goes on."""
    engine = make_engine("recompute+prefix")
    for i, (prompt, params) in enumerate(workload()):
        engine.add_request(str(i), prompt, params)
    engine.step()
    before, _ = state_of(engine)
    interrupt_once(monkeypatch, engine.kv_cache, "rollback", after=True)  # K/V restored, then Ctrl-C
    undo = instrument(engine, Injector([1], {"stop"}, RuntimeError))
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.step()
    finally:
        undo()
    monkeypatch.undo()  # (the patched method is no part of the state)
    after, _ = state_of(engine)
    assert after == before, first_difference(before, after)
