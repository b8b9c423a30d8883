"""Checks of the serving exercises: the scheduler's admission rule and preemption victim (graded by
replaying traces), and first-fit placement with hole merging."""

from __future__ import annotations

import random

from ..baselines.placement import FirstFitAllocator
from ..engine.scheduler import SchedulingPolicy
from ..experiments.replay import run_trace
from ..experiments.traces import TraceRequest
from ..memory.paged_manager import PagedKVCacheManager
from .checking import CheckFailed, expect


def _trace(rng: random.Random, num_requests: int, rate: float) -> list[TraceRequest]:
    now, trace = 0.0, []
    for _ in range(num_requests):
        now += rng.expovariate(rate)
        trace.append(TraceRequest(rng.randint(1, 40), rng.randint(1, 40), round(now, 3)))
    return trace


def scheduling_policy(Policy: type, thorough: bool = False) -> int:
    """``Policy``, a :class:`SchedulingPolicy` with ``admits(seq, num_new_tokens, cache_manager)``
    and ``victim(running)``, replayed over seeded traces beside the package's default policy: the
    scheduler must make the same decision at every step (who runs, who waits, who is preempted,
    how many blocks stay free), under caches small enough to preempt and watermarks that matter."""
    if not (isinstance(Policy, type) and issubclass(Policy, SchedulingPolicy)):
        raise CheckFailed("Policy must be a subclass of SchedulingPolicy", "a class", type(Policy).__name__)
    rng = random.Random(9)
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
        trace = [r for r in trace if -(-(r.prompt_len + r.output_len) // block_size) <= num_blocks * 0.9]
        runs = []
        for policy in (SchedulingPolicy(), Policy()):
            manager = PagedKVCacheManager(
                num_blocks, block_size, watermark=watermark, enable_prefix_caching=False
            )
            runs.append(
                run_trace(trace, manager, max_num_batched_tokens=64, scheduling_policy=policy, report_every=0)
            )
        case = f"{num_blocks} blocks of {block_size}, watermark {watermark:.0%}"
        case += f", {len(trace)} requests at {rate} req/s"
        for want, got in zip(runs[0].steps, runs[1].steps, strict=False):
            fields = ("num_running", "num_waiting", "num_preempted", "num_scheduled_tokens", "free_blocks")
            expected = {f: getattr(want, f) for f in fields}
            actual = {f: getattr(got, f) for f in fields}
            expect(
                f"{case}: after step {want.step}",
                expected,
                actual,
                "admit only if free blocks minus the blocks needed stay >= watermark_blocks; the victim is "
                "the latest arrival, running[-1]",
            )
        expect(f"{case}: number of steps", len(runs[0].steps), len(runs[1].steps))
    return len(configs)


def first_fit(FirstFit: type, thorough: bool = False) -> int:
    """``FirstFit(num_slots)`` with ``allocate(size) -> start | None``, ``free(start)`` and
    ``holes() -> [(start, length), ...]`` (sorted, never two adjacent), replayed against the
    package's :class:`FirstFitAllocator` over random allocate/free sequences."""
    rng = random.Random(10)
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
        ours, theirs = FirstFitAllocator(num_slots), FirstFit(num_slots)
        live: list[int] = []
        history = [f"FirstFit({num_slots})"]
        for op, arg in ops:
            if op == "allocate":
                expected, got = ours.allocate(arg), theirs.allocate(arg)
                history.append(f"allocate({arg})")
                expect("; ".join(history[-8:]) + ": start returned", expected, got)
                if expected is not None:
                    live.append(expected)
            elif live:
                start = live.pop(int(arg * len(live))) if isinstance(arg, float) else arg
                if start in live:
                    live.remove(start)
                ours.free(start)
                theirs.free(start)
                history.append(f"free({start})")
            else:
                continue
            expect(
                "; ".join(history[-8:]) + ": holes",
                ours.holes(),
                [tuple(h) for h in theirs.holes()],
                "after a free, merge the hole with the holes right before and right after it",
            )
    return len(runs)
