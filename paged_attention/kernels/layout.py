"""From page tables to the tensors the kernels read: padded ``block_tables``, CSR pages, ``slot_mapping``.

The bookkeeping (:mod:`paged_attention.memory.page_table`) keeps plain Python lists; the kernels
read int32/int64 tensors. These helpers are the one place where the first become the second, for
the model runner and for the notebooks alike. A *table* here is anything with ``block_ids``,
``num_tokens`` and ``block_size`` (a :class:`~paged_attention.memory.page_table.PageTable` is one):
kernels know tensors, not the allocator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class Table(Protocol):
    """What the layout helpers read of a page table."""

    block_ids: list[int]
    num_tokens: int
    block_size: int


def pad_block_ids(
    block_ids: Sequence[Sequence[int]], *, max_blocks: int | None = None, pad_value: int = 0,
    device: torch.device | str = "cpu",
) -> torch.Tensor:  # fmt: skip
    """``block_tables`` int32 ``[num_seqs, max_blocks]``: row ``i`` holds sequence ``i``'s physical
    blocks, then ``pad_value`` (0, as in vLLM), which the kernels never read (they stop at
    ``cdiv(seq_len, block_size)``)."""
    widest = max((len(ids) for ids in block_ids), default=0)
    if max_blocks is None:
        max_blocks = max(widest, 1)
    elif max_blocks < widest:
        raise ValueError(f"max_blocks must be >= the longest table's {widest} blocks, got {max_blocks}")
    padded = [list(ids) + [pad_value] * (max_blocks - len(ids)) for ids in block_ids]
    return torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(block_ids), max_blocks)


def build_block_tables(
    page_tables: Sequence[Table], *, max_blocks: int | None = None, pad_value: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad the tables into ``block_tables`` int32 ``[num_seqs, max_blocks]`` and ``seq_lens`` int32.

    Row ``i`` holds sequence ``i``'s physical block ids; entries past ``cdiv(seq_len, block_size)``
    are padding (``pad_value``, 0 as in vLLM) that the kernels never read.
    """
    block_tables = pad_block_ids([t.block_ids for t in page_tables], max_blocks=max_blocks,
                                 pad_value=pad_value)  # fmt: skip
    seq_lens = torch.tensor([t.num_tokens for t in page_tables], dtype=torch.int32)
    return block_tables, seq_lens


@dataclass(frozen=True)
class CSRPageLayout:
    """FlashInfer's ragged view of many page tables, with no padding at all.

    ``indices[indptr[i]:indptr[i+1]]`` are sequence ``i``'s pages in order, and
    ``last_page_len[i]`` says how many slots of its last page hold tokens (1..page_size, or 0 for
    an empty sequence). It is the CSR (compressed sparse row) encoding of the padded table.
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor


def build_csr_layout(page_tables: Sequence[Table]) -> CSRPageLayout:
    """The tables as FlashInfer's ``(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)``."""
    counts = [len(t.block_ids) for t in page_tables]
    indptr = torch.zeros(len(page_tables) + 1, dtype=torch.int32)
    if counts:
        indptr[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int32), 0)
    indices = torch.tensor([b for t in page_tables for b in t.block_ids], dtype=torch.int32)
    last = [
        t.num_tokens - (n - 1) * t.block_size if n else 0 for t, n in zip(page_tables, counts, strict=True)
    ]
    return CSRPageLayout(indptr, indices, torch.tensor(last, dtype=torch.int32))


def build_slot_mapping(results: Sequence[object]) -> torch.Tensor:
    """Concatenate per-sequence slots (lists, or objects with a ``slot_mapping`` list such as
    ``PageTable.append_tokens``'s result) into the int64 ``slot_mapping`` of one step."""
    slots: list[int] = []
    for r in results:
        slots.extend(getattr(r, "slot_mapping", r))  # type: ignore[arg-type]
    return torch.tensor(slots, dtype=torch.int64)
