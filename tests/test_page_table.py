import pytest
import torch

from paged_attention.kernels.layout import build_block_tables, build_csr_layout, build_slot_mapping
from paged_attention.memory.allocator import BlockAllocator, NoFreeBlocksError
from paged_attention.memory.page_table import AppendResult, BlockCopy, PageTable


def test_a_new_block_exactly_when_the_last_one_is_full():
    alloc = BlockAllocator(8)
    table = PageTable(alloc, block_size=4)
    assert table.append_tokens(3).slot_mapping == [0, 1, 2]
    assert table.block_ids == [0]
    assert table.append_tokens(1).slot_mapping == [3]  # fills block 0, takes nothing new
    assert table.block_ids == [0] and alloc.num_used_blocks == 1
    assert table.append_tokens(1).slot_mapping == [4]  # block 0 full: now block 1
    assert table.block_ids == [0, 1]
    assert (table.num_tokens, table.capacity, table.num_unfilled_slots) == (5, 8, 3)


def test_slots_follow_scattered_physical_blocks():
    alloc = BlockAllocator(8)
    alloc.allocate_many(8)
    for b in (6, 2, 5):  # make the free queue hand out blocks 6, 2, 5 in that order
        alloc.free(b)
    table = PageTable(alloc, block_size=2)
    result = table.append_tokens(5)
    assert table.block_ids == [6, 2, 5]
    assert result.slot_mapping == [12, 13, 4, 5, 10]
    assert [table.slot(p) for p in range(5)] == result.slot_mapping
    assert result.copy is None


def test_append_zero_tokens_is_a_no_op():
    alloc = BlockAllocator(2)
    table = PageTable(alloc, block_size=4)
    assert table.append_tokens(0) == AppendResult([], None)
    assert table.num_blocks == 0
    table.append_tokens(2)
    child = table.fork()  # a shared, half-full last block: appending nothing must not copy it
    assert child.append_tokens(0) == AppendResult([], None)
    assert child.block_ids == table.block_ids and alloc.ref_count(0) == 2


def test_fork_shares_every_block_and_copy_on_write_splits_the_partial_last_block():
    alloc = BlockAllocator(8)
    parent = PageTable(alloc, block_size=4)
    parent.append_tokens(6)  # blocks [0, 1], block 1 half full
    child = parent.fork()
    assert child.block_ids == parent.block_ids == [0, 1]
    assert child.num_tokens == 6
    assert [alloc.ref_count(b) for b in (0, 1)] == [2, 2]
    assert parent.needs_copy_on_write() and child.needs_copy_on_write()
    assert parent.blocks_needed(1) == 1

    result = child.append_tokens(1)  # the child writes first: it gets a private copy of block 1
    assert result.copy == BlockCopy(src=1, dst=2)
    assert child.block_ids == [0, 2] and result.slot_mapping == [2 * 4 + 2]
    assert [alloc.ref_count(b) for b in (0, 1, 2)] == [2, 1, 1]
    assert not parent.needs_copy_on_write()  # block 1 is the parent's alone now
    assert parent.append_tokens(1) == AppendResult([1 * 4 + 2], None)


def test_fork_of_a_full_last_block_needs_no_copy():
    alloc = BlockAllocator(8)
    parent = PageTable(alloc, block_size=4)
    parent.append_tokens(4)
    child = parent.fork()
    assert not child.needs_copy_on_write()
    result = child.append_tokens(1)
    assert result.copy is None and child.block_ids == [0, 1]


def test_append_is_all_or_nothing_when_blocks_run_out():
    alloc = BlockAllocator(3)
    table = PageTable(alloc, block_size=2)
    table.append_tokens(3)
    other = table.fork()
    with pytest.raises(NoFreeBlocksError):
        other.append_tokens(4)  # needs a copy + 2 new blocks, only 1 free
    assert other.block_ids == [0, 1] and other.num_tokens == 3
    assert alloc.num_free_blocks == 1


def test_free_returns_every_block_and_shared_blocks_survive_other_owners():
    alloc = BlockAllocator(6)
    a = PageTable(alloc, block_size=4)
    a.append_tokens(9)
    b = a.fork()
    a.free()
    assert a.block_ids == [] and a.num_tokens == 0
    assert alloc.num_free_blocks == 3  # b still holds the three blocks
    b.free()
    assert alloc.num_free_blocks == 6


def test_bad_input():
    alloc = BlockAllocator(2)
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        PageTable(alloc, 0)
    with pytest.raises(TypeError, match="allocator must be a BlockAllocator"):
        PageTable(object(), 4)
    table = PageTable(alloc, 4)
    with pytest.raises(ValueError, match="num_new_tokens must be an int >= 0"):
        table.append_tokens(-1)
    with pytest.raises(ValueError, match="position must be < num_tokens=0"):
        table.slot(0)


def _three_tables():
    alloc = BlockAllocator(16)
    tables = [PageTable(alloc, block_size=4) for _ in range(3)]
    for table, n in zip(tables, (5, 1, 8), strict=True):
        table.append_tokens(n)
    return tables


def test_build_block_tables_pads_rows():
    tables = _three_tables()  # blocks [0,1], [2], [3,4]
    block_tables, seq_lens = build_block_tables(tables, max_blocks=4, pad_value=-1)
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    assert block_tables.tolist() == [[0, 1, -1, -1], [2, -1, -1, -1], [3, 4, -1, -1]]
    assert seq_lens.tolist() == [5, 1, 8]
    assert build_block_tables(tables)[0].shape == (3, 2)
    with pytest.raises(ValueError, match="max_blocks must be >= the longest table's 2 blocks"):
        build_block_tables(tables, max_blocks=1)


def test_csr_layout_matches_the_padded_tables():
    tables = _three_tables()
    csr = build_csr_layout(tables)
    assert csr.indptr.tolist() == [0, 2, 3, 5]
    assert csr.indices.tolist() == [0, 1, 2, 3, 4]
    assert csr.last_page_len.tolist() == [1, 1, 4]
    for i, table in enumerate(tables):
        pages = csr.indices[csr.indptr[i] : csr.indptr[i + 1]].tolist()
        assert pages == table.block_ids
        assert (len(pages) - 1) * 4 + int(csr.last_page_len[i]) == table.num_tokens


def test_build_slot_mapping_concatenates_in_order():
    alloc = BlockAllocator(4)
    a, b = PageTable(alloc, 2), PageTable(alloc, 2)
    mapping = build_slot_mapping([a.append_tokens(3), b.append_tokens(1), [-1]])
    assert mapping.dtype == torch.int64
    assert mapping.tolist() == [0, 1, 2, 4, -1]


def test_a_copy_on_write_below_reserved_blocks_rolls_back() -> None:
    """A reserved table whose written tail is shared by a fork made mid-step: the copy-on-write
    replaces an entry below the reserved ones, and the rollback puts it back (found in review)."""
    allocator = BlockAllocator(8)
    table = PageTable(allocator, 4)
    table.append_tokens(6)
    table.reserve(7)
    before = (list(table.block_ids), table.num_tokens, [allocator.ref_count(b) for b in range(8)])
    state = table.snapshot()
    allocator.begin()
    table.append_tokens(3)
    table.fork()
    assert table.append_tokens(1).copy is not None and table.block_ids[2] != before[0][2]
    allocator.rollback()
    table.restore(state)
    assert (list(table.block_ids), table.num_tokens, [allocator.ref_count(b) for b in range(8)]) == before
