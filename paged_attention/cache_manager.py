"""The KV-cache manager: the only thing the scheduler asks about memory.

The scheduler never touches blocks. It asks a :class:`KVCacheManager` a few questions, in the
same words whatever the memory layout: *how much of this sequence is already cached*
(``lookup_prefix``), *may it start* (``can_admit``), *make room for ``n`` more tokens of it*
(``allocate_slots``, which may fail), and *it is done* (``free``). That narrow interface is what lets
the contiguous baselines of a later chapter run under the very same scheduler, so that the
experiments compare memory managers and nothing else. (A manager without a prefix cache answers
``lookup_prefix`` with 0, and everything else works unchanged.)

:class:`PagedKVCacheManager` implements it with the block allocator and one page table per
sequence. Four details come from vLLM:

* **A watermark.** New sequences are admitted only while more than ``watermark`` (1%) of the blocks
  would stay free, so that the sequences already running can still grow by a token without being
  preempted at once by the newcomer they just let in.
* **Swapping.** Instead of discarding a preempted sequence's pages (recompute), they can be copied
  to a pool of CPU blocks and copied back later; the manager only does the bookkeeping and returns
  the ``(gpu_block, cpu_block)`` pairs the engine must copy.
* **Forking.** ``fork`` gives a new sequence (a parallel sample, a beam) the parent's page table:
  the same physical blocks, each with one more owner. Memory is copied only when a shared, partly
  filled block is written (copy-on-write, :mod:`.page_table`).
* **Automatic prefix caching** (``enable_prefix_caching``). Every block that fills up is entered in
  the allocator's hash-to-block map (:mod:`.prefix_cache`); a sequence being admitted starts with
  the blocks of its longest cached prefix and computes only the rest. The last token is always
  computed again, even if its block is cached, because its logits choose the next token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ._checks import cdiv, check_int, check_positive_int
from .allocator import BlockAllocator
from .metrics import MemoryReport, paged_memory_report
from .page_table import BlockCopy, PageTable
from .prefix_cache import PrefixCacheStats, PrefixCachingBlockAllocator, extend_block_hashes
from .sequence import Sequence


@dataclass(frozen=True)
class SlotAllocation:
    """Where one sequence's new tokens go this step, and block copies to perform first."""

    slot_mapping: list[int]
    copies: list[BlockCopy]


class KVCacheManager(Protocol):
    """What the scheduler may ask of KV memory (paged or contiguous alike)."""

    block_size: int

    def lookup_prefix(self, seq: Sequence) -> int:
        """How many leading tokens of ``seq`` the cache already holds (changes nothing).

        A multiple of ``block_size``, and always less than ``seq.num_tokens``: the last token must
        be computed to give logits. 0 for a manager without a prefix cache.
        """

    def can_admit(self, seq: Sequence, num_new_tokens: int) -> bool:
        """May ``seq`` start now with ``num_new_tokens`` tokens after its first ``seq.num_computed_tokens``?

        The whole sequence is passed, not just a count: a contiguous manager must know the prompt
        length and ``max_tokens`` to size its reservation, and a prefix cache looks at the tokens.
        """

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> SlotAllocation | None:
        """Room for tokens ``seq.num_computed_tokens ..`` ``+ num_new_tokens - 1``; ``None`` (no change) if
        memory is short. For a sequence that holds no memory yet, its first ``num_computed_tokens``
        tokens must be the cached prefix that ``lookup_prefix`` reported."""

    def free(self, seq_id: int) -> None:
        """Release everything ``seq_id`` holds."""

    def block_table(self, seq_id: int) -> list[int]:
        """Physical blocks of ``seq_id`` in logical order (what the kernels read)."""

    def fits_at_all(self, seq: Sequence) -> bool:
        """Could ``seq`` (grown to ``seq.max_total_tokens``) ever fit, with the cache otherwise empty?"""

    def memory_report(self) -> MemoryReport: ...


class PagedKVCacheManager:
    """Paged KV memory: blocks on demand, one page table per sequence, forks, prefix caching, CPU swap.

    ``enable_prefix_caching`` is off here and on in :class:`~paged_attention.engine.LLMEngine` (as in
    vLLM v1): trace replays feed placeholder tokens, which a prefix cache would take for one shared
    prompt, and they measure memory, not caching.
    """

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
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be a bool, got {enable_prefix_caching!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.allocator = (
            PrefixCachingBlockAllocator(num_blocks) if enable_prefix_caching else BlockAllocator(num_blocks)
        )
        self.watermark_blocks = int(watermark * num_blocks)
        self.tables: dict[int, PageTable] = {}
        self.num_hashed_blocks: dict[int, int] = {}  # leading blocks of each table already in the cache
        self.prefix_cache_stats = PrefixCacheStats()
        self.cpu_allocator = BlockAllocator(num_cpu_blocks) if num_cpu_blocks else None
        self.swapped: dict[int, tuple[list[int], int]] = {}  # seq_id -> (cpu blocks, num_tokens)

    # -- the protocol ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def fits_at_all(self, seq: Sequence) -> bool:
        # Admission keeps the watermark free, so a request must fit beside it, or it would be
        # accepted and then wait forever (holding up everyone queued behind it).
        needed = cdiv(seq.max_total_tokens, self.block_size)
        return needed <= self.allocator.num_blocks - self.watermark_blocks

    def lookup_prefix(self, seq: Sequence) -> int:
        return len(self._cached_prefix(seq)) * self.block_size

    def can_admit(self, seq: Sequence, num_new_tokens: int) -> bool:
        hits = self._hits_for(seq)
        needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(hits)
        needed += sum(1 for b in hits if self.allocator.is_free(b))  # they leave the free queue
        return self.allocator.num_free_blocks - needed >= self.watermark_blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> SlotAllocation | None:
        table = self.tables.get(seq.seq_id)
        if table is None:
            hits = self._hits_for(seq)
            needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(hits)
            needed += sum(1 for b in hits if self.allocator.is_free(b))
            if needed > self.allocator.num_free_blocks:
                return None
            table = self.tables[seq.seq_id] = PageTable(self.allocator, self.block_size)
            table.append_cached_blocks(hits)
            self.num_hashed_blocks[seq.seq_id] = len(hits)
            if self.enable_prefix_caching:
                preempted = seq.num_preemptions > 0
                self.prefix_cache_stats.record(seq.num_tokens, len(hits) * self.block_size, preempted)
        elif table.num_tokens != seq.num_computed_tokens:
            raise ValueError(
                f"sequence {seq.seq_id} holds {table.num_tokens} tokens of KV cache "
                f"but says {seq.num_computed_tokens} are computed"
            )
        elif table.blocks_needed(num_new_tokens) > self.allocator.num_free_blocks:
            return None
        result = table.append_tokens(num_new_tokens)
        if self.enable_prefix_caching:
            # Enter the blocks this step fills: the step computes them before any later step can read
            # them, and a sequence scheduled behind this one in the same step reads them after they
            # are stored (every layer stores the whole batch's K/V before attending).
            self._cache_full_blocks(seq, table, seq.num_computed_tokens + num_new_tokens)
        return SlotAllocation(result.slot_mapping, [result.copy] if result.copy else [])

    def free(self, seq_id: int) -> None:
        table = self.tables.pop(seq_id, None)
        if table is not None:
            table.free()  # cached blocks keep their hashes in the free queue until evicted
        self.num_hashed_blocks.pop(seq_id, None)
        swapped = self.swapped.pop(seq_id, None)
        if swapped is not None and self.cpu_allocator is not None:
            for block_id in swapped[0]:
                self.cpu_allocator.free(block_id)

    def block_table(self, seq_id: int) -> list[int]:
        return self.tables[seq_id].block_ids

    def memory_report(self) -> MemoryReport:
        return paged_memory_report(list(self.tables.values()), self.allocator, self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def usage(self) -> float:
        return self.allocator.usage

    # -- sharing --------------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` (the parent's tokens, nothing of its own yet) the parent's blocks to share."""
        table = self.tables.get(parent.seq_id)
        if table is None:
            raise ValueError(f"fork: sequence {parent.seq_id} holds no KV cache to share")
        if child.seq_id in self.tables or child.seq_id in self.swapped:
            raise ValueError(f"fork: sequence {child.seq_id} already holds KV cache")
        if child.num_computed_tokens != table.num_tokens or child.num_tokens != parent.num_tokens:
            raise ValueError(
                f"fork: the child must start as a copy of the parent ({parent.num_tokens} tokens, "
                f"{table.num_tokens} computed), got {child.num_tokens} tokens, "
                f"{child.num_computed_tokens} computed"
            )
        self.tables[child.seq_id] = table.fork()
        self.num_hashed_blocks[child.seq_id] = self.num_hashed_blocks[parent.seq_id]
        child.block_hashes = list(parent.block_hashes)

    def reset_prefix_cache(self) -> int:
        """Forget the cached contents of every free block (vLLM's ``reset_prefix_cache``)."""
        return self.allocator.reset() if isinstance(self.allocator, PrefixCachingBlockAllocator) else 0

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks of the longest cached prefix of ``seq``, never including its last token."""
        if not isinstance(self.allocator, PrefixCachingBlockAllocator):
            return []
        usable = (seq.num_tokens - 1) // self.block_size
        return self.allocator.lookup(self._block_hashes(seq, usable)[:usable])

    def _hits_for(self, seq: Sequence) -> list[int]:
        """The cached blocks a sequence being admitted starts with: its first ``num_computed_tokens``."""
        num_hits, partial = divmod(seq.num_computed_tokens, self.block_size)
        hits = self._cached_prefix(seq)[:num_hits] if num_hits else []
        if partial or len(hits) != num_hits:
            raise ValueError(
                f"sequence {seq.seq_id} says {seq.num_computed_tokens} tokens are computed but holds no "
                f"KV cache; only a cached prefix of {len(hits) * self.block_size} tokens can be assumed"
            )
        return hits

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """``seq.block_hashes``, extended to at least ``num_blocks`` full blocks if it has them."""
        if len(seq.block_hashes) < num_blocks:
            tokens = seq.token_slice(0, num_blocks * self.block_size)
            extend_block_hashes(seq.block_hashes, tokens, self.block_size, seq.cache_salt)
        return seq.block_hashes

    def _cache_full_blocks(self, seq: Sequence, table: PageTable, num_tokens: int) -> None:
        allocator = self.allocator
        assert isinstance(allocator, PrefixCachingBlockAllocator)
        done, full = self.num_hashed_blocks[seq.seq_id], num_tokens // self.block_size
        if full <= done:
            return
        hashes = self._block_hashes(seq, full)
        for index in range(done, full):
            allocator.cache_block(table.block_ids[index], hashes[index])
        self.num_hashed_blocks[seq.seq_id] = full

    # -- swapping -------------------------------------------------------------------------------
    def can_swap_out(self, seq_id: int) -> bool:
        table = self.tables.get(seq_id)
        return (
            self.cpu_allocator is not None
            and table is not None
            and table.num_blocks <= self.cpu_allocator.num_free_blocks
        )

    def swap_out(self, seq_id: int) -> list[tuple[int, int]]:
        """Move ``seq_id``'s pages to CPU blocks; returns the ``(gpu_block, cpu_block)`` copies to do."""
        if not self.can_swap_out(seq_id):
            raise ValueError(f"sequence {seq_id} cannot be swapped out (no table or CPU space)")
        assert self.cpu_allocator is not None
        table = self.tables.pop(seq_id)
        cpu_blocks = self.cpu_allocator.allocate_many(table.num_blocks) if table.num_blocks else []
        mapping = list(zip(table.block_ids, cpu_blocks, strict=True))
        self.swapped[seq_id] = (cpu_blocks, table.num_tokens)
        self.num_hashed_blocks[seq_id] = 0  # the blocks it comes back to are entered in the cache anew
        table.free()  # the GPU blocks are free once the engine has copied them (before the next write)
        return mapping

    def can_swap_in(self, seq_id: int) -> bool:
        """Room for the sequence's blocks plus one more for its next token, above the watermark
        (without that margin it would come back only to be preempted again at once)."""
        cpu_blocks, _ = self.swapped[seq_id]
        return self.allocator.num_free_blocks - len(cpu_blocks) - 1 >= self.watermark_blocks

    def swap_in(self, seq_id: int) -> list[tuple[int, int]]:
        """Bring ``seq_id``'s pages back; returns the ``(cpu_block, gpu_block)`` copies to do."""
        assert self.cpu_allocator is not None
        cpu_blocks, num_tokens = self.swapped.pop(seq_id)
        table = PageTable(self.allocator, self.block_size)
        table.append_tokens(num_tokens)
        self.tables[seq_id] = table
        for block_id in cpu_blocks:
            self.cpu_allocator.free(block_id)
        return list(zip(cpu_blocks, table.block_ids, strict=True))
