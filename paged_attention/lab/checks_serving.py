"""Checks of the serving exercises: the scheduler's admission rule and preemption victim (first on
small named situations, then by replaying traces), and first-fit placement with hole merging."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from ..baselines.placement import FirstFitAllocator
from ..engine.core.scheduler import SchedulingPolicy
from ..engine.params import SamplingParams
from ..engine.sequence import Sequence
from ..experiments.replay import run_trace
from ..experiments.traces import TraceRequest
from ..memory.paged_manager import PagedKVCacheManager
from .checking import CheckFailed, expect
from .student import Student, driver

# -- 04.scheduling_policy: admission ---------------------------------------------------------------


@dataclass(frozen=True)
class Situation:
    """A cache in a given state and a prompt at the head of the waiting queue (see :func:`build`).

    ``running`` tokens are held by a running sequence, ``freed`` tokens were computed by a finished
    one (its full blocks are cached, in the free queue), ``filler`` tokens take blocks to set how
    many are free. The prompt starts with ``hit`` tokens of the running (``hit_from="running"``)
    or the finished sequence's tokens, which the prefix cache finds."""

    name: str
    num_blocks: int
    block_size: int
    watermark_blocks: int
    prompt_len: int
    hit: int = 0
    hit_from: str = ""
    running: int = 0
    freed: int = 0
    filler: int = 0
    hint: str = ""


def build(s: Situation) -> tuple[PagedKVCacheManager, Sequence, int]:
    """The manager, the waiting sequence (its ``num_computed_tokens`` set by a prefix lookup) and
    ``num_new_tokens`` of a situation; the same situation builds the same state on either side."""
    manager = PagedKVCacheManager(
        s.num_blocks,
        s.block_size,
        watermark=(s.watermark_blocks + 0.5) / s.num_blocks,
        enable_prefix_caching=True,
    )
    streams = {
        "running": list(range(1000, 1000 + s.running)),
        "freed": list(range(2000, 2000 + s.freed)),
        "filler": list(range(3000, 3000 + s.filler)),
    }
    for seq_id, (role, tokens) in enumerate(streams.items()):
        if not tokens:
            continue
        seq = Sequence(seq_id, role, tokens, SamplingParams(max_tokens=1), arrival_time=0.0)
        if manager.allocate_slots(seq, len(tokens)) is None:
            raise ValueError(f"situation {s.name!r} does not fit its cache")
        seq.num_computed_tokens = len(tokens)
    if s.freed:
        manager.free(1)  # the finished sequence: its full blocks stay cached, in the free queue
    prompt = streams.get(s.hit_from, [])[: s.hit] + list(range(5000, 5000 + s.prompt_len - s.hit))
    seq = Sequence(9, "new", prompt, SamplingParams(max_tokens=1), arrival_time=1.0)
    seq.num_computed_tokens = manager.lookup_prefix(seq)
    return manager, seq, s.prompt_len - seq.num_computed_tokens


WATERMARK_RULE = "admit only if num_free_blocks minus the blocks it takes stays >= watermark_blocks"
ROUND_UP = "9 tokens in blocks of 4 take 3 blocks: round up, -(-tokens // block_size)"
HELD_HIT = (
    "the prompt's first num_computed_tokens are a prefix-cache hit in blocks a running sequence holds: "
    "they exist already and cost no free block; count only the blocks for the tokens after them"
)
FREE_HIT = (
    "the prefix-cache hit's blocks sit in the free queue (cached, held by no one): taking them out of it "
    "costs free blocks too, cache_manager.num_free_prefix_blocks(seq) of them"
)

SITUATIONS = (
    Situation(
        "a 16-token prompt in blocks of 4, 5 of 10 blocks free, watermark 1",
        10,
        4,
        1,
        16,
        filler=20,
        hint="4 blocks leave 1 free, exactly the watermark: admit (>=, not >)",
    ),
    Situation(
        "a 20-token prompt in blocks of 4, 5 of 10 blocks free, watermark 1",
        10,
        4,
        1,
        20,
        filler=20,
        hint="5 blocks would leave 0 free, below the watermark of 1: " + WATERMARK_RULE,
    ),
    Situation(
        "a 9-token prompt in blocks of 4, 2 of 8 blocks free, no watermark",
        8,
        4,
        0,
        9,
        filler=24,
        hint=ROUND_UP,
    ),
    Situation(
        "an 8-token prompt in blocks of 4, 2 of 8 blocks free, watermark 1",
        8,
        4,
        1,
        8,
        filler=24,
        hint="2 blocks would leave 0 free, below the watermark of 1: " + WATERMARK_RULE,
    ),
    Situation(
        "a 13-token prompt whose first 8 tokens are cached in 2 blocks a running sequence holds, "
        "2 of 8 blocks free, no watermark",
        8,
        4,
        0,
        13,
        hit=8,
        hit_from="running",
        running=8,
        filler=16,
        hint=HELD_HIT,
    ),
    Situation(
        "a 13-token prompt whose first 8 tokens are cached in 2 blocks a running sequence holds, "
        "3 of 10 blocks free, watermark 1",
        10,
        4,
        1,
        13,
        hit=8,
        hit_from="running",
        running=8,
        filler=20,
        hint=HELD_HIT,
    ),
    Situation(
        "a 13-token prompt whose first 8 tokens are cached in 2 blocks in the free queue, "
        "3 of 8 blocks free (those 2 among them), no watermark",
        8,
        4,
        0,
        13,
        hit=8,
        hit_from="freed",
        freed=8,
        filler=20,
        hint=FREE_HIT,
    ),
    Situation(
        "a 13-token prompt whose first 8 tokens are cached in 2 blocks in the free queue, "
        "4 of 8 blocks free (those 2 among them), no watermark",
        8,
        4,
        0,
        13,
        hit=8,
        hit_from="freed",
        freed=8,
        filler=16,
        hint=FREE_HIT,
    ),
)


@driver
def admits_run(state: dict, objects: tuple, index: int) -> Any:
    """``Policy().admits`` in situation ``SITUATIONS[index]``."""
    manager, seq, num_new = build(SITUATIONS[index])
    return objects[0]().admits(seq, num_new, manager)


VICTIMS = (
    ("three running, arrived A, B, C; C asks for a block", ["A", "B", "C"]),
    ("one running, A, asks for a block: it preempts itself", ["A"]),
    ("five running, arrived A to E; B asks for a block", ["A", "B", "C", "D", "E"]),
)


@driver
def victim_run(state: dict, objects: tuple, names: list[str]) -> Any:
    """``Policy().victim`` on running sequences called ``names``, in arrival order; the victim's name."""
    running = [
        Sequence(i, name, [i], SamplingParams(max_tokens=4), arrival_time=float(i))
        for i, name in enumerate(names)
    ]
    got = objects[0]().victim(running)
    return got.request_id if isinstance(got, Sequence) else repr(got)[:80]


# -- 04.scheduling_policy: traces ------------------------------------------------------------------

FIELDS = ("num_running", "num_waiting", "num_preempted", "num_scheduled_tokens", "free_blocks")


def _trace(rng: random.Random, num_requests: int, rate: float) -> list[TraceRequest]:
    now, trace = 0.0, []
    for _ in range(num_requests):
        now += rng.expovariate(rate)
        trace.append(TraceRequest(rng.randint(1, 40), rng.randint(1, 40), round(now, 3)))
    return trace


def _replay(policy: SchedulingPolicy, config: list, trace: list[list]) -> list[dict[str, int]]:
    num_blocks, block_size, watermark = config
    manager = PagedKVCacheManager(num_blocks, block_size, watermark=watermark, enable_prefix_caching=False)
    requests = [TraceRequest(*r) for r in trace]
    result = run_trace(requests, manager, max_num_batched_tokens=64, scheduling_policy=policy, report_every=0)
    return [{f: getattr(step, f) for f in FIELDS} for step in result.steps]


@driver
def trace_run(state: dict, objects: tuple, config: list, trace: list[list]) -> list[dict[str, int]]:
    """The trace served with ``Policy()``: the record after every step."""
    return _replay(objects[0](), config, trace)


@driver
def is_policy(state: dict, objects: tuple) -> str:
    """What the cell's ``Policy`` is: ``"policy"`` for a SchedulingPolicy subclass that defines
    ``admits`` and ``victim`` itself."""
    obj = objects[0]
    if not (isinstance(obj, type) and issubclass(obj, SchedulingPolicy)):
        return type(obj).__name__
    inherited = [m for m in ("admits", "victim") if getattr(obj, m) is getattr(SchedulingPolicy, m)]
    return f"a class that inherits {' and '.join(inherited)}" if inherited else "policy"


def scheduling_policy(student: Student, seed: int = 0, thorough: bool = False) -> int:
    """``Policy``, a :class:`SchedulingPolicy` with ``admits(seq, num_new_tokens, cache_manager)``
    and ``victim(running)``: first each alone on the small named situations above (the rounding,
    the watermark, a prefix-cache hit held by a running sequence or sitting in the free queue; the
    victim), with a hint for the rule each one exercises; then replayed over seeded traces beside
    the package's default policy: the scheduler must make the same decision at every step (who runs,
    who waits, who is preempted, how many blocks stay free), under caches small enough to preempt
    and watermarks that matter."""
    kind = student.call("Policy", "checks_serving:is_policy")
    if kind != "policy":
        raise CheckFailed(
            "Policy must be a subclass of SchedulingPolicy that writes admits and victim itself",
            "such a class",
            kind,
            "the inherited methods are the package's own rule: write both in your class",
        )
    for index, situation in enumerate(SITUATIONS):
        manager, seq, num_new = build(situation)
        expected = SchedulingPolicy().admits(seq, num_new, manager)
        case = (
            f"admits: {situation.name} (seq.num_computed_tokens={seq.num_computed_tokens}, "
            f"num_new_tokens={num_new})"
        )
        got = student.call(case, "checks_serving:admits_run", index)
        expect(case, expected, got, situation.hint)
    for name, names in VICTIMS:
        case = f"victim: {name}"
        got = student.call(case, "checks_serving:victim_run", names)
        expect(
            case,
            names[-1],
            got,
            "the victim is the latest arrival, running[-1]: then the oldest sequence always makes progress",
        )
    rng = random.Random(seed)
    configs = [(24, 4, 0.01, 3, 20), (32, 8, 0.1, 2, 16), (16, 4, 0.0, 6, 12), (64, 8, 0.2, 1, 30)]
    for _ in range(4 if not thorough else 16):
        configs.append(
            (
                rng.randint(12, 64),
                rng.choice((2, 4, 8)),
                rng.choice((0.0, 0.01, 0.1, 0.25)),
                rng.choice((0.5, 1, 2, 4)),
                rng.randint(8, 30),
            )
        )
    for num_blocks, block_size, watermark, rate, n in configs:
        trace = _trace(rng, n, rate)
        room = num_blocks - int(watermark * num_blocks)  # what one request may take, watermark aside
        trace = [r for r in trace if -(-(r.prompt_len + r.output_len) // block_size) <= room]
        plain = [[r.prompt_len, r.output_len, r.arrival_time] for r in trace]
        config = [num_blocks, block_size, watermark]
        case = f"{num_blocks} blocks of {block_size}, watermark {watermark:.0%}"
        case += f", {len(trace)} requests at {rate} req/s"
        want = _replay(SchedulingPolicy(), config, plain)
        got = student.call(f"a trace of {case}", "checks_serving:trace_run", config, plain)
        for step, (expected, actual) in enumerate(zip(want, got, strict=False)):
            expect(
                f"{case}: after step {step}",
                expected,
                actual,
                "the named situations pass, so look at the trace: " + WATERMARK_RULE + "; the victim is "
                "the latest arrival, running[-1]",
            )
        expect(f"{case}: number of steps", len(want), len(got))
    return len(SITUATIONS) + len(VICTIMS) + len(configs)


# -- 06.first_fit ----------------------------------------------------------------------------------


@driver
def fit_new(state: dict, objects: tuple, num_slots: int) -> Any:
    """A fresh ``FirstFit(num_slots)``; its holes."""
    state["fit"] = objects[0](num_slots)
    return _holes(state["fit"])


@driver
def fit_op(state: dict, objects: tuple, op: str, arg: int) -> dict[str, Any]:
    """``allocate(arg)`` or ``free(arg)``; what it returned and the holes after."""
    returned = getattr(state["fit"], op)(arg)
    return {
        "returned": returned if isinstance(returned, int) or returned is None else repr(returned)[:80],
        "holes": _holes(state["fit"]),
    }


def _holes(fit: Any) -> Any:
    holes = fit.holes()
    try:
        return [list(h) for h in holes]
    except TypeError:
        return repr(holes)[:200]


def first_fit(student: Student, seed: int = 0, thorough: bool = False) -> int:
    """``FirstFit(num_slots)`` with ``allocate(size) -> start | None``, ``free(start)`` and
    ``holes() -> [(start, length), ...]`` (sorted, never two adjacent), replayed against the
    package's :class:`FirstFitAllocator` over random allocate/free sequences; the holes are compared
    after every operation."""
    rng = random.Random(seed)
    runs = [[("allocate", 4), ("allocate", 4), ("allocate", 4), ("free", 4), ("free", 0), ("free", 8)]]
    for _ in range(60 if not thorough else 300):
        runs.append(
            [
                ("allocate", rng.randint(1, 12)) if rng.random() < 0.55 else ("free", rng.random())
                for _ in range(rng.randint(1, 30))
            ]
        )
    for ops in runs:
        num_slots = 32
        ours = FirstFitAllocator(num_slots)
        live: list[int] = []
        history = [f"FirstFit({num_slots})"]
        student.call(history[0], "checks_serving:fit_new", num_slots)
        for op, arg in ops:
            if op == "allocate":
                history.append(f"allocate({arg})")
                got = student.call("; ".join(history[-8:]), "checks_serving:fit_op", "allocate", arg)
                expected = ours.allocate(arg)
                expect("; ".join(history[-8:]) + ": start returned", expected, got["returned"])
                if expected is not None:
                    live.append(expected)
            elif live:
                start = live.pop(int(arg * len(live))) if isinstance(arg, float) else arg
                if start in live:
                    live.remove(start)
                history.append(f"free({start})")
                got = student.call("; ".join(history[-8:]), "checks_serving:fit_op", "free", start)
                ours.free(start)
            else:
                continue
            expect(
                "; ".join(history[-8:]) + ": holes",
                [list(h) for h in ours.holes()],
                got["holes"],
                "after a free, merge the hole with the holes right before and right after it",
            )
    return len(runs)
