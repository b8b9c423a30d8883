"""One sequence's page table: its logical blocks mapped to physical blocks (vLLM's "block table").

A sequence sees its KV cache as one contiguous array of token positions ``0, 1, 2, ...``. The page
table cuts that array into *logical blocks* of ``block_size`` positions and records, for each, the
*physical block* the allocator gave it. Position ``p`` therefore lives at

    block = block_ids[p // block_size],   offset = p % block_size,   slot = block * block_size + offset

and the *slot* is the row of the flattened ``[num_blocks * block_size, ...]`` cache that the store
kernel writes and the attention kernel reads. Physical blocks need not be adjacent or in order:
that freedom is the whole point, since a sequence never reserves memory for tokens it has not
produced, and at most ``block_size - 1`` slots (the unfilled tail of its last block) sit idle.

One exception, on purpose: a prompt computed in chunks over several steps may :meth:`~PageTable.reserve`
the blocks of its remaining chunks when it is admitted (vLLM v0 allocates a whole prompt's blocks at
admission), so that the sequences decoding beside it cannot take them and make it, the latest
arrival, preempt itself before it has produced a token. Those blocks follow the written ones in
``block_ids`` and fill first.

Forking (parallel sampling, beam search) copies the *table*, not the memory: the child points at
the parent's blocks and each block's reference count goes up. The one block that may still be
written, a partly filled last block, must be copied before either owner writes into it
(*copy-on-write*): :meth:`PageTable.append_tokens` does so and returns the copy that the KV cache
must perform (:meth:`paged_attention.engine.worker.kv_cache.KVCache.copy_blocks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .._checks import cdiv, check_int, check_positive_int
from .allocator import BlockAllocator, NoFreeBlocksError


@dataclass(frozen=True)
class BlockCopy:
    """A pending copy-on-write: copy every layer's K/V of physical block ``src`` into ``dst``."""

    src: int
    dst: int


@dataclass(frozen=True)
class AppendResult:
    """What :meth:`PageTable.append_tokens` returns: where the new tokens go, and a copy to do first."""

    slot_mapping: list[int]
    copy: BlockCopy | None = None


class PageTable:
    """Logical-to-physical block map of one sequence, backed by a shared :class:`BlockAllocator`."""

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        if not isinstance(allocator, BlockAllocator):
            raise TypeError(f"allocator must be a BlockAllocator, got {type(allocator).__name__}")
        check_positive_int("block_size", block_size)
        self.allocator = allocator
        self.block_size = block_size
        self.block_ids: list[int] = []
        self.num_tokens = 0

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def capacity(self) -> int:
        """Token slots in the blocks held: ``num_tokens`` of them written, the rest the unfilled tail."""
        return len(self.block_ids) * self.block_size

    @property
    def num_unfilled_slots(self) -> int:
        """Slots held but not written yet: the tail of the last written block (internal
        fragmentation, at most block_size-1), plus any :meth:`reserve`\\ d blocks."""
        return self.capacity - self.num_tokens

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks held past the last written one (:meth:`reserve`)."""
        return len(self.block_ids) - cdiv(self.num_tokens, self.block_size)

    def filled_slots(self) -> list[tuple[int, int]]:
        """``(block_id, tokens written in it)`` for each block, in logical order: every block is
        full but the last written one, which holds the rest (reserved blocks hold 0)."""
        bs = self.block_size
        return [(b, max(0, min(bs, self.num_tokens - i * bs))) for i, b in enumerate(self.block_ids)]

    def slot(self, position: int) -> int:
        """The cache slot of token ``position`` (0-based, must already be appended)."""
        check_int("position", position, minimum=0)
        if position >= self.num_tokens:
            raise ValueError(f"position must be < num_tokens={self.num_tokens}, got {position}")
        return self.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def needs_copy_on_write(self) -> bool:
        """True when the next token would land in a partly filled block that another table shares."""
        if self.num_tokens % self.block_size == 0:
            return False
        return self.allocator.blocks[self.block_ids[self.num_tokens // self.block_size]].ref_cnt > 1

    def blocks_needed(self, num_new_tokens: int) -> int:
        """Fresh blocks that appending ``num_new_tokens`` would take from the allocator."""
        check_int("num_new_tokens", num_new_tokens, minimum=0)
        if num_new_tokens == 0:
            return 0
        new_blocks = cdiv(self.num_tokens + num_new_tokens, self.block_size) - len(self.block_ids)
        return max(0, new_blocks) + int(self.needs_copy_on_write())

    # -- operations ------------------------------------------------------------------------------
    def append_tokens(self, num_new_tokens: int) -> AppendResult:
        """Make room for ``num_new_tokens`` more tokens and return their slots.

        A new block is taken exactly when the last one is full (reserved blocks fill first). If
        the last written block is shared and
        partly filled, it is first replaced by a private copy and the returned ``copy`` says which
        physical block to copy into which. All or nothing: if the allocator cannot provide every
        block needed, :class:`NoFreeBlocksError` is raised and the table is unchanged.
        """
        bs, ids = self.block_size, self.block_ids
        start = self.num_tokens
        if num_new_tokens == 1 and start % bs and self.allocator.blocks[ids[start // bs]].ref_cnt == 1:
            # The decode fast path: one token into a private, partly filled last block.
            self.num_tokens = start + 1
            return AppendResult([ids[start // bs] * bs + start % bs], None)
        needed = self.blocks_needed(num_new_tokens)
        if num_new_tokens == 0:
            return AppendResult([], None)
        if needed > self.allocator.num_free_blocks:
            raise NoFreeBlocksError(needed, self.allocator.num_free_blocks)
        copy = self._copy_on_write() if self.needs_copy_on_write() else None
        while len(self.block_ids) * self.block_size < self.num_tokens + num_new_tokens:
            self.block_ids.append(self.allocator.allocate())
        self.num_tokens += num_new_tokens
        slots = [ids[p // bs] * bs + p % bs for p in range(start, self.num_tokens)]
        return AppendResult(slots, copy)

    def reserve(self, num_new_tokens: int) -> int:
        """Take now the blocks that ``num_new_tokens`` more tokens will need, without writing any:
        later appends fill them first. Returns the blocks taken. All or nothing, like
        :meth:`append_tokens` (:class:`NoFreeBlocksError`, the table unchanged); a shared, partly
        filled last block is not copied here (the append that writes into it copies it)."""
        check_int("num_new_tokens", num_new_tokens, minimum=0)
        needed = max(0, cdiv(self.num_tokens + num_new_tokens, self.block_size) - len(self.block_ids))
        if needed > self.allocator.num_free_blocks:
            raise NoFreeBlocksError(needed, self.allocator.num_free_blocks)
        self.block_ids.extend(self.allocator.allocate() for _ in range(needed))
        return needed

    def truncate(self, num_tokens: int) -> list[int]:
        """Forget the tokens from position ``num_tokens`` on (drafted tokens the target model
        rejected, in speculative decoding): the blocks that held only those go back to the
        allocator at once (this table's reference dropped), and the last block kept keeps its
        slots past ``num_tokens``, to be overwritten by the next write. Returns the blocks dropped.
        The list of block ids is replaced, not cut, so a :meth:`snapshot` taken before still
        restores it."""
        check_int("num_tokens", num_tokens, minimum=0)
        if num_tokens > self.num_tokens:
            raise ValueError(
                f"num_tokens must be at most the {self.num_tokens} tokens held, got {num_tokens}"
            )
        keep = cdiv(num_tokens, self.block_size)  # (reserved blocks past them go too)
        dropped = self.block_ids[keep:]
        for block_id in reversed(dropped):
            self.allocator.free(block_id)
        self.block_ids = self.block_ids[:keep]
        self.num_tokens = num_tokens
        return dropped

    def append_cached_blocks(self, block_ids: Sequence[int]) -> None:
        """Take full blocks whose K/V are already computed (prefix-cache hits) as the next blocks.

        Each block gains this table as an owner through ``allocator.touch``: a block still in use
        elsewhere is simply shared, a freed one is pulled back out of the free queue. The table must
        end on a block boundary, since the blocks arrive full.
        """
        if self.num_tokens % self.block_size:
            raise ValueError(
                f"cached blocks can only follow full blocks; this table holds {self.num_tokens} tokens "
                f"(block_size={self.block_size})"
            )
        for block_id in block_ids:
            self.allocator.touch(block_id)
            self.block_ids.append(block_id)
        self.num_tokens += len(block_ids) * self.block_size

    def _copy_on_write(self) -> BlockCopy:
        tail = self.num_tokens // self.block_size
        shared = self.block_ids[tail]
        private = self.allocator.allocate()
        self.allocator.free(shared)  # drop our reference; the other owners keep theirs
        self.block_ids[tail] = private
        return BlockCopy(src=shared, dst=private)

    def fork(self) -> PageTable:
        """A child table pointing at the same written blocks (each block's ref count + 1); the
        parent's reserved blocks, if any, stay the parent's."""
        child = PageTable(self.allocator, self.block_size)
        written = self.block_ids[: cdiv(self.num_tokens, self.block_size)]
        for block_id in written:
            self.allocator.share(block_id)
        child.block_ids = list(written)
        child.num_tokens = self.num_tokens
        return child

    def snapshot(self) -> tuple[list[int], int, int, list[int], int]:
        """What :meth:`restore` needs to undo a step: the list of block ids (appended to, an entry
        from the last written block on replaced by copy-on-write, or swapped for a new list by
        :meth:`free` and :meth:`truncate`: never changed otherwise), its length, its entries from
        the last written block on (one, plus any reserved: O(1) but for a prompt's reservation), and
        the token count."""
        ids, tail = self.block_ids, self.num_tokens // self.block_size
        return ids, len(ids), tail, ids[tail:], self.num_tokens

    def restore(self, state: tuple[list[int], int, int, list[int], int]) -> None:
        """Put the table back as :meth:`snapshot` saw it (the allocator is restored on its own)."""
        ids, length, tail, entries, self.num_tokens = state
        del ids[length:]
        ids[tail:] = entries
        self.block_ids = ids

    def free(self) -> None:
        """Give every block back (drop this table's references) and become empty."""
        for block_id in reversed(self.block_ids):  # tail first: the prefix is the likelier cache hit
            self.allocator.free(block_id)
        self.block_ids = []
        self.num_tokens = 0

    def __repr__(self) -> str:
        return f"PageTable(num_tokens={self.num_tokens}, block_ids={self.block_ids})"


def written_slots(page_tables: Sequence[PageTable]) -> dict[int, int]:
    """Block id -> slots written in it, over tables that may share blocks. A shared block's count is
    the most any owner wrote: owners agree, since copy-on-write runs before a shared block is written."""
    written: dict[int, int] = {}
    for table in page_tables:
        for block_id, count in table.filled_slots():
            written[block_id] = max(written.get(block_id, 0), count)
    return written
