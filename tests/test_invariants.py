"""Property-based tests: random allocate / append / reserve / fork / copy-on-write / free programs.

A hypothesis state machine drives many page tables over one small allocator and a real (tiny)
KV cache. Every token written gets a unique value; after every step each sequence must read back
exactly the values it wrote, through its own page table. That one check catches a block freed
while still in use, two sequences writing the same slot, and a copy-on-write that forgot to copy.
"""

import itertools
from collections import Counter

import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from paged_attention.engine.worker.kv_cache import KVCache, KVCacheSpec
from paged_attention.memory.accounting import paged_memory_report
from paged_attention.memory.allocator import BlockAllocator, NoFreeBlocksError
from paged_attention.memory.page_table import PageTable

NUM_BLOCKS = 12


class PagedMemoryMachine(RuleBasedStateMachine):
    tables = Bundle("tables")

    def __init__(self) -> None:
        super().__init__()
        self.block_size = 3
        self.allocator = BlockAllocator(NUM_BLOCKS)
        self.cache = KVCache(KVCacheSpec(1, 1, 1, torch.float64), NUM_BLOCKS, self.block_size)
        self.live: dict[int, tuple[PageTable, list[float]]] = {}  # id(table) -> (table, values written)
        self.counter = itertools.count(1)

    def _append(self, table: PageTable, history: list[float], n: int) -> None:
        free_before, blocks_before = self.allocator.num_free_blocks, list(table.block_ids)
        try:
            result = table.append_tokens(n)
        except NoFreeBlocksError:
            event("append refused: out of blocks")
            assert table.block_ids == blocks_before and self.allocator.num_free_blocks == free_before
            return
        if result.copy is not None:
            event("copy-on-write")
            self.cache.copy_blocks([result.copy])
        for slot in result.slot_mapping:  # the slots written now belong to this table alone
            assert self.allocator.ref_count(slot // self.block_size) == 1
        values = [float(next(self.counter)) for _ in range(n)]
        kv = torch.tensor(values, dtype=torch.float64).view(n, 1, 1)
        self.cache.store(0, kv, -kv, torch.tensor(result.slot_mapping, dtype=torch.int64))
        history.extend(values)

    @rule(target=tables, n=st.integers(1, 10))
    def new_sequence(self, n):
        table = PageTable(self.allocator, self.block_size)
        history: list[float] = []
        self._append(table, history, n)
        self.live[id(table)] = (table, history)
        return table

    @rule(table=tables, n=st.integers(1, 5))
    def append(self, table, n):
        if id(table) in self.live:
            self._append(table, self.live[id(table)][1], n)

    @rule(table=tables, n=st.integers(0, 7))
    def reserve(self, table, n):
        """Blocks for a prompt's later chunks, taken now (vLLM v0's whole-prompt allocation)."""
        if id(table) not in self.live:
            return
        free_before, blocks_before = self.allocator.num_free_blocks, list(table.block_ids)
        tokens = table.num_tokens
        try:
            taken = table.reserve(n)
        except NoFreeBlocksError:
            event("reserve refused: out of blocks")
            assert table.block_ids == blocks_before and self.allocator.num_free_blocks == free_before
            return
        event("reserved blocks" if taken else "reserve: room already held")
        assert table.num_tokens == tokens and table.block_ids[: len(blocks_before)] == blocks_before
        assert table.capacity >= tokens + n and self.allocator.num_free_blocks == free_before - taken
        for block_id in table.block_ids[len(blocks_before) :]:
            assert self.allocator.ref_count(block_id) == 1
        # its appends take no new block (but a copy, if its last written block is shared)
        assert not n or table.blocks_needed(n) == int(table.needs_copy_on_write())

    @rule(target=tables, table=tables)
    def fork(self, table):
        if id(table) not in self.live:
            return table
        child = table.fork()
        self.live[id(child)] = (child, list(self.live[id(table)][1]))
        return child

    @rule(block_id=st.integers(0, NUM_BLOCKS - 1))
    def touch_and_release(self, block_id):
        """A prefix-cache style hit: pull a block (free or not) out of the queue, then let it go."""
        was_free = self.allocator.is_free(block_id)
        free_before = self.allocator.num_free_blocks
        self.allocator.touch(block_id)
        assert self.allocator.num_free_blocks == free_before - was_free
        self.allocator.free(block_id)
        assert self.allocator.num_free_blocks == free_before

    @precondition(lambda self: self.live)
    @rule(table=consumes(tables))
    def free(self, table):
        if self.live.pop(id(table), None) is not None:
            table.free()

    @invariant()
    def ref_counts_equal_the_number_of_holders(self):
        holders = Counter()
        for table, _ in self.live.values():
            assert len(set(table.block_ids)) == len(table.block_ids)
            holders.update(table.block_ids)
        for block_id in range(NUM_BLOCKS):
            assert self.allocator.ref_count(block_id) == holders[block_id]
        assert sorted(self.allocator.free_block_ids()) == [b for b in range(NUM_BLOCKS) if not holders[b]]
        assert self.allocator.num_free_blocks + self.allocator.num_used_blocks == NUM_BLOCKS

    @invariant()
    def every_sequence_reads_back_what_it_wrote(self):
        keys, values = self.cache.key_cache(0).reshape(-1), self.cache.value_cache(0).reshape(-1)
        for table, history in self.live.values():
            assert table.num_tokens == len(history)
            slots = [table.slot(p) for p in range(table.num_tokens)]
            assert keys[slots].tolist() == history
            assert values[slots].tolist() == [-v for v in history]

    @invariant()
    def no_two_sequences_own_the_same_writable_slot(self):
        writable = []
        bs = self.block_size
        for table, _ in self.live.values():
            # the unwritten slots of its blocks: the last written block's tail (unless it is shared and
            # must be copied first) and every reserved block, all of them this table's alone
            start = table.num_tokens if not table.needs_copy_on_write() else -(-table.num_tokens // bs) * bs
            for position in range(start, table.capacity):
                block = table.block_ids[position // bs]
                assert self.allocator.ref_count(block) == 1
                writable.append(block * bs + position % bs)
        assert len(writable) == len(set(writable))

    @invariant()
    def memory_report_adds_up(self):
        tables = [t for t, _ in self.live.values()]
        report = paged_memory_report(tables, self.allocator, self.block_size)
        assert report.free_slots == self.allocator.num_free_blocks * self.block_size
        distinct = {t.slot(p) for t in tables for p in range(t.num_tokens)}
        assert report.token_slots == len(distinct)
        assert report.reserved_slots == sum(t.num_reserved_blocks for t in tables) * self.block_size

    def teardown(self):
        for table, _ in self.live.values():
            table.free()
        assert self.allocator.num_free_blocks == NUM_BLOCKS
        assert all(self.allocator.ref_count(b) == 0 for b in range(NUM_BLOCKS))


TestPagedMemory = PagedMemoryMachine.TestCase
