"""The int8 KV cache's loops Numba compiles for the CPU (:mod:`.quantization` tells the format).

* ``store_int8(x, cache, scales, map_blocks, map_tokens)``: the int8 cache's store, block by block
  with a scale per block and KV head (the arithmetic of :func:`.quantization.store_block_scaled`,
  to the bit);
* ``decode_layer_int8(...)``: that store for a layer's keys and values, then :func:`.loop_nest.decode`
  over them, in one call.

The helpers and the decode kernel are :mod:`.loop_nest`'s: on import this file is stamped newer when
that one is (:func:`.loop_nest.stamp`), so that an edit there is compiled in.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from numba import njit

from .loop_nest import decode, stamp, widen

stamp(Path(__file__))


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def store_int8(x, cache, scales, map_blocks, map_tokens):  # pragma: no cover - compiled
    """Rows of ``x[tokens, H_kv, D]`` into an int8 ``cache`` with ``scales[num_blocks, H_kv]``,
    block by block (``map_blocks``/``map_tokens``: a :class:`.quantization.StoreMap`): one scale per
    touched block and head, from the old one and the new rows' largest ``|x|`` / 127; the rows
    already there requantized to it; writing offset 0 starts the block afresh. No fast-math: the
    roundings must be the reference's, bit for bit."""
    block_size, num_kv_heads, head_dim = cache.shape[1], cache.shape[2], cache.shape[3]
    for e in range(map_blocks.shape[0]):
        block = map_blocks[e]
        fresh = map_tokens[e, 0] >= 0
        for h in range(num_kv_heads):
            largest = np.float32(0.0)
            for r in range(block_size):
                t = map_tokens[e, r]
                if t >= 0:
                    for d in range(head_dim):
                        largest = max(largest, abs(widen(x[t, h, d])))
            old = np.float32(0.0) if fresh else scales[block, h]
            new = max(old, largest / np.float32(127.0))
            inverse = np.float32(1.0) / new if new > 0 else np.float32(0.0)
            ratio = old * inverse
            for r in range(block_size):
                t = map_tokens[e, r]
                for d in range(head_dim):
                    if t >= 0:
                        q = np.floor(widen(x[t, h, d]) * inverse + np.float32(0.5))
                        q = min(max(q, np.float32(-127.0)), np.float32(127.0))
                    else:
                        q = np.floor(np.float32(cache[block, r, h, d]) * ratio + np.float32(0.5))
                    cache[block, r, h, d] = np.int8(q)
            scales[block, h] = new


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def decode_layer_int8(
    query, key, value, caches, scales, layer, map_blocks, map_tokens, blocks, seq_lens, scale, fp8_format, out
):  # pragma: no cover - compiled
    """:func:`decode_layer` for an int8 cache: :func:`store_int8` of the keys and values, then
    :func:`decode` reading them with their per-block scales (``scales[layers, 2, num_blocks, H_kv]``)."""
    store_int8(key, caches[layer, 0], scales[layer, 0], map_blocks, map_tokens)
    store_int8(value, caches[layer, 1], scales[layer, 1], map_blocks, map_tokens)
    decode(query, caches[layer, 0], caches[layer, 1], scales[layer, 0], scales[layer, 1], fp8_format, blocks,
           seq_lens, scale, out)  # fmt: skip
