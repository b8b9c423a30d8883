"""Which attention calls take the AMX loops (:mod:`.loop_amx`), and their tile records; which take
the bfloat16 lanes (:func:`pairs`).

A call takes them when the processor has AMX and this process may use it (:func:`.amx.permitted`),
the query and the cache are bfloat16 (the tiles multiply bfloat16 only; 8-bit and float32 caches
keep :mod:`.loop_nest`), the block size is a multiple of 16 (a tile of 16 positions never crosses
a block), the head size a multiple of 32 (a key tile holds 32 dimensions) and one KV head's group
of query heads fits a tile's 16 columns.
"""

from __future__ import annotations

import functools

import numpy as np
import torch


@functools.cache  # asked once a layer of every decode step: a dictionary lookup after the first
def rows(
    dtype: torch.dtype, cache_dtype: torch.dtype, heads: int, shape: tuple[int, ...], quantized: bool = False
) -> int:
    """Query rows a tile of :func:`.loop_amx.attend` takes for a ``dtype`` query of ``heads`` heads
    and a ``cache_dtype`` cache of ``shape`` (``[..., block_size, H_kv, D]``), ``quantized``: read
    with scales; 0 where the AMX loops do not apply."""
    block_size, kv_heads, head_dim = shape[-3], shape[-2], shape[-1]
    group = heads // kv_heads
    bfloat16 = dtype == cache_dtype == torch.bfloat16
    if not bfloat16 or quantized or block_size % 16 or head_dim % 32 or group > 16:
        return 0
    from . import amx  # imported late: importing Numba costs half a second

    return 16 // group if amx.permitted() else 0


@functools.cache
def record(columns: int) -> np.ndarray:
    """The tile shapes for ``columns`` query heads a tile (:func:`.loop_amx.shapes`), made once."""
    from . import loop_amx

    return loop_amx.shapes(columns)


def attend(query, key_cache, value_cache, blocks, seq_lens, starts, seqs, scale, rows, out) -> None:
    """Causal attention of the sequences ``seqs`` (NumPy arrays as :func:`.loop_amx.attend` takes
    them): those with more new tokens than ``rows`` in tiles of ``rows`` query rows, the others in
    tiles of as many rows as the longest of them needs (decode: 1, no idle columns). A row gets
    the same bits either way."""
    from .loop_amx import attend as on_tiles

    group = query.shape[1] // key_cache.shape[2]
    counts = starts[seqs + 1] - starts[seqs]
    few = int(counts[counts <= rows].max()) if (counts <= rows).any() else 0
    for chosen, size in ((seqs[counts <= rows], few), (seqs[counts > rows], rows)):
        if len(chosen):
            on_tiles(query, key_cache, value_cache, blocks, seq_lens, starts, chosen, scale, size,
                     record(size * group), out)  # fmt: skip


def pairs(dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int, scaled: bool) -> bool:
    """Whether a decode call takes :mod:`.loop_bf16` (where :func:`rows` gives 0): a bfloat16 query
    over a bfloat16 cache read without scales, ``head_dim`` a multiple of 32."""
    return dtype == cache_dtype == torch.bfloat16 and head_dim % 32 == 0 and not scaled
