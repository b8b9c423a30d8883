"""Memory for drafted tokens (speculative decoding, issue 23): slots for lookahead tokens that are
never entered in the prefix cache, and truncation that gives back, at once, the blocks only
rejected drafts held; property-based over random appends, forks, truncations and rollbacks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_attention._checks import cdiv
from paged_attention.baselines.contiguous import ContiguousKVCacheManager
from paged_attention.engine.params import SamplingParams
from paged_attention.engine.sequence import Sequence
from paged_attention.memory.allocator import BlockAllocator
from paged_attention.memory.page_table import PageTable
from paged_attention.memory.paged_manager import PagedKVCacheManager


def held(allocator: BlockAllocator) -> dict[int, int]:
    return {b: allocator.ref_count(b) for b in range(allocator.num_blocks) if allocator.ref_count(b)}


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 5),
    st.lists(
        st.tuples(st.sampled_from(["append", "truncate", "fork", "free"]), st.integers(0, 9)), max_size=30
    ),
)
def test_truncate_keeps_the_tables_and_the_allocator_consistent(block_size: int, ops: list) -> None:
    allocator = BlockAllocator(64)
    tables = [PageTable(allocator, block_size)]
    for op, n in ops:
        table = tables[n % len(tables)]
        if op == "append" and table.blocks_needed(n) <= allocator.num_free_blocks:
            table.append_tokens(n)
        elif op == "truncate":
            keep = n % (table.num_tokens + 1)
            before = list(table.block_ids)
            dropped = table.truncate(keep)
            assert dropped == before[cdiv(keep, block_size) :] and table.num_tokens == keep
        elif op == "fork" and len(tables) < 4:
            tables.append(table.fork())
        elif op == "free":
            table.free()
        for t in tables:  # every table holds exactly the blocks its tokens need
            assert len(t.block_ids) == cdiv(t.num_tokens, block_size)
        owners: dict[int, int] = {}
        for t in tables:
            for b in t.block_ids:
                owners[b] = owners.get(b, 0) + 1
        assert held(allocator) == owners  # reference counts are exactly the tables' holdings
    for t in tables:
        t.free()
    assert allocator.num_free_blocks == 64


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(0, 12), st.integers(0, 12), st.integers(0, 24), st.integers(0, 6))
def test_a_truncation_inside_a_step_rolls_back(
    block_size: int, first: int, more: int, keep: int, reserve: int
) -> None:
    allocator = BlockAllocator(32)
    table = PageTable(allocator, block_size)
    table.append_tokens(first)
    before = (list(table.block_ids), table.num_tokens, held(allocator), allocator.free_block_ids())
    state = table.snapshot()
    allocator.begin()
    table.reserve(reserve)  # a prompt's later chunks, reserved at admission (undone with the rest)
    table.append_tokens(more)
    table.truncate(min(keep, table.num_tokens))
    table.append_tokens(1)
    allocator.rollback()
    table.restore(state)
    assert (list(table.block_ids), table.num_tokens, held(allocator), allocator.free_block_ids()) == before


def seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, str(seq_id), list(tokens), SamplingParams(max_tokens=16), 0.0)


def test_drafted_slots_are_never_cached_and_rejected_ones_free_their_blocks() -> None:
    manager = PagedKVCacheManager(16, 4, watermark=0.0, enable_prefix_caching=True)
    a = seq(0, [1, 2, 3, 4, 5])
    assert manager.allocate_slots(a, 5) is not None
    a.num_computed_tokens = 5
    free = manager.num_free_blocks
    # a decode step: the last token (position 5, which a sampled) and 6 drafted ones: positions 5..11
    a.output_token_ids.append(6)
    allocation = manager.allocate_slots(a, 1, num_lookahead_tokens=6)
    assert allocation is not None and len(allocation.slot_mapping) == 7
    assert manager.num_free_blocks == free - 1  # blocks 1 (positions 4-7) and 2 (8-11): one new
    # the drafts filled block 1 (positions 4..7) past the real tokens: nothing of it is cached
    twin = seq(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert manager.lookup_prefix(twin) == 4  # only block 0, hashed from real tokens
    manager.truncate(a, 7)  # the target accepted one draft: positions 0..6 stay
    assert len(manager.block_table(0)) == 2 and manager.num_free_blocks == free
    with pytest.raises(ValueError, match="are in the prefix cache"):
        manager.truncate(a, 3)
    manager.free(0)
    assert manager.num_free_blocks == 16


def test_a_contiguous_reservation_takes_drafts_within_its_range() -> None:
    manager = ContiguousKVCacheManager(64, max_model_len=16, policy="max")
    a = seq(0, [1, 2, 3])
    assert manager.can_admit(a, 3) and manager.allocate_slots(a, 3) is not None
    a.num_computed_tokens = 3
    assert manager.allocate_slots(a, 1, num_lookahead_tokens=4) is not None
    manager.truncate(a, 5)
    assert len(manager.block_table(0)) == 5
    assert manager.allocate_slots(a, 1, num_lookahead_tokens=11) is None  # past the 16 reserved slots
