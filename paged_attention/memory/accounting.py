"""Memory accounting: where every slot of the KV cache is, at any moment.

The PagedAttention paper (Kwon et al., 2023, Figure 2) sorts KV-cache memory into:

* **token states**: slots holding the key/value of a token that exists;
* **reserved**: slots set aside for tokens a request *will* produce (a contiguous system reserves
  them at admission, to its maximum length; paging reserves only the blocks of a prompt being
  computed in chunks, from its admission until its last chunk);
* **internal fragmentation**: slots reserved for tokens that will *never* come (a request reserved
  2048 slots and finished after 300 tokens), and in a paged cache the unfilled tail of last blocks;
* **external fragmentation**: free slots that no waiting request can use (gaps between contiguous
  reservations; paging has none, since any free block serves any sequence);
* **free**.

:func:`paged_memory_report` measures a paged cache from its page tables. Shared blocks are counted
once: two sequences forked from one prompt hold those prompt tokens in one place. How much sharing
saves is reported beside the categories: ``saved_blocks`` is how many more blocks the same page
tables would need if every owner had its own copy (the PagedAttention paper's §6.3 measure).
:func:`max_reservation_breakdown` measures the contiguous reserve-the-maximum way, per request.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

from .._checks import check_int, check_positive_int
from .allocator import BlockAllocator
from .page_table import PageTable, written_slots


@dataclass(frozen=True)
class MemoryReport:
    """Slot counts of one KV cache at one moment; every slot is in exactly one category."""

    total_slots: int
    token_slots: int
    reserved_slots: int = 0
    internal_fragmentation_slots: int = 0
    external_fragmentation_slots: int = 0
    free_slots: int = 0
    shared_blocks: int = 0  # physical blocks with more than one owner
    saved_blocks: int = 0  # blocks sharing saves: sum over shared blocks of (owners - 1)

    def __post_init__(self) -> None:
        if self.total_slots < 1:
            raise ValueError(f"total_slots must be positive, got {self.total_slots}")
        for name in ("token_slots", "reserved_slots", "internal_fragmentation_slots",
                     "external_fragmentation_slots", "free_slots",
                     "shared_blocks", "saved_blocks"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        parts = (
            self.token_slots
            + self.reserved_slots
            + self.internal_fragmentation_slots
            + self.external_fragmentation_slots
            + self.free_slots
        )
        if parts != self.total_slots:
            raise ValueError(f"categories add up to {parts} slots, not total_slots={self.total_slots}")

    @property
    def used_slots(self) -> int:
        """Slots that are not free: everything handed to requests, written or not."""
        return self.total_slots - self.free_slots - self.external_fragmentation_slots

    def fractions(self) -> dict[str, float]:
        """Each category as a fraction of all slots."""
        t = self.total_slots
        return {
            "token_states": self.token_slots / t,
            "reserved": self.reserved_slots / t,
            "internal_fragmentation": self.internal_fragmentation_slots / t,
            "external_fragmentation": self.external_fragmentation_slots / t,
            "free": self.free_slots / t,
        }

    @property
    def token_fraction_of_used(self) -> float:
        """Share of the handed-out memory (``used_slots``) that holds token states."""
        return self.token_slots / self.used_slots if self.used_slots else 1.0

    def sharing_saving(self, block_size: int) -> float:
        """Fraction of the blocks needed without sharing that sharing saves (0.0 when nothing is shared)."""
        check_positive_int("block_size", block_size)
        used_blocks = self.used_slots // block_size
        unshared = used_blocks + self.saved_blocks
        return self.saved_blocks / unshared if unshared else 0.0

    def __str__(self) -> str:
        rows = [f"{name:>24}: {frac:6.1%}" for name, frac in self.fractions().items()]
        saved = f", {self.saved_blocks} blocks saved by sharing" if self.saved_blocks else ""
        head = f"MemoryReport({self.total_slots} slots, {self.shared_blocks} shared blocks{saved})"
        return "\n".join([head, *rows])


def paged_memory_report(
    page_tables: Sequence[PageTable], allocator: BlockAllocator, block_size: int
) -> MemoryReport:
    """Account for every slot of a paged cache, counting each physical block once.

    A block's written slots are the most any owner has written into it (owners of a shared block
    agree, because copy-on-write runs before anyone writes into a shared block). Blocks a table
    holds past its last written one (:meth:`PageTable.reserve`) are reserved; the rest of an
    allocated block is internal fragmentation; blocks in the free queue are free.
    """
    check_positive_int("block_size", block_size)
    for table in page_tables:
        if table.allocator is not allocator:
            raise ValueError("every page table must draw from the allocator passed in")
        if table.block_size != block_size:
            raise ValueError(f"every page table must have block_size={block_size}, got {table.block_size}")
    # Counted in C (this runs every few steps of long simulations): how many tables hold each block.
    holders = Counter(chain.from_iterable(table.block_ids for table in page_tables))
    blocks = allocator.blocks
    counts = [blocks[b].ref_cnt for b in holders]
    if allocator.num_used_blocks != len(holders) or counts != list(holders.values()):
        raise ValueError(
            "the page tables given do not account for every block in use (pass all of them): "
            "each block's ref count must equal the number of tables holding it"
        )
    total = allocator.num_blocks * block_size
    if len(holders) == sum(holders.values()):  # nothing shared: each table's tokens fill its own blocks
        tokens = sum(table.num_tokens for table in page_tables)
    else:
        tokens = sum(written_slots(page_tables).values())
    allocated = allocator.num_used_blocks * block_size
    reserved = sum(table.num_reserved_blocks for table in page_tables) * block_size
    return MemoryReport(
        total_slots=total,
        token_slots=tokens,
        reserved_slots=reserved,
        internal_fragmentation_slots=allocated - tokens - reserved,
        free_slots=total - allocated,
        shared_blocks=sum(1 for n in holders.values() if n > 1),
        saved_blocks=sum(n - 1 for n in holders.values()),
    )


@dataclass(frozen=True)
class ReservationRow:
    """One request under max-length reservation, at one moment."""

    tokens: int  # slots holding prompt and generated tokens so far
    future: int  # slots reserved for tokens it will still generate
    wasted: int  # slots reserved for tokens it will never generate (internal fragmentation)


def max_reservation_breakdown(
    prompt_lens: Sequence[int], output_lens: Sequence[int], steps_done: Sequence[int], max_len: int
) -> list[ReservationRow]:
    """Split each request's ``max_len``-slot reservation into tokens, future tokens and waste.

    Request ``i`` has ``prompt_lens[i]`` prompt tokens, will generate ``output_lens[i]`` tokens in
    all and has generated ``steps_done[i]`` of them so far (capped at its output length).
    """
    check_positive_int("max_len", max_len)
    rows = []
    if not len(prompt_lens) == len(output_lens) == len(steps_done):
        raise ValueError("prompt_lens, output_lens and steps_done must have the same length")
    for p, o, s in zip(prompt_lens, output_lens, steps_done, strict=True):
        check_int("prompt_len", p, minimum=1)
        check_int("output_len", o, minimum=1)
        check_int("steps_done", s, minimum=0)
        if p + o > max_len:
            raise ValueError(f"prompt_len + output_len = {p + o} exceeds max_len={max_len}")
        done = min(s, o)
        rows.append(ReservationRow(tokens=p + done, future=o - done, wasted=max_len - p - o))
    return rows
