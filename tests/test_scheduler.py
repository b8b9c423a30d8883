import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_attention.engine.core.scheduler import Scheduler, StepUpdate
from paged_attention.engine.sequence import FinishReason, Sequence, SequenceStatus
from paged_attention.experiments.replay import run_trace
from paged_attention.experiments.traces import TraceRequest
from paged_attention.memory.paged_manager import PagedKVCacheManager

from .scripted import seq, step


def test_chunked_prefill_splits_a_long_prompt_under_the_token_budget():
    scheduler = Scheduler(PagedKVCacheManager(64, 4), max_num_batched_tokens=10)
    scheduler.add(seq(0, 25))
    chunks = []
    for _ in range(3):
        out = step(scheduler)
        chunks.append([(s.seq.seq_id, s.num_new_tokens, s.needs_logits) for s in out.scheduled])
    assert chunks == [[(0, 10, False)], [(0, 10, False)], [(0, 5, True)]]
    out = step(scheduler)  # now one decode token
    assert [(s.num_new_tokens, s.needs_logits) for s in out.scheduled] == [(1, True)]


def test_decodes_go_first_and_new_prompts_fill_the_remaining_budget():
    scheduler = Scheduler(PagedKVCacheManager(64, 4), max_num_batched_tokens=8)
    scheduler.add(seq(0, 6))
    step(scheduler)
    scheduler.add(seq(1, 20))
    out = step(scheduler)
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(0, 1), (1, 7)]


def test_max_num_seqs_limits_the_running_batch():
    scheduler = Scheduler(PagedKVCacheManager(64, 4), max_num_seqs=2)
    for i in range(3):
        scheduler.add(seq(i, 3))
    out = step(scheduler)
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1]
    assert [s.seq_id for s in scheduler.waiting] == [2]


def test_admission_is_fcfs_and_never_skips_ahead():
    cache = PagedKVCacheManager(10, 4, watermark=0.0)
    scheduler = Scheduler(cache)
    scheduler.add(seq(0, 30))  # 8 blocks
    scheduler.add(seq(1, 12))  # 3 blocks: does not fit next to seq 0
    scheduler.add(seq(2, 2))  # would fit, but must not overtake seq 1
    out = step(scheduler)
    assert [s.seq.seq_id for s in out.scheduled] == [0]
    assert [s.seq_id for s in scheduler.waiting] == [1, 2]


def test_preemption_takes_the_latest_arrival_and_requeues_it_at_the_front():
    cache = PagedKVCacheManager(4, 2, watermark=0.0)
    scheduler = Scheduler(cache)
    a, b = seq(0, 3, max_tokens=5), seq(1, 3, max_tokens=5)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)  # both prefilled (3 tokens in 2 blocks each): the cache is full
    step(scheduler)  # the 4th token of each still fits in its second block
    out = step(scheduler)  # a's 5th token needs a third block: b, the later arrival, is preempted
    assert out.preempted == [b] and b.status is SequenceStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and scheduler.waiting[0] is b
    assert [s.seq.seq_id for s in out.scheduled] == [0]
    assert scheduler.num_preemptions == 1 and b.num_preemptions == 1


def test_swap_mode_moves_pages_to_cpu_and_back():
    cache = PagedKVCacheManager(4, 2, watermark=0.0, num_cpu_blocks=4)
    scheduler = Scheduler(cache, preemption_mode="swap")
    a, b = seq(0, 3, max_tokens=5), seq(1, 3, max_tokens=5)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    step(scheduler)
    out = step(scheduler)
    assert out.preempted == [b] and b.status is SequenceStatus.SWAPPED
    assert len(out.swap_out) == 2 and b.num_computed_tokens == 4  # its work is kept, not recomputed
    scheduler.finish(a, FinishReason.LENGTH, 0.0)
    out = step(scheduler)
    assert len(out.swap_in) == 2 and b.status is SequenceStatus.RUNNING
    assert [s.seq.seq_id for s in out.scheduled] == [1]


def test_a_request_that_can_never_fit_is_rejected_when_added():
    scheduler = Scheduler(PagedKVCacheManager(4, 4))
    with pytest.raises(ValueError, match="can never fit: it may store up to 17 tokens"):
        scheduler.add(seq(0, 10, max_tokens=8))  # 10 + 8 - 1 = 17 tokens of KV > 16 slots
    assert not scheduler.has_unfinished()
    scheduler.add(seq(1, 10, max_tokens=7))  # 16 tokens of KV: exactly the cache
    assert scheduler.has_unfinished()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_num_seqs=0), "max_num_seqs must be a positive int"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(preemption_mode="drop"), "preemption_mode must be one of"),
        (dict(preemption_mode="swap"), "needs a cache manager with CPU blocks"),
    ],
)
def test_bad_scheduler_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Scheduler(PagedKVCacheManager(4, 4), **kwargs)


traces = st.lists(
    st.builds(TraceRequest, st.integers(1, 25), st.integers(1, 20), st.integers(0, 60).map(float)),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60)
@given(
    trace=traces,
    num_blocks=st.integers(12, 40),
    budget=st.integers(8, 64),
    max_num_seqs=st.integers(1, 8),
    mode=st.sampled_from(["recompute", "swap"]),
)
def test_every_request_finishes_and_every_block_comes_back(trace, num_blocks, budget, max_num_seqs, mode):
    cache = PagedKVCacheManager(num_blocks, 4, num_cpu_blocks=num_blocks if mode == "swap" else 0)
    result = run_trace(
        trace, cache, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, preemption_mode=mode
    )
    assert sorted(result.finish_step) == list(range(len(trace)))
    assert cache.num_free_blocks == num_blocks and not cache.page_tables and not cache.num_swapped
    assert all(s.num_scheduled_tokens <= budget and s.num_running <= max_num_seqs for s in result.steps)


def test_soak_500_requests_under_tight_memory_both_modes():
    import random

    rng = random.Random(0)
    trace = [
        TraceRequest(rng.randint(1, 60), rng.randint(1, 80), float(rng.randint(0, 200))) for _ in range(500)
    ]
    for mode in ("recompute", "swap"):
        cache = PagedKVCacheManager(20, 8, num_cpu_blocks=40 if mode == "swap" else 0)
        result = run_trace(trace, cache, max_num_batched_tokens=64, preemption_mode=mode)
        assert len(result.finish_step) == 500 and result.num_preemptions > 100
        assert cache.num_free_blocks == 20


def test_a_request_that_fits_only_by_eating_the_watermark_is_rejected_not_stalled():
    cache = PagedKVCacheManager(100, 16)  # 1% watermark: 1 block stays free for running sequences
    scheduler = Scheduler(cache, max_num_batched_tokens=4096)
    with pytest.raises(ValueError, match="can never fit: it may store up to"):
        scheduler.add(seq(0, 1590, max_tokens=10))  # 100 blocks: would never be admitted
    result = run_trace([TraceRequest(1570, 10)], PagedKVCacheManager(100, 16), max_num_batched_tokens=4096)
    assert result.finish_step == {0: 9}  # 99 blocks: prefilled at step 0, 10th token at step 9


@pytest.mark.parametrize(("start", "end"), [(0, 3), (2, 6), (3, 5), (4, 6), (0, 6), (5, 6), (6, 6)])
def test_token_slice_matches_slicing_the_whole_token_list(start, end):
    s = seq(0, 4)
    s.prompt_token_ids = [10, 11, 12, 13]
    s.output_token_ids = [20, 21]
    assert s.token_slice(start, end) == s.tokens[start:end]


# -- sharing: seats for forks, parked beams, the way out when parked beams block everyone -------------
def test_a_request_that_will_fork_takes_all_its_seats_at_admission():
    scheduler = Scheduler(PagedKVCacheManager(64, 4), max_num_seqs=4)
    parent = seq(0, 3)
    parent.pending_forks = 2  # n = 3 samples
    for s in (parent, seq(1, 3), seq(2, 3)):
        scheduler.add(s)
    out = step(scheduler)
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1]  # 3 + 1 seats; seq 2 would make 5
    too_wide = seq(3, 3)
    too_wide.pending_forks = 4
    with pytest.raises(ValueError, match="5 sequences at once"):
        scheduler.add(too_wide)


def test_forks_run_right_behind_their_parent():
    cache = PagedKVCacheManager(64, 4)
    scheduler = Scheduler(cache)
    parent, later = seq(0, 5), seq(1, 5)
    scheduler.add(parent)
    scheduler.add(later)
    out = scheduler.schedule()
    child = Sequence(7, "0", parent.prompt_token_ids, parent.params, parent.arrival_time, group_id=0)
    forked = StepUpdate(forks=[(parent, child)], tokens=[(parent, [7]), (child, [8]), (later, [7])])
    scheduler.update_from_output(out, forked, 0.0)  # the prompt is computed: the child shares it
    assert child.num_computed_tokens == parent.num_computed_tokens == 5
    assert cache.block_table(7) == cache.block_table(0) and scheduler.running == [parent, child, later]
    assert [s.seq_id for s in scheduler.running] == [0, 7, 1]
    out = step(scheduler)
    assert [s.seq.seq_id for s in out.scheduled] == [0, 7, 1] and len(out.block_copies) == 1


def test_parked_sequences_are_skipped_and_preempted_when_they_block_everyone():
    cache = PagedKVCacheManager(4, 2, watermark=0.0)
    scheduler = Scheduler(cache)
    a, b, c = seq(0, 3, max_tokens=4), seq(1, 3, max_tokens=4), seq(2, 3, max_tokens=4)
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    scheduler.update_from_output(out, StepUpdate(), 0.0)  # a and b computed, no new token: both parked
    assert cache.num_free_blocks == 0 and a.num_uncomputed_tokens == 0
    scheduler.add(c)
    out = scheduler.schedule()  # nothing can run: the parked sequences step back, youngest first
    assert out.scheduled == [] and out.preempted == [b, a]
    assert list(scheduler.waiting) == [a, b, c]  # in arrival order, ahead of c
    assert cache.num_free_blocks == 4 and not scheduler.running
    out = scheduler.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1]


def test_a_parked_sequence_gives_its_turn_to_the_others():
    scheduler = Scheduler(PagedKVCacheManager(64, 4))
    a, b = seq(0, 3), seq(1, 3)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    b.output_token_ids.pop()  # b's newest token is taken back: it is parked, a is not
    out = step(scheduler)
    assert [s.seq.seq_id for s in out.scheduled] == [0]
    assert scheduler.running == [a, b]
