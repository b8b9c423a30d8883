"""The trace executor's accounting: a clock that charges work, preemptions per request, and
self-preemptions (the sequence short of memory was the latest arrival and stepped back itself)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_attention.engine.core.scheduler import SchedulingPolicy
from paged_attention.experiments.replay import linear_step_time, run_trace
from paged_attention.experiments.traces import TraceRequest
from paged_attention.memory.paged_manager import PagedKVCacheManager


class AskerRecordingManager(PagedKVCacheManager):
    """Remembers the last sequence refused memory: the one asking when a victim is chosen."""

    last_refused = None

    def allocate_slots(self, seq, num_new_tokens):
        allocation = super().allocate_slots(seq, num_new_tokens)
        self.last_refused = seq if allocation is None else None
        return allocation


class SelfVictimCounter(SchedulingPolicy):
    """The default victim rule, counting the times the victim is the sequence that asked."""

    def __init__(self, cache: AskerRecordingManager) -> None:
        self.cache = cache
        self.self_victims = 0

    def victim(self, running):
        victim = super().victim(running)
        self.self_victims += victim is self.cache.last_refused
        return victim


def test_the_latest_arrival_short_of_a_block_preempts_itself():
    # A (6-token prompt) and B (8: its two blocks full) fill a 4-block cache; B's first decode needs
    # a third block, and B is the latest arrival: it is the victim.
    result = run_trace([TraceRequest(6, 6), TraceRequest(8, 3)], PagedKVCacheManager(4, 4, watermark=0.0))
    assert result.num_preemptions == 1 and result.num_self_preemptions == 1
    assert result.preemptions == {1: 1} and result.max_preemptions == 1
    assert sorted(result.finish_step) == [0, 1]


def test_an_older_sequence_short_of_a_block_evicts_the_younger_one():
    # A (7-token prompt) and B (4) take 3 of 4 blocks; B's first decode takes the last one, and at
    # position 8 A needs a third block: the victim is B, the latest arrival, not the asker.
    result = run_trace([TraceRequest(7, 6), TraceRequest(4, 4)], PagedKVCacheManager(4, 4, watermark=0.0))
    assert (result.num_preemptions, result.num_self_preemptions, result.preemptions) == (1, 0, {1: 1})
    quiet = run_trace([TraceRequest(4, 3)], PagedKVCacheManager(16, 4))
    assert (quiet.num_preemptions, quiet.num_self_preemptions, quiet.preemptions, quiet.max_preemptions) == (
        0,
        0,
        {},
        0,
    )


traces = st.lists(
    st.builds(TraceRequest, st.integers(1, 25), st.integers(1, 20), st.integers(0, 40).map(float)),
    min_size=1,
    max_size=20,
)


@settings(max_examples=60, deadline=None)
@given(
    trace=traces,
    num_blocks=st.integers(12, 30),
    budget=st.integers(4, 64),
    mode=st.sampled_from(["recompute", "swap"]),
)
def test_self_preemptions_match_an_independent_count(trace, num_blocks, budget, mode):
    cache = AskerRecordingManager(
        num_blocks, 4, watermark=0.0, num_cpu_blocks=num_blocks if mode == "swap" else 0
    )
    policy = SelfVictimCounter(cache)
    result = run_trace(
        trace, cache, max_num_batched_tokens=budget, preemption_mode=mode, scheduling_policy=policy
    )
    assert result.num_self_preemptions == policy.self_victims
    assert sum(result.preemptions.values()) == result.num_preemptions
    assert result.num_self_preemptions <= result.num_preemptions


def test_linear_step_time_charges_tokens_and_copied_blocks():
    trace = [TraceRequest(10, 8), TraceRequest(5, 12), TraceRequest(6, 12), TraceRequest(3, 4)]
    cache = PagedKVCacheManager(10, 4, watermark=0.1, num_cpu_blocks=10)
    step_time = linear_step_time(per_step=1.0, per_token=0.25, per_block_copied=2.0)
    result = run_trace(
        trace, cache, max_num_seqs=3, max_num_batched_tokens=8, preemption_mode="swap", step_time=step_time
    )
    assert any(s.num_blocks_copied for s in result.steps)  # the example swaps C out and back in
    for s in result.steps:
        assert s.duration == pytest.approx(1.0 + 0.25 * s.num_scheduled_tokens + 2.0 * s.num_blocks_copied)
    assert result.duration == pytest.approx(sum(s.duration for s in result.steps))


def test_without_prices_linear_step_time_is_the_uniform_clock():
    trace = [
        TraceRequest(8, 20, 0.0),
        TraceRequest(30, 10, 3.0),
        TraceRequest(12, 25, 40.0),
        TraceRequest(5, 5, 41.0),
    ]
    uniform = run_trace(trace, PagedKVCacheManager(12, 4), max_num_batched_tokens=16)
    unit = run_trace(
        trace, PagedKVCacheManager(12, 4), max_num_batched_tokens=16, step_time=linear_step_time()
    )
    assert unit.finish_time == pytest.approx(uniform.finish_time)
    assert unit.num_preemptions == uniform.num_preemptions


def test_recompute_costs_time_on_a_charged_clock_and_none_on_the_uniform_one():
    trace = [TraceRequest(10, 8), TraceRequest(5, 12), TraceRequest(6, 12), TraceRequest(3, 4)]
    free = run_trace(
        trace, PagedKVCacheManager(10, 4, watermark=0.1), max_num_seqs=3, max_num_batched_tokens=8
    )
    charged = run_trace(
        trace, PagedKVCacheManager(10, 4, watermark=0.1), max_num_seqs=3, max_num_batched_tokens=8,
        step_time=linear_step_time(per_token=0.5),
    )  # fmt: skip
    assert free.num_preemptions == charged.num_preemptions == 1
    computed = sum(s.num_scheduled_tokens for s in charged.steps)
    assert computed > sum(r.prompt_len + r.output_len - 1 for r in trace)  # the victim's tokens, again
    assert charged.duration == pytest.approx(len(charged.steps) + 0.5 * computed)
    assert free.duration == len(free.steps)


@pytest.mark.parametrize(
    "kwargs", [{"per_step": 0.0}, {"per_step": -1.0}, {"per_token": -0.1}, {"per_block_copied": -1.0}]
)
def test_linear_step_time_rejects_impossible_prices(kwargs):
    with pytest.raises(ValueError):
        linear_step_time(**kwargs)
