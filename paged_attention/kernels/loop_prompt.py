"""Prompts on the AMX tiles: the values of a sequence laid out for the tiles once, then every tile
of query rows multiplied against them (:mod:`.loop_amx` tells the shared story).

* ``prompt(query, key_cache, value_cache, blocks, seq_lens, starts, seqs, scale, rows, record, out)``:
  :func:`.loop_amx.attend`'s contract, for prompts (and chunks after a cached prefix) of more rows
  than one tile; ``record`` from :func:`shapes`.

The scores are :func:`.loop_amx.attend`'s: ``S^T = K . Q^T`` with the keys read from the cache as
they lie, a lane per column, and the same softmax (:func:`.loop_amx.soften`), which leaves the
weights as ``P^T``, a row of columns per position. Decode has a few columns and writes them out as
``P``'s rows; a prompt's tile has up to 16, so here the product is taken the other way round,
``O^T = V^T . P^T``: ``P^T`` goes into a ``B`` tile as it is (two positions' rows interleaved into
pairs, :func:`.lanes.store_pairs`), and each KV head's values are written transposed once per
sequence (``[dimension, position]``, an ``A`` tile of 16 dimensions and 32 positions). The
accumulator ``O^T`` has a row per dimension and a lane per column, rescaled a vector at a time. An
element of ``O`` is the same sum of the same products either way round (the tiles' dot product is
symmetric in its two operands), the rescale the same multiplication, and a tile's start and finish
are :mod:`.loop_amx`'s (:func:`.loop_amx.begin`, :func:`.loop_amx.finish`), so a row gets the same
bits here as in a decode step.

Measured (SmolLM2's heads, 16 prompts of 27-300 tokens, 2,520 in all, block size 16, one thread,
bfloat16, 2-core Xeon with AMX): 4.7-5.0 ms a layer against 8.2-8.4 for torch's SDPA over the gathered
pages (which does not compute a row alone) and 23.1 for :func:`.loop_nest.prefill`. With the softmax
a column at a time (keys transposed, ``S = Q . K^T``) it took 10.1-11.1 ms, 8 of them in the softmax;
with the scratch arrays where Numba puts them (32 bytes into a cache line) about 5% longer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from numba import njit

from . import amx, lanes
from .lanes import LANES
from .loop_amx import CHUNK, ask, begin, finish, score, soften
from .loop_nest import stamp

stamp(Path(__file__))
stamp(Path(__file__), Path(amx.__file__))  # the intrinsics are compiled into these loops too
stamp(Path(__file__), Path(lanes.__file__))  # and the vector lanes
stamp(Path(__file__), Path(__file__).with_name("loop_amx.py"))  # and soften, shared with decode

_load_weights, _load_values, _load_acc, _store_acc = amx.load(5), amx.load(6), amx.load(7), amx.store(7)
_weigh = amx.dot(7, 6, 5)


def shapes(columns: int) -> np.ndarray:
    """The tile record for ``columns`` query columns (at most 16): 0-4 as :func:`.loop_amx.shapes`
    (scores ``S^T``, keys, query pairs); 5 weights in pairs of positions ``[16, columns]``; 6 values
    transposed ``[16 dimensions, 32 positions]``; 7 accumulator ``O^T`` ``[16 dimensions, columns]``."""
    wide = 4 * columns
    return amx.config({0: (16, wide), 1: (16, 64), 2: (16, 64), 3: (16, wide), 4: (16, wide),
                       5: (16, wide), 6: (16, 64), 7: (16, wide)})  # fmt: skip


@njit(fastmath=True, cache=True, boundscheck=False, nogil=True, error_model="numpy")
def prompt(
    query, key_cache, value_cache, blocks, seq_lens, starts, seqs, scale, rows, record, out
):  # pragma: no cover - compiled
    """See the module's docstring."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    columns = rows * group
    row = num_kv_heads * head_dim
    longest = 0
    for k in range(seqs.shape[0]):
        longest = max(longest, seq_lens[seqs[k]])
    width = (longest + CHUNK - 1) // CHUNK * CHUNK  # positions, padded to whole chunks
    transposed = lanes.aligned((num_kv_heads, head_dim, width), np.uint16)  # values: [dimension, position]
    pairs = lanes.aligned((num_kv_heads, head_dim // 32, 16, columns), np.uint32)  # queries as B tiles
    scores = lanes.aligned((num_kv_heads, CHUNK, LANES), np.float32)  # S^T, a lane per column
    rounded = lanes.aligned((CHUNK, LANES), np.float32)  # the softmax's weights
    weights = lanes.aligned((CHUNK // 2, LANES), np.uint32)  # P^T in pairs of positions, a B tile
    acc = lanes.aligned((num_kv_heads, head_dim, LANES), np.float32)  # O^T
    best = lanes.aligned((num_kv_heads, LANES), np.float32)
    total = lanes.aligned((num_kv_heads, LANES), np.float32)
    limit = np.full(LANES, -1, np.int64)
    visible = lanes.aligned((LANES,), np.int32)
    amx.configure(record)
    for k in range(seqs.shape[0]):
        s = seqs[k]
        first, count, length = starts[s], starts[s + 1] - starts[s], seq_lens[s]
        context = length - count
        for t in range(length):  # the sequence's values, transposed for the tiles once
            v = value_cache[blocks[s, t // block_size], t % block_size]
            for h in range(num_kv_heads):
                for d in range(head_dim):
                    transposed[h, d, t] = v[h, d]
        for t in range(length, (length + CHUNK - 1) // CHUNK * CHUNK):
            transposed[:, :, t] = 0  # weight 0 times a finite value
        for r0 in range(0, count, rows):
            used = min(rows, count - r0)
            last = context + r0 + used - 1
            ask(query, first + r0, used, context + r0, group, pairs, limit)
            begin(acc, best, total)
            for base in range(0, last + 1, CHUNK):
                size = min(CHUNK, last + 1 - base)
                for c in range(LANES):
                    visible[c] = max(0, min(size, limit[c] + 1 - base))
                for h in range(num_kv_heads):
                    for half in range(0, size, 16):  # 1. scores S^T = K . Q^T
                        t = base + half
                        key_at = (
                            blocks[s, t // block_size] * block_size + t % block_size
                        ) * row + h * head_dim
                        score(key_cache, key_at, row, pairs[h], scores[h, half:])
                    rescale = soften(scores[h], visible, scale, best[h], total[h], rounded)  # 2.
                    for p in range(CHUNK // 2):  # 3. O^T = O^T * rescale + V^T . P^T
                        lanes.store_pairs(weights, p * LANES, lanes.load(rounded, 2 * p * LANES),
                                          lanes.load(rounded, (2 * p + 1) * LANES))  # fmt: skip
                    _load_weights(weights, 0, LANES * 4)
                    for d0 in range(0, head_dim, 16):
                        at = (h * head_dim + d0) * LANES
                        for d in range(at, at + 16 * LANES, LANES):
                            lanes.store(acc, d, lanes.load(acc, d) * rescale)
                        _load_values(transposed, (h * head_dim + d0) * width + base, width * 2)
                        _load_acc(acc, at, LANES * 4)
                        _weigh()
                        _store_acc(acc, at, LANES * 4)
            finish(acc.transpose(0, 2, 1), total, out, first + r0, used, group)
    amx.release()
