import pytest

from paged_attention.memory.accounting import MemoryReport, max_reservation_breakdown, paged_memory_report
from paged_attention.memory.allocator import BlockAllocator
from paged_attention.memory.page_table import PageTable


def test_paged_report_counts_tokens_unfilled_tail_and_free():
    alloc = BlockAllocator(10)
    a, b = PageTable(alloc, 4), PageTable(alloc, 4)
    a.append_tokens(5)  # 2 blocks, 3 unfilled
    b.append_tokens(4)  # 1 block, full
    report = paged_memory_report([a, b], alloc, 4)
    assert (report.total_slots, report.token_slots) == (40, 9)
    assert report.internal_fragmentation_slots == 3
    assert report.free_slots == 28 and report.used_slots == 12
    assert report.token_fraction_of_used == pytest.approx(9 / 12)
    assert report.fractions()["free"] == pytest.approx(0.7)


def test_shared_blocks_are_counted_once():
    alloc = BlockAllocator(10)
    parent = PageTable(alloc, 4)
    parent.append_tokens(6)
    children = [parent.fork() for _ in range(3)]
    report = paged_memory_report([parent, *children], alloc, 4)
    assert report.token_slots == 6 and report.internal_fragmentation_slots == 2
    assert report.shared_blocks == 2
    children[0].append_tokens(1)  # copy-on-write: a private copy of the half-full block
    report = paged_memory_report([parent, *children], alloc, 4)
    assert report.token_slots == 6 + 3 and report.shared_blocks == 2
    assert "token_states" in str(report)


def test_report_rejects_categories_that_do_not_add_up_and_mixed_inputs():
    with pytest.raises(ValueError, match="add up to 5 slots, not total_slots=6"):
        MemoryReport(total_slots=6, token_slots=5)
    alloc = BlockAllocator(4)
    with pytest.raises(ValueError, match="must have block_size=2, got 4"):
        paged_memory_report([PageTable(alloc, 2), PageTable(alloc, 4)], alloc, 2)
    with pytest.raises(ValueError, match="must draw from the allocator passed in"):
        paged_memory_report([PageTable(BlockAllocator(2), 2)], alloc, 2)


def test_max_reservation_breakdown():
    rows = max_reservation_breakdown([10, 20], [30, 5], [12, 9], max_len=64)
    assert [(r.tokens, r.future, r.wasted) for r in rows] == [(22, 18, 24), (25, 0, 39)]
    with pytest.raises(ValueError, match="exceeds max_len=64"):
        max_reservation_breakdown([60], [10], [0], max_len=64)
    with pytest.raises(ValueError, match="same length"):
        max_reservation_breakdown([1], [1, 2], [0], max_len=8)
