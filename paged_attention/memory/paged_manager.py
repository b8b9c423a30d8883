"""The paged KV-cache manager: the block allocator plus one page table per sequence.

It implements :class:`~.manager.KVCacheManager`. Swapping and forking are the paper's (§4.4,
§4.5), the watermark is vLLM v0's code, and automatic prefix caching is later vLLM's. vLLM v1 has
no swap preemption and no fork or copy-on-write (its parallel samples and beams are separate
requests that share memory through the prefix cache alone), and its watermark, added recently, is
off by default:

* **A watermark** (v0's ``BlockSpaceManager(watermark=0.01)``, up to v0.10.2). New sequences are admitted only
  while more than ``watermark`` (1%) of the blocks would stay free, so that the sequences already
  running can still grow by a token without being preempted at once by the newcomer they just
  let in.
* **Swapping.** Instead of discarding a preempted sequence's pages (recompute), they can be copied
  to a pool of CPU blocks and copied back later; the manager only does the bookkeeping and returns
  the ``(device block, cpu block)`` pairs the engine must copy.
* **Forking.** ``fork`` gives a new sequence (a parallel sample, a beam) the parent's page table:
  the same physical blocks, each with one more owner. Memory is copied only when a shared, partly
  filled block is written (copy-on-write, :mod:`.page_table`).
* **Automatic prefix caching** (``enable_prefix_caching``; not the paper's, whose shared prefixes
  were predefined by the service and reserved in advance, §4.4; on by default in v1). Every block that
  fills up is entered in the allocator's hash-to-block map (:mod:`.prefix_cache`); a sequence
  being admitted starts with the blocks of its longest cached prefix and computes only the rest.
  The last token is always computed again, even if its block is cached, because its logits
  choose the next token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from .._checks import cdiv, check_int, check_positive_int
from .accounting import MemoryReport, paged_memory_report
from .allocator import BlockAllocator, NoFreeBlocksError
from .manager import CachedSequence, SlotAllocation
from .page_table import PageTable
from .prefix_cache import PrefixCacheStats, PrefixCachingBlockAllocator, extend_block_hashes


class PagedKVCacheManager:
    """Paged KV memory: blocks on demand, one page table per sequence, forks, prefix caching, CPU swap.

    ``enable_prefix_caching`` is off here and on in :class:`~paged_attention.engine.llm_engine.LLMEngine`
    (as in vLLM v1): trace replays feed placeholder tokens, which a prefix cache would take for one
    shared prompt, and they measure memory, not caching.

    Public views: ``allocator`` (device blocks), ``cpu_allocator`` (swap space, or ``None``),
    ``page_tables`` (sequence id -> :class:`PageTable`, read-only), ``prefix_cache_stats``.
    """

    supports_fork = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        watermark: float = 0.01,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = False,
    ) -> None:
        check_positive_int("num_blocks", num_blocks)
        check_positive_int("block_size", block_size)
        check_int("num_cpu_blocks", num_cpu_blocks, minimum=0)
        if not isinstance(watermark, (int, float)) or not 0 <= watermark < 1:
            raise ValueError(f"watermark must be a number in [0, 1), got {watermark!r}")
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be a bool, got {enable_prefix_caching!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.allocator = (
            PrefixCachingBlockAllocator(num_blocks) if enable_prefix_caching else BlockAllocator(num_blocks)
        )
        self.watermark_blocks = int(watermark * num_blocks)
        self.prefix_cache_stats = PrefixCacheStats()
        self.cpu_allocator = BlockAllocator(num_cpu_blocks) if num_cpu_blocks else None
        self._tables: dict[int, PageTable] = {}
        self._num_hashed_blocks: dict[int, int] = {}  # leading blocks of each table already in the cache
        self._swapped: dict[int, tuple[list[int], int]] = {}  # seq_id -> (cpu blocks, num_tokens)
        self._saved: tuple[Any, ...] | None = None  # the state at begin, while a step is open

    # -- views ----------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu_allocator.num_blocks if self.cpu_allocator else 0

    @property
    def page_tables(self) -> Mapping[int, PageTable]:
        """Sequence id -> its page table, for every sequence holding device blocks (a read-only view:
        change memory only through the manager)."""
        return MappingProxyType(self._tables)

    @property
    def num_swapped(self) -> int:
        """Sequences whose pages wait in CPU memory."""
        return len(self._swapped)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def usage(self) -> float:
        return self.allocator.usage

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables[seq_id].block_ids

    def memory_report(self) -> MemoryReport:
        return paged_memory_report(list(self._tables.values()), self.allocator, self.block_size)

    # -- admission ------------------------------------------------------------------------------
    def fits_at_all(self, seq: CachedSequence) -> bool:
        # Admission keeps the watermark free, so a request must fit beside it, or it would be
        # accepted and then wait forever (holding up everyone queued behind it).
        return cdiv(seq.max_kv_tokens, self.block_size) <= self.num_blocks - self.watermark_blocks

    def unfit_reason(self, seq: CachedSequence) -> str:
        needed = cdiv(seq.max_kv_tokens, self.block_size)
        kept = self.watermark_blocks
        return (
            f"it may store up to {seq.max_kv_tokens} tokens of KV cache (prompt + max_tokens - 1), {needed} "
            f"blocks of {self.block_size}, but the cache has {self.num_blocks} blocks"
            + (f", {kept} of which stay free for running sequences (the watermark)" if kept else "")
        )

    def lookup_prefix(self, seq: CachedSequence) -> int:
        return len(self._cached_blocks(seq)) * self.block_size

    def num_free_prefix_blocks(self, seq: CachedSequence) -> int:
        """How many of the blocks holding a waiting ``seq``'s first ``num_computed_tokens`` (its
        prefix-cache hit) sit in the free queue: cached, but held by no running sequence. Admitting
        ``seq`` takes them out of the free queue, so they cost free blocks as new ones do (vLLM v1
        counts them the same way); blocks of the hit that others hold cost nothing. 0 without a hit,
        and for a sequence that already holds memory."""
        if seq.seq_id in self._tables:
            return 0
        return self._num_free(self._reused_blocks(seq))

    def can_admit(self, seq: CachedSequence, num_new_tokens: int) -> bool:
        """The blocks ``seq`` needs beyond its prefix-cache hit, plus the hit's blocks now in the free
        queue (:meth:`num_free_prefix_blocks`), must leave ``watermark_blocks`` free."""
        needed = self._blocks_to_start(seq, num_new_tokens, self._reused_blocks(seq))
        return self.allocator.num_free_blocks - needed >= self.watermark_blocks

    def allocate_slots(
        self, seq: CachedSequence, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> SlotAllocation | None:
        """Slots for tokens ``seq.num_computed_tokens ..`` ``+ num_new_tokens - 1``, or ``None``.

        ::

            |<------------- seq.num_tokens ------------->|
            |<-- num_computed_tokens -->|<- num_new_tokens ->|...
            | K/V in the cache already  | written this step  |  (a chunked prefill: more later)
            | (a new sequence: its      |                    |
            |  cached prefix, if any)   |                    |
            [blk 0 ][blk 1 ][blk 2 ][blk 3 ][blk 4 ]          <- page table, block_size slots each
                                      ^ the last block may be shared: written only after
                                        copy-on-write (the copy is returned in ``copies``)

        A sequence that holds no memory yet gets a page table whose first blocks are the prefix
        cache's (``lookup_prefix``); the blocks this step fills are entered in the prefix cache.
        ``None`` means the free blocks are too few, and nothing changed. ``num_lookahead_tokens``
        slots follow for drafted tokens: never entered in the prefix cache (see the protocol).
        """
        check_int("num_lookahead_tokens", num_lookahead_tokens, minimum=0)
        num_slots = num_new_tokens + num_lookahead_tokens
        table = self._tables.get(seq.seq_id)
        if table is None:
            reused = self._reused_blocks(seq)
            if self._blocks_to_start(seq, num_slots, reused) > self.allocator.num_free_blocks:
                return None
            table = self._tables[seq.seq_id] = PageTable(self.allocator, self.block_size)
            table.append_cached_blocks(reused)
            self._num_hashed_blocks[seq.seq_id] = len(reused)
            if self.enable_prefix_caching:
                preempted = seq.num_preemptions > 0
                self.prefix_cache_stats.record(seq.num_tokens, len(reused) * self.block_size, preempted)
        elif table.num_tokens != seq.num_computed_tokens:
            raise ValueError(
                f"sequence {seq.seq_id} holds {table.num_tokens} tokens of KV cache "
                f"but says {seq.num_computed_tokens} are computed"
            )
        try:
            result = table.append_tokens(num_slots)  # all or nothing
        except NoFreeBlocksError:
            return None  # too few free blocks (never for a new table: its blocks were counted above)
        if self.enable_prefix_caching:
            # Enter the blocks this step fills: the step computes them before any later step can read
            # them, and a sequence scheduled behind this one in the same step reads them after they
            # are stored (every layer stores the whole batch's K/V before attending).
            self._cache_full_blocks(seq, table, seq.num_computed_tokens + num_new_tokens)
        return SlotAllocation(result.slot_mapping, [result.copy] if result.copy else [])

    def reserve(self, seq: CachedSequence, num_new_tokens: int) -> bool:
        """Take now the blocks that ``num_new_tokens`` tokens past ``seq``'s allocated slots will
        need (:meth:`PageTable.reserve`); ``False`` (no change) if too few are free. Reserved blocks
        are never entered in the prefix cache before they are written, and never swapped out."""
        check_int("num_new_tokens", num_new_tokens, minimum=0)
        table = self._tables.get(seq.seq_id)
        if table is None:
            raise ValueError(f"reserve: sequence {seq.seq_id} holds no KV cache (allocate its first slots)")
        try:
            table.reserve(num_new_tokens)
        except NoFreeBlocksError:
            return False
        return True

    def truncate(self, seq: CachedSequence, num_tokens: int) -> None:
        """Drop ``seq``'s slots from ``num_tokens`` on (:meth:`PageTable.truncate`); the blocks that
        held only those return to the free queue now. Only drafted slots may go: never a block the
        prefix cache holds."""
        table = self._tables.get(seq.seq_id)
        if table is None:
            raise ValueError(f"truncate: sequence {seq.seq_id} holds no KV cache")
        hashed = self._num_hashed_blocks.get(seq.seq_id, 0) * self.block_size
        if num_tokens < hashed:
            raise ValueError(
                f"truncate: the first {hashed} tokens of sequence {seq.seq_id} are in the prefix cache"
            )
        table.truncate(num_tokens)

    def free(self, seq_id: int) -> None:
        table = self._tables.pop(seq_id, None)
        if table is not None:
            table.free()  # cached blocks keep their hashes in the free queue until evicted
        self._num_hashed_blocks.pop(seq_id, None)
        swapped = self._swapped.pop(seq_id, None)
        if swapped is not None and self.cpu_allocator is not None:
            for block_id in swapped[0]:
                self.cpu_allocator.free(block_id)

    # -- sharing --------------------------------------------------------------------------------
    def fork(self, parent: CachedSequence, child: CachedSequence) -> None:
        table = self._tables.get(parent.seq_id)
        if table is None:
            raise ValueError(f"fork: sequence {parent.seq_id} holds no KV cache to share")
        if child.seq_id in self._tables or child.seq_id in self._swapped:
            raise ValueError(f"fork: sequence {child.seq_id} already holds KV cache")
        if child.num_computed_tokens != table.num_tokens or child.num_tokens != parent.num_tokens:
            raise ValueError(
                f"fork: the child must start as a copy of the parent ({parent.num_tokens} tokens, "
                f"{table.num_tokens} computed), got {child.num_tokens} tokens, "
                f"{child.num_computed_tokens} computed"
            )
        self._tables[child.seq_id] = table.fork()
        self._num_hashed_blocks[child.seq_id] = self._num_hashed_blocks[parent.seq_id]
        child.block_hashes = list(parent.block_hashes)

    def reset_prefix_cache(self) -> int:
        """Forget the cached contents of every free block (vLLM's ``reset_prefix_cache``)."""
        return self.allocator.reset() if isinstance(self.allocator, PrefixCachingBlockAllocator) else 0

    # -- a step is a transaction ----------------------------------------------------------------
    def begin(self) -> None:
        """Remember the bookkeeping as it is now, O(1) per sequence held (each page table's
        :meth:`~.page_table.PageTable.snapshot`; the allocators keep undo logs, O(changes))."""
        tables = {sid: (t, t.snapshot()) for sid, t in self._tables.items()}
        stats = dataclasses.replace(self.prefix_cache_stats)
        self._saved = (tables, dict(self._num_hashed_blocks), dict(self._swapped), stats)
        self.allocator.begin()
        if self.cpu_allocator is not None:
            self.cpu_allocator.begin()

    def commit(self) -> None:
        self._saved = None
        self.allocator.commit()
        if self.cpu_allocator is not None:
            self.cpu_allocator.commit()

    def rollback(self) -> None:
        """Put every page table, allocator and prefix-cache entry back as at :meth:`begin`."""
        if self._saved is None:
            raise RuntimeError("rollback without begin")
        tables, self._num_hashed_blocks, self._swapped, self.prefix_cache_stats = self._saved
        self._saved = None
        self.allocator.rollback()
        if self.cpu_allocator is not None:
            self.cpu_allocator.rollback()
        self._tables.clear()
        for seq_id, (table, state) in tables.items():
            table.restore(state)
            self._tables[seq_id] = table

    def reused_blocks(self) -> tuple[list[int], list[int]]:
        """``(device blocks, cpu blocks)`` handed out in this step that held K/V when it began."""
        cpu = self.cpu_allocator.reused_blocks() if self.cpu_allocator is not None else []
        return self.allocator.reused_blocks(), cpu

    # -- the prefix cache -----------------------------------------------------------------------
    def _cached_blocks(self, seq: CachedSequence) -> list[int]:
        """Blocks of the longest cached prefix of ``seq``, never including its last token."""
        if not isinstance(self.allocator, PrefixCachingBlockAllocator):
            return []
        usable = (seq.num_tokens - 1) // self.block_size
        return self.allocator.lookup(self._block_hashes(seq, usable)[:usable])

    def _reused_blocks(self, seq: CachedSequence) -> list[int]:
        """The cached blocks a sequence being admitted starts with: its first ``num_computed_tokens``."""
        num_reused, partial = divmod(seq.num_computed_tokens, self.block_size)
        reused = self._cached_blocks(seq)[:num_reused] if num_reused else []
        if partial or len(reused) != num_reused:
            raise ValueError(
                f"sequence {seq.seq_id} says {seq.num_computed_tokens} tokens are computed but holds no "
                f"KV cache; only a cached prefix of {len(reused) * self.block_size} tokens can be assumed"
            )
        return reused

    def _blocks_to_start(self, seq: CachedSequence, num_new_tokens: int, reused: list[int]) -> int:
        """Free blocks a new sequence takes: the ones it lacks, plus reused ones now in the free queue."""
        needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(reused)
        return needed + self._num_free(reused)

    def _num_free(self, block_ids: list[int]) -> int:
        return sum(1 for b in block_ids if self.allocator.is_free(b))

    def _block_hashes(self, seq: CachedSequence, num_blocks: int) -> list[bytes]:
        """``seq.block_hashes``, extended to at least ``num_blocks`` full blocks if it has them."""
        if len(seq.block_hashes) < num_blocks:
            tokens = seq.token_slice(0, num_blocks * self.block_size)
            extend_block_hashes(seq.block_hashes, tokens, self.block_size, seq.cache_salt)
        return seq.block_hashes

    def _cache_full_blocks(self, seq: CachedSequence, table: PageTable, num_tokens: int) -> None:
        allocator = self.allocator
        assert isinstance(allocator, PrefixCachingBlockAllocator)
        done, full = self._num_hashed_blocks[seq.seq_id], num_tokens // self.block_size
        if full <= done:
            return
        hashes = self._block_hashes(seq, full)
        for index in range(done, full):
            allocator.cache_block(table.block_ids[index], hashes[index])
        self._num_hashed_blocks[seq.seq_id] = full

    # -- swapping -------------------------------------------------------------------------------
    def can_swap_out(self, seq_id: int) -> bool:
        table = self._tables.get(seq_id)
        return (
            self.cpu_allocator is not None
            and table is not None
            and table.num_blocks - table.num_reserved_blocks <= self.cpu_allocator.num_free_blocks
        )

    def swap_out(self, seq_id: int) -> list[tuple[int, int]]:
        if not self.can_swap_out(seq_id):
            raise ValueError(f"sequence {seq_id} cannot be swapped out (no table or CPU space)")
        assert self.cpu_allocator is not None
        table = self._tables.pop(seq_id)
        table.truncate(table.num_tokens)  # its reserved blocks (never written) are not copied
        cpu_blocks = self.cpu_allocator.allocate_many(table.num_blocks) if table.num_blocks else []
        mapping = list(zip(table.block_ids, cpu_blocks, strict=True))
        self._swapped[seq_id] = (cpu_blocks, table.num_tokens)
        self._num_hashed_blocks[seq_id] = 0  # the blocks it comes back to are entered in the cache anew
        table.free()  # the device blocks are free once the engine has copied them (before the next write)
        return mapping

    def can_swap_in(self, seq_id: int, num_new_tokens: int = 1) -> bool:
        """Room for the sequence's blocks plus one more for its next token, and for all
        ``num_new_tokens`` it must still compute before it samples (the rest of a prefill), above the
        watermark: without that margin it would come back only to be preempted again at once."""
        if seq_id not in self._swapped:
            return False
        cpu_blocks, num_tokens = self._swapped[seq_id]
        needed = max(len(cpu_blocks) + 1, cdiv(num_tokens + num_new_tokens, self.block_size))
        return self.allocator.num_free_blocks - needed >= self.watermark_blocks

    def swap_in(self, seq_id: int) -> list[tuple[int, int]]:
        if seq_id not in self._swapped or self.cpu_allocator is None:
            raise ValueError(f"sequence {seq_id} is not swapped out")
        cpu_blocks, num_tokens = self._swapped.pop(seq_id)
        table = PageTable(self.allocator, self.block_size)
        table.append_tokens(num_tokens)
        self._tables[seq_id] = table
        for block_id in cpu_blocks:
            self.cpu_allocator.free(block_id)
        return list(zip(cpu_blocks, table.block_ids, strict=True))
