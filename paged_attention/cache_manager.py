"""The KV-cache manager: the only thing the scheduler asks about memory.

The scheduler never touches blocks. It asks a :class:`KVCacheManager` three questions, in the
same words whatever the memory layout: *may this sequence start* (``can_admit``), *make room for
``n`` more tokens of it* (``allocate_slots``, which may fail), and *it is done* (``free``). That
narrow interface is what lets the contiguous baselines of a later chapter run under the very same
scheduler, so that the experiments compare memory managers and nothing else.

:class:`PagedKVCacheManager` implements it with the block allocator and one page table per
sequence. Two details come from vLLM:

* **A watermark.** New sequences are admitted only while more than ``watermark`` (1%) of the blocks
  would stay free, so that the sequences already running can still grow by a token without being
  preempted at once by the newcomer they just let in.
* **Swapping.** Instead of discarding a preempted sequence's pages (recompute), they can be copied
  to a pool of CPU blocks and copied back later; the manager only does the bookkeeping and returns
  the ``(gpu_block, cpu_block)`` pairs the engine must copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ._checks import cdiv, check_int, check_positive_int
from .allocator import BlockAllocator
from .metrics import MemoryReport, paged_memory_report
from .page_table import BlockCopy, PageTable
from .sequence import Sequence


@dataclass(frozen=True)
class SlotAllocation:
    """Where one sequence's new tokens go this step, and block copies to perform first."""

    slot_mapping: list[int]
    copies: list[BlockCopy]


class KVCacheManager(Protocol):
    """What the scheduler may ask of KV memory (paged or contiguous alike)."""

    block_size: int

    def can_admit(self, seq: Sequence, num_new_tokens: int) -> bool:
        """May ``seq`` start now with its first ``num_new_tokens`` tokens?

        The whole sequence is passed, not just a count: a contiguous manager must know the prompt
        length and ``max_tokens`` to size its reservation, and a prefix cache looks at the tokens.
        """

    def allocate_slots(self, seq_id: int, num_new_tokens: int) -> SlotAllocation | None:
        """Room for ``num_new_tokens`` more tokens of ``seq_id``; ``None`` (no change) if memory is short."""

    def free(self, seq_id: int) -> None:
        """Release everything ``seq_id`` holds."""

    def block_table(self, seq_id: int) -> list[int]:
        """Physical blocks of ``seq_id`` in logical order (what the kernels read)."""

    def fits_at_all(self, seq: Sequence) -> bool:
        """Could ``seq`` (grown to ``seq.max_total_tokens``) ever fit, with the cache otherwise empty?"""

    def memory_report(self) -> MemoryReport: ...


class PagedKVCacheManager:
    """Paged KV memory: blocks on demand, one page table per sequence, optional CPU swap space."""

    def __init__(
        self, num_blocks: int, block_size: int, watermark: float = 0.01, num_cpu_blocks: int = 0
    ) -> None:
        check_positive_int("num_blocks", num_blocks)
        check_positive_int("block_size", block_size)
        check_int("num_cpu_blocks", num_cpu_blocks, minimum=0)
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.watermark_blocks = int(watermark * num_blocks)
        self.tables: dict[int, PageTable] = {}
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

    def can_admit(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = cdiv(num_new_tokens, self.block_size)
        return self.allocator.num_free_blocks - needed >= self.watermark_blocks

    def allocate_slots(self, seq_id: int, num_new_tokens: int) -> SlotAllocation | None:
        table = self.tables.get(seq_id)
        if table is None:
            table = self.tables[seq_id] = PageTable(self.allocator, self.block_size)
        if table.blocks_needed(num_new_tokens) > self.allocator.num_free_blocks:
            if not table.block_ids:
                del self.tables[seq_id]
            return None
        result = table.append_tokens(num_new_tokens)
        return SlotAllocation(result.slot_mapping, [result.copy] if result.copy else [])

    def free(self, seq_id: int) -> None:
        table = self.tables.pop(seq_id, None)
        if table is not None:
            table.free()
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
