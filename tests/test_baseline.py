"""The contiguous baselines: buddy and first-fit placement, the Orca reservation policies, the
contiguous cache manager behind the KVCacheManager protocol, and static batching."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged_attention.baselines import (
    BuddyAllocator,
    ContiguousKVCacheManager,
    FirstFitAllocator,
    make_placement,
    next_power_of_two,
    reservation_slots,
)
from paged_attention.baselines.static_batching import StaticBatching
from paged_attention.engine.core.scheduler import Scheduler
from paged_attention.experiments.paper import KV_SLOTS, MAX_MODEL_LEN, make_manager
from paged_attention.experiments.replay import run_trace
from paged_attention.experiments.traces import TraceRequest, fixed_trace, synthetic_trace
from paged_attention.memory.accounting import MemoryReport
from paged_attention.memory.paged_manager import PagedKVCacheManager

from . import scripted
from .scripted import seq


def step(scheduler: Scheduler):
    """One step with a scripted model: each sampling sequence gets a token and ends at max_tokens."""
    return scripted.step(scheduler)


def ids(out) -> list[tuple[int, int]]:
    return [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled]


# -- placement: concrete cases ----------------------------------------------------------------------
def test_the_paper_arena_holds_exactly_seven_2048_chunks():
    buddy = BuddyAllocator(KV_SLOTS, MAX_MODEL_LEN)
    assert KV_SLOTS == 15728
    sizes = [length for _, length in buddy.holes()]
    assert sizes == [2048] * 7 + [1024, 256, 64, 32, 16]
    assert buddy.free_slots == KV_SLOTS
    starts = [buddy.allocate(2048) for _ in range(7)]
    assert starts == [i * 2048 for i in range(7)]
    assert not buddy.can_allocate(2048) and buddy.allocate(2048) is None
    assert buddy.free_slots == 1024 + 256 + 64 + 32 + 16
    assert buddy.can_allocate(1000) and buddy.allocate(1000) == 14336  # the 1024 chunk of the tail


def test_buddy_splits_the_smallest_chunk_that_fits_and_merges_buddies_back():
    buddy = BuddyAllocator(16, 16)
    assert buddy.allocate(3) == 0  # footprint 4: 16 -> 8 + 8 -> 4 + 4
    assert buddy.holes() == [(4, 4), (8, 8)]
    assert buddy.allocate(1) == 4  # the 4-chunk is split, not the 8-chunk
    assert buddy.holes() == [(5, 1), (6, 2), (8, 8)]
    assert buddy.allocate(8) == 8
    buddy.free(0)
    assert buddy.holes() == [(0, 4), (5, 1), (6, 2)]  # 0's buddy (4) is still taken
    buddy.free(4)
    assert buddy.holes() == [(0, 8)]  # 4+1 -> 2, +2 -> 4, +0..3 -> 8
    buddy.free(8)
    assert buddy.holes() == [(0, 16)]


def test_buddy_arena_smaller_than_a_chunk_and_odd_sizes():
    buddy = BuddyAllocator(100, 64)
    assert buddy.holes() == [(0, 64), (64, 32), (96, 4)]
    small = BuddyAllocator(3, 4)
    assert small.holes() == [(0, 2), (2, 1)]
    assert not small.can_allocate(3) and small.allocate(3) is None  # footprint 4 > any chunk
    assert BuddyAllocator(10, 8).allocate(9) is None  # bigger than max_chunk


def test_first_fit_reuses_the_lowest_hole_that_fits_and_merges_neighbours():
    ff = FirstFitAllocator(100)
    a, b, c = ff.allocate(10), ff.allocate(20), ff.allocate(30)
    assert (a, b, c) == (0, 10, 30)
    ff.free(a)
    ff.free(c)
    assert ff.holes() == [(0, 10), (30, 70)]
    assert ff.allocate(5) == 0  # lowest hole that fits
    assert ff.allocate(10) == 30  # (5, 5) is too small: the next hole
    assert ff.holes() == [(5, 5), (40, 60)]
    ff.free(10)  # b: merges with the hole before it, not with (40, 60): 30..39 is taken
    assert ff.holes() == [(5, 25), (40, 60)]
    ff.free(30)
    ff.free(0)
    assert ff.holes() == [(0, 100)]
    assert ff.footprint(37) == 37 and ff.free_slots == 100


def test_first_fit_fragments_a_large_request_cannot_use_two_holes():
    ff = FirstFitAllocator(1500)
    starts = [ff.allocate(500) for _ in range(3)]
    ff.free(starts[0])
    ff.free(starts[2])
    assert ff.free_slots == 1000 and not ff.can_allocate(900) and ff.allocate(900) is None


def test_footprints():
    buddy, ff = BuddyAllocator(64, 64), FirstFitAllocator(64)
    for size, rounded in [(1, 1), (2, 2), (3, 4), (5, 8), (25, 32), (32, 32), (33, 64)]:
        assert buddy.footprint(size) == rounded == next_power_of_two(size)
        assert ff.footprint(size) == size


def test_make_placement():
    buddy = make_placement("buddy", 100, 48)
    assert isinstance(buddy, BuddyAllocator) and buddy.max_chunk == 64  # rounded up to a power of two
    assert isinstance(make_placement("first-fit", 100, 48), FirstFitAllocator)
    with pytest.raises(ValueError, match=r"placement must be one of \('buddy', 'first-fit'\), got 'nope'"):
        make_placement("nope", 100, 64)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: BuddyAllocator(0, 4), ValueError, "num_slots must be a positive int"),
        (lambda: BuddyAllocator(10, 0), ValueError, "max_chunk must be a positive int"),
        (lambda: BuddyAllocator(10, 6), ValueError, "max_chunk must be a power of two, got 6"),
        (lambda: BuddyAllocator(10, 4.0), TypeError, "max_chunk must be an int"),
        (lambda: BuddyAllocator("10", 4), TypeError, "num_slots must be an int"),
        (lambda: BuddyAllocator(16, 16).allocate(0), ValueError, "size must be a positive int"),
        (lambda: BuddyAllocator(16, 16).can_allocate(-1), ValueError, "size must be a positive int"),
        (lambda: BuddyAllocator(16, 16).allocate(2.5), TypeError, "size must be an int"),
        (lambda: BuddyAllocator(16, 16).free(0), ValueError, "no allocated chunk starts at slot 0"),
        (lambda: FirstFitAllocator(0), ValueError, "num_slots must be a positive int"),
        (lambda: FirstFitAllocator(True), TypeError, "num_slots must be an int"),
        (lambda: FirstFitAllocator(16).allocate(0), ValueError, "size must be a positive int"),
        (lambda: FirstFitAllocator(16).allocate(None), TypeError, "size must be an int"),
        (lambda: FirstFitAllocator(16).free(3), ValueError, "no allocated range starts at slot 3"),
        (lambda: FirstFitAllocator(16).free(-1), ValueError, "start must be an int >= 0"),
        (lambda: FirstFitAllocator(16).free("0"), TypeError, "start must be an int"),
    ],
)
def test_bad_placement_input_names_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("size", [0, -5])
def test_first_fit_can_allocate_rejects_a_bad_size_like_buddy(size):
    with pytest.raises(ValueError, match="size must be a positive int"):
        BuddyAllocator(16, 16).can_allocate(size)
    with pytest.raises(ValueError, match="size must be a positive int"):
        FirstFitAllocator(16).can_allocate(size)


def test_freeing_a_range_twice_or_from_its_middle_is_refused():
    for alloc in (BuddyAllocator(16, 16), FirstFitAllocator(16)):
        start = alloc.allocate(4)
        with pytest.raises(ValueError, match="starts at slot 1"):
            alloc.free(start + 1)
        alloc.free(start)
        with pytest.raises(ValueError, match=f"starts at slot {start}"):
            alloc.free(start)
        assert alloc.free_slots == 16


# -- placement: invariants under random allocate/free sequences -------------------------------------
class PlacementMachine(RuleBasedStateMachine):
    """Random allocate/free sequences against either allocator, checked against a plain model."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc: BuddyAllocator | FirstFitAllocator | None = None
        self.live: dict[int, int] = {}  # start -> requested size

    @initialize(
        kind=st.sampled_from(["buddy", "first-fit"]),
        num_slots=st.integers(1, 200),
        log_chunk=st.integers(0, 7),
    )
    def setup(self, kind: str, num_slots: int, log_chunk: int) -> None:
        self.kind = kind
        self.alloc = make_placement(kind, num_slots, 1 << log_chunk)
        self.fresh_holes = self.alloc.holes()

    def _expected_start(self, size: int) -> int | None:
        """Where the allocation must go, judged from holes() alone."""
        fp = self.alloc.footprint(size)
        fitting = [(start, length) for start, length in self.alloc.holes() if length >= fp]
        if not fitting:
            return None
        if self.kind == "first-fit":
            return fitting[0][0]  # the lowest hole
        return min(fitting, key=lambda h: (h[1], h[0]))[0]  # the smallest chunk, then the lowest

    @rule(size=st.integers(1, 220))
    def allocate(self, size: int) -> None:
        can = self.alloc.can_allocate(size)
        expected = self._expected_start(size)
        start = self.alloc.allocate(size)
        assert (start is None) == (not can), (size, start, can)
        assert start == expected, (size, start, expected, self.alloc.holes())
        if start is not None:
            assert start not in self.live
            self.live[start] = size

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data) -> None:
        start = data.draw(st.sampled_from(sorted(self.live)))
        self.alloc.free(start)
        del self.live[start]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_everything(self, data) -> None:
        for start in data.draw(st.permutations(sorted(self.live))):
            self.alloc.free(start)
        self.live.clear()
        assert self.alloc.holes() == self.fresh_holes  # full coalescing
        assert self.alloc.free_slots == self.alloc.num_slots

    @invariant()
    def ranges_holes_and_counts_agree(self) -> None:
        if self.alloc is None:
            return
        n = self.alloc.num_slots
        used = sorted((start, self.alloc.footprint(size)) for start, size in self.live.items())
        for size in self.live.values():
            fp = self.alloc.footprint(size)
            if self.kind == "buddy":
                assert fp == next_power_of_two(size) and fp <= self.alloc.max_chunk
            else:
                assert fp == size
        holes = self.alloc.holes()
        assert holes == sorted(holes)
        assert all(length >= 1 for _, length in holes)
        pieces = sorted(used + holes)
        position = 0
        for start, length in pieces:  # allocations and holes tile [0, n) with no overlap
            assert start == position, (pieces, n)
            position += length
        assert position == n
        assert self.alloc.free_slots == sum(length for _, length in holes)
        assert self.alloc.free_slots + sum(fp for _, fp in used) == n
        if self.kind == "first-fit":
            for (s1, l1), (s2, _) in itertools.pairwise(holes):
                assert s1 + l1 < s2, holes  # neighbouring holes are always merged
        else:
            for start, length in holes + used:
                assert length & (length - 1) == 0 and length <= self.alloc.max_chunk
                assert start % length == 0, (start, length)


PlacementMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestPlacementMachine = PlacementMachine.TestCase


# -- reservation policies ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("policy", "prompt", "output", "max_len", "slots"),
    [
        ("max", 10, 20, 2048, 2048),
        ("max", 2000, 48, 2048, 2048),
        ("pow2", 100, 25, 2048, 132),  # 25 -> 32 output slots
        ("pow2", 100, 32, 2048, 132),
        ("pow2", 100, 33, 2048, 164),
        ("pow2", 100, 1, 2048, 101),
        ("pow2", 100, 0, 2048, 100),
        ("pow2", 2000, 48, 2048, 2048),  # 2000 + 64 capped at max_model_len
        ("oracle", 100, 25, 2048, 125),
        ("oracle", 2000, 48, 2048, 2048),
    ],
)
def test_reservation_slots(policy, prompt, output, max_len, slots):
    assert reservation_slots(policy, prompt, output, max_len) == slots


@given(prompt=st.integers(1, 3000), output=st.integers(0, 3000), max_len=st.integers(1, 4096))
def test_reservations_are_ordered_oracle_pow2_max(prompt, output, max_len):
    oracle = reservation_slots("oracle", prompt, output, max_len)
    pow2 = reservation_slots("pow2", prompt, output, max_len)
    biggest = reservation_slots("max", prompt, output, max_len)
    assert oracle == prompt + output and biggest == max_len
    assert pow2 <= max_len
    if prompt + output <= max_len:  # a request that fits the model: every policy covers it
        assert oracle <= pow2 <= biggest
        assert pow2 - prompt < 2 * output or output == 0  # at most 2x over on the output


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (("lru", 10, 5, 64), ValueError, r"policy must be one of \('max', 'pow2', 'oracle'\), got 'lru'"),
        (("Max", 10, 5, 64), ValueError, "policy must be one of"),
        (("max", 0, 5, 64), ValueError, "prompt_len must be a positive int"),
        (("max", 10, -1, 64), ValueError, "max_tokens must be an int >= 0"),
        (("max", 10, 5, 0), ValueError, "max_model_len must be a positive int"),
        (("max", 10.0, 5, 64), TypeError, "prompt_len must be an int"),
    ],
)
def test_bad_reservation_input(args, error, message):
    with pytest.raises(error, match=message):
        reservation_slots(*args)


# -- the contiguous manager through the KVCacheManager protocol -------------------------------------
def test_slots_are_consecutive_within_the_reservation_and_growth_stops_at_its_end():
    cache = ContiguousKVCacheManager(100, 64, "oracle", "first-fit")
    a, b = seq(0, 10, 5), seq(1, 4, 3)
    assert cache.can_admit(a, 10)
    assert cache.allocate_slots(a, 10).slot_mapping == list(range(0, 10))
    assert cache.can_admit(b, 4)
    assert cache.allocate_slots(b, 4).slot_mapping == list(range(15, 19))  # after a's 15 reserved slots
    assert cache.allocate_slots(a, 3).slot_mapping == [10, 11, 12]
    assert cache.block_table(0) == list(range(0, 13))
    assert cache.allocate_slots(a, 2).slot_mapping == [13, 14]
    assert cache.allocate_slots(a, 1) is None  # slot 15 belongs to b: the range cannot grow
    assert cache.block_table(0) == list(range(0, 15))  # and a refused growth changes nothing
    assert cache.block_table(1) == [15, 16, 17, 18]
    assert cache.allocate_slots(b, 0).slot_mapping == []
    assert cache.block_size == 1 and cache.num_blocks == 100
    cache.free(0)
    cache.free(1)
    assert cache.num_free_blocks == 100 and cache.usage == 0.0 and not cache.reservations


def test_allocate_slots_before_can_admit_is_an_error():
    cache = ContiguousKVCacheManager(100, 64)
    with pytest.raises(ValueError, match="sequence 3 must pass can_admit before its first allocate_slots"):
        cache.allocate_slots(seq(3, 1, 1), 1)
    assert cache.num_free_blocks == 100


def test_free_of_an_unknown_or_admitted_but_unallocated_sequence_is_harmless():
    cache = ContiguousKVCacheManager(100, 64)
    cache.free(42)
    admitted = seq(0, 5, 5)
    assert cache.can_admit(admitted, 5)
    cache.free(0)  # admitted, never allocated: forgets the admission
    with pytest.raises(ValueError, match="must pass can_admit"):
        cache.allocate_slots(admitted, 5)
    assert cache.num_free_blocks == 100


def test_memory_report_of_one_max_request_then_a_blocked_one():
    cache = ContiguousKVCacheManager(100, 64, "max", "buddy")  # chunks 64 + 32 + 4
    a = seq(0, 10, 20)
    assert cache.fits_at_all(a) and cache.can_admit(a, 10)
    cache.allocate_slots(a, 10)
    cache.allocate_slots(a, 5)
    report = cache.memory_report()
    assert report == MemoryReport(
        total_slots=100,
        token_slots=15,
        reserved_slots=15,  # up to prompt + max_tokens = 30
        internal_fragmentation_slots=64 - 30,
        external_fragmentation_slots=0,  # no one is waiting
        free_slots=36,
    )
    assert cache.usage == pytest.approx(0.64)
    b = seq(1, 3, 3)
    assert not cache.can_admit(b, 3)  # a Max request needs 64 slots; the holes are 32 and 4
    report = cache.memory_report()
    assert (report.external_fragmentation_slots, report.free_slots) == (36, 0)
    assert (report.token_slots, report.reserved_slots, report.internal_fragmentation_slots) == (15, 15, 34)
    cache.free(0)
    assert cache.can_admit(b, 3)  # b is let in: the holes are nobody's loss any more
    cache.allocate_slots(b, 3)
    report = cache.memory_report()
    assert (report.token_slots, report.reserved_slots, report.internal_fragmentation_slots) == (3, 3, 58)
    assert (report.external_fragmentation_slots, report.free_slots) == (0, 36)


def test_buddy_rounding_is_external_fragmentation_and_first_fit_has_none():
    for placement, rounding in [("buddy", 64 - 42), ("first-fit", 0)]:
        cache = ContiguousKVCacheManager(128, 128, "pow2", placement)
        s = seq(0, 10, 25)
        assert cache.can_admit(s, 10)  # pow2 reserves 10 + 32 = 42 slots
        cache.allocate_slots(s, 10)
        report = cache.memory_report()
        assert (report.token_slots, report.reserved_slots) == (10, 25)
        assert report.internal_fragmentation_slots == 42 - 35
        assert report.external_fragmentation_slots == rounding
        assert report.free_slots == 128 - 42 - rounding


def test_freeing_the_blocked_request_clears_its_external_fragmentation():
    cache = ContiguousKVCacheManager(100, 64, "max", "buddy")
    running = seq(0, 10, 20)
    assert cache.can_admit(running, 10)
    cache.allocate_slots(running, 10)
    assert not cache.can_admit(seq(1, 3, 3), 3)
    cache.free(1)  # the waiting request is aborted (engine.abort_request -> scheduler.finish -> free)
    assert cache.memory_report().external_fragmentation_slots == 0


def test_fits_at_all():
    assert ContiguousKVCacheManager(100, 64, "max").fits_at_all(seq(0, 10, 54))
    assert not ContiguousKVCacheManager(100, 64, "max").fits_at_all(seq(0, 10, 55))  # past max_model_len
    assert not ContiguousKVCacheManager(100, 128, "max", "buddy").fits_at_all(seq(0, 1, 1))  # no 128 chunk
    assert not ContiguousKVCacheManager(100, 128, "max", "first-fit").fits_at_all(seq(0, 1, 1))
    assert ContiguousKVCacheManager(100, 128, "oracle", "first-fit").fits_at_all(seq(0, 60, 40))
    assert not ContiguousKVCacheManager(100, 128, "oracle", "first-fit").fits_at_all(seq(0, 60, 41))
    assert not ContiguousKVCacheManager(100, 128, "oracle", "buddy").fits_at_all(seq(0, 60, 40))  # 128
    assert ContiguousKVCacheManager(100, 128, "oracle", "buddy").fits_at_all(seq(0, 30, 34))  # 64
    busy = ContiguousKVCacheManager(100, 64, "max")
    running = seq(0, 5, 5)
    busy.can_admit(running, 5)
    busy.allocate_slots(running, 5)
    assert busy.fits_at_all(seq(1, 10, 10))  # judged on an empty cache, not on the current one


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(num_slots=0, max_model_len=64), ValueError, "num_slots must be a positive int"),
        (dict(num_slots=100, max_model_len=0), ValueError, "max_model_len must be a positive int"),
        (dict(num_slots=100, max_model_len=64, policy="min"), ValueError, "policy must be one of"),
        (dict(num_slots=100, max_model_len=64, placement="best-fit"), ValueError, "placement must be one of"),
    ],
)
def test_bad_contiguous_manager_settings(kwargs, error, message):
    with pytest.raises(error, match=message):
        ContiguousKVCacheManager(**kwargs)


ops = st.lists(
    st.tuples(st.sampled_from(["admit", "grow", "free"]), st.integers(0, 7), st.integers(1, 30)), max_size=60
)


@settings(max_examples=80)
@given(
    ops=ops,
    policy=st.sampled_from(["max", "pow2", "oracle"]),
    placement=st.sampled_from(["buddy", "first-fit"]),
    num_slots=st.integers(64, 400),
)
def test_memory_report_always_accounts_for_every_slot(ops, policy, placement, num_slots):
    max_model_len = 64
    cache = ContiguousKVCacheManager(num_slots, max_model_len, policy, placement)
    written: dict[int, int] = {}
    final: dict[int, int] = {}
    seqs = {}
    for op, seq_id, n in ops:
        if op == "admit" and seq_id not in written:
            s = seq(seq_id, n, min(n, max_model_len - n))
            if cache.can_admit(s, n):
                seqs[seq_id] = s
                mapping = cache.allocate_slots(s, n).slot_mapping
                assert mapping == list(range(mapping[0], mapping[0] + n))
                written[seq_id], final[seq_id] = n, s.max_total_tokens
        elif op == "grow" and seq_id in written:
            allocation = cache.allocate_slots(seqs[seq_id], 1)
            if allocation is not None:
                assert allocation.slot_mapping == [cache.block_table(seq_id)[-1]]
                written[seq_id] += 1
            else:
                assert written[seq_id] >= final[seq_id]  # reservations always cover prompt + max_tokens
        elif op == "free":
            cache.free(seq_id)
            written.pop(seq_id, None)
        report = cache.memory_report()  # its constructor checks that the categories sum to total
        assert report.token_slots == sum(written.values())
        assert all(len(cache.block_table(i)) == k for i, k in written.items())
        tables = [set(cache.block_table(i)) for i in written]
        assert sum(map(len, tables)) == len(set().union(*tables))  # no slot in two tables
    for seq_id in list(written):
        cache.free(seq_id)
    assert cache.num_free_blocks == num_slots


# -- contiguous managers on the paper's setup -------------------------------------------------------
@pytest.fixture(scope="module")
def backlog_runs():
    trace = synthetic_trace("sharegpt", 150, seed=1)
    runs = {}
    for name, placement in [
        ("max", "buddy"), ("pow2", "buddy"), ("oracle", "buddy"), ("oracle", "first-fit"), ("paged", "buddy")
    ]:  # fmt: skip
        cache = make_manager(name, placement=placement)
        runs[name, placement] = (cache, run_trace(trace, cache, report_every=0))
    return trace, runs


def test_max_never_runs_more_than_seven_requests_on_the_paper_arena(backlog_runs):
    _, runs = backlog_runs
    _, result = runs["max", "buddy"]
    assert result.peak_running == KV_SLOTS // MAX_MODEL_LEN == 7


def test_contiguous_managers_never_preempt_and_give_every_slot_back(backlog_runs):
    trace, runs = backlog_runs
    for (name, _), (cache, result) in runs.items():
        assert sorted(result.finish_step) == list(range(len(trace)))
        if name != "paged":
            assert result.num_preemptions == 0
            assert cache.num_free_blocks == cache.num_slots == KV_SLOTS and not cache.reservations
        else:
            assert cache.num_free_blocks == KV_SLOTS // 16


def test_better_reservations_batch_more_requests(backlog_runs):
    _, runs = backlog_runs
    mean = {key: result.mean_running for key, (_, result) in runs.items()}
    assert mean["oracle", "buddy"] >= mean["pow2", "buddy"] >= mean["max", "buddy"]
    assert mean["oracle", "first-fit"] >= mean["oracle", "buddy"]
    assert mean["paged", "buddy"] > mean["oracle", "first-fit"]
    assert mean["oracle", "buddy"] > 1.5 * mean["max", "buddy"]  # not all equal by accident


def test_memory_reports_during_a_contiguous_run_are_consistent():
    trace = [r for r in synthetic_trace("alpaca", 60, seed=3) if r.total_len <= 256]
    cache = ContiguousKVCacheManager(1024, 256, "pow2", "buddy")
    result = run_trace(trace, cache)
    blocked = [s.report for s in result.steps if s.num_waiting and s.report is not None]
    assert blocked and any(r.external_fragmentation_slots > 0 for r in blocked)
    assert all(s.report.token_slots == s.token_slots for s in result.steps)
    assert all(s.free_blocks >= s.report.free_slots for s in result.steps)
    assert result.steps[-1].report.free_slots == 1024


# -- static batching --------------------------------------------------------------------------------
def test_static_batch_admits_no_one_until_its_last_member_ends():
    cache = ContiguousKVCacheManager(40, 40, "oracle", "first-fit")
    scheduler = Scheduler(cache, scheduling_policy=StaticBatching())
    scheduler.add(seq(0, 10, 6))  # slots 0..15
    scheduler.add(seq(1, 10, 2))  # slots 16..27
    scheduler.add(seq(2, 14, 2))  # 16 slots: only 12 are left, so the batch is {0, 1}
    assert ids(step(scheduler)) == [(0, 10), (1, 10)]
    assert ids(step(scheduler)) == [(0, 1), (1, 1)]  # 1 ends: 16..39 is free, 2 would fit now
    scheduler.add(seq(3, 1, 1))
    for _ in range(4):
        assert ids(step(scheduler)) == [(0, 1)]  # but the batch is closed until 0 ends
        assert [s.seq_id for s in scheduler.waiting] == [2, 3]
    assert ids(step(scheduler)) == [(2, 14), (3, 1)]  # the next batch forms at once
    assert cache.block_table(2) == list(range(14))  # in the lowest hole: the whole arena is free


def test_continuous_batching_admits_as_soon_as_memory_frees():
    cache = ContiguousKVCacheManager(40, 40, "oracle", "first-fit")
    scheduler = Scheduler(cache)
    scheduler.add(seq(0, 10, 6))
    scheduler.add(seq(1, 10, 2))
    scheduler.add(seq(2, 14, 2))
    assert ids(step(scheduler)) == [(0, 10), (1, 10)]
    assert ids(step(scheduler)) == [(0, 1), (1, 1)]
    assert ids(step(scheduler)) == [(0, 1), (2, 14)]  # 2 joins the running batch at once
    assert cache.block_table(2) == list(range(16, 30))


def test_a_static_batch_stays_open_only_while_the_token_budget_stopped_it():
    scheduler = Scheduler(
        PagedKVCacheManager(64, 4), max_num_batched_tokens=32, scheduling_policy=StaticBatching()
    )
    scheduler.add(seq(0, 32, 5))
    scheduler.add(seq(1, 30, 5))
    assert ids(step(scheduler)) == [(0, 32)]  # the budget is spent: 1 waits, the batch stays open
    assert ids(step(scheduler)) == [(0, 1), (1, 30)]  # 1 joins the batch that is still filling
    scheduler.add(seq(2, 1, 1))
    assert ids(step(scheduler)) == [(0, 1), (1, 1)]  # the queue emptied: the batch closed
    assert [s.seq_id for s in scheduler.waiting] == [2]


def test_a_static_batch_closed_by_memory_stays_closed():
    cache = PagedKVCacheManager(10, 4, watermark=0.0)
    scheduler = Scheduler(cache, max_num_batched_tokens=100, scheduling_policy=StaticBatching())
    scheduler.add(seq(0, 8, 2))  # 2 blocks, ends after 2 steps
    scheduler.add(seq(1, 20, 12))  # 5 blocks prefill
    scheduler.add(seq(2, 13, 2))  # 4 blocks: does not fit beside the 7 taken
    assert ids(step(scheduler)) == [(0, 8), (1, 20)]
    assert ids(step(scheduler)) == [(0, 1), (1, 1)]  # 0 ends: 4 blocks free, 2 would fit now
    for _ in range(3):
        assert ids(step(scheduler)) == [(1, 1)]


def test_a_late_arrival_does_not_join_a_static_batch_that_is_still_filling():
    scheduler = Scheduler(
        PagedKVCacheManager(64, 4), max_num_batched_tokens=32, scheduling_policy=StaticBatching()
    )
    scheduler.add(seq(0, 32, 5))
    scheduler.add(seq(1, 30, 5))
    step(scheduler)
    scheduler.add(seq(2, 4, 5))  # arrives after the batch {0, 1} formed
    out = step(scheduler)
    assert 2 not in [s.seq.seq_id for s in out.scheduled]


def test_static_and_continuous_agree_on_equal_requests():
    trace = fixed_trace(12, 20, 30)
    for make in (lambda: ContiguousKVCacheManager(1024, 256, "max"), lambda: PagedKVCacheManager(64, 16)):
        static = run_trace(trace, make(), scheduling_policy=StaticBatching())
        continuous = run_trace(trace, make())
        assert static.finish_step == continuous.finish_step
        assert len(static.steps) == len(continuous.steps)


def test_static_batching_waits_for_the_longest_member():
    trace = [TraceRequest(20, 5 + 10 * (i % 3)) for i in range(12)]  # outputs 5, 15, 25
    make = lambda: ContiguousKVCacheManager(1024, 256, "max")  # noqa: E731  four at a time
    static = run_trace(trace, make(), scheduling_policy=StaticBatching())
    continuous = run_trace(trace, make())
    assert static.peak_running == continuous.peak_running == 4
    assert len(static.steps) > len(continuous.steps)
    assert static.mean_running < continuous.mean_running


@settings(max_examples=30)
@given(seed=st.integers(0, 10_000), rate=st.sampled_from([0.2, 1.0, 5.0]))
def test_a_static_batch_never_grows_while_it_runs(seed, rate):
    trace = synthetic_trace("alpaca", 40, request_rate=rate, seed=seed)  # arrival times count steps
    trace = [r for r in trace if r.total_len <= 300]
    cache = PagedKVCacheManager(24, 16)
    result = run_trace(trace, cache, scheduling_policy=StaticBatching(), max_num_batched_tokens=100_000)
    assert sorted(result.finish_step) == list(range(len(trace)))
    for before, after in itertools.pairwise(result.steps):
        if before.num_running:  # a batch is running: no one may join it
            assert after.num_running <= before.num_running, (before, after)
    assert cache.num_free_blocks == 24
