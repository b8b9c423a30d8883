"""A text picture of the paged KV cache, one character per slot, for terminals and notebooks.

    |AAAA|AAa.|BBBB|....|

Each ``|....|`` is one physical block in id order. An upper-case letter is a slot holding a token
of that sequence, a lower-case letter a slot its sequence has allocated but not yet written (the
unfilled tail of a last block), ``*`` a token slot in a block shared by several sequences, and
``.`` a slot of a free block.
"""

from __future__ import annotations

import string
from collections.abc import Sequence

from ..memory.allocator import BlockAllocator
from ..memory.page_table import PageTable, written_slots


def format_memory_map(
    allocator: BlockAllocator,
    page_tables: Sequence[PageTable],
    block_size: int,
    labels: Sequence[str] | None = None,
    blocks_per_line: int = 16,
) -> str:
    """Render every block of ``allocator`` as ``block_size`` characters (see the module docstring)."""
    labels = list(labels) if labels is not None else list(string.ascii_uppercase[: len(page_tables)])
    if len(labels) != len(page_tables) or any(len(label) != 1 for label in labels):
        raise ValueError("labels must be one single character per page table")
    cells = [["."] * block_size for _ in range(allocator.num_blocks)]
    for label, table in zip(labels, page_tables, strict=True):
        for block_id, written in table.filled_slots():
            shared = allocator.ref_count(block_id) > 1
            for slot in range(block_size):
                if slot < written:
                    cells[block_id][slot] = "*" if shared else label.upper()
                elif cells[block_id][slot] == ".":
                    cells[block_id][slot] = label.lower()
    lines = []
    for start in range(0, allocator.num_blocks, blocks_per_line):
        chunk = cells[start : start + blocks_per_line]
        lines.append(f"{start:>4} |" + "|".join("".join(c) for c in chunk) + "|")
    return "\n".join(lines)


def paged_segments(tables: Sequence[PageTable], block_size: int) -> list[tuple[int, int, str]]:
    """``(start slot, length, category)`` pieces of a paged cache, by address, for
    :func:`paged_attention.viz.memory.arena_map`: each block's written slots (``"tokens"``) and its
    unfilled tail (``"internal"``). The contiguous manager's ``segments()`` gives the same for a
    contiguous cache, so the two can be drawn on one scale."""
    filled = written_slots(tables)
    pieces = []
    for block_id in sorted(filled):
        start, written = block_id * block_size, filled[block_id]
        pieces.append((start, written, "tokens"))
        if written < block_size:
            pieces.append((start + written, block_size - written, "internal"))
    return pieces
