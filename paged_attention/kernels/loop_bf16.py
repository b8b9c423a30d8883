"""Decode attention over a bfloat16 cache in vector lanes: the loop nest's decode, for the vector unit.

:func:`.loop_nest.decode` leaves vectorizing to LLVM, which vectorizes each dot product of a query
head with a key row over ``head_dim`` and then folds its 16 lanes, widening the row to float32 again
for every query head of the GQA group; and it adds each value row into a ``[heads, head_dim]``
accumulator in memory, every vector loaded and stored again for every position. Written with
:mod:`.lanes` instead, for a bfloat16 cache whose ``head_dim`` is a multiple of 32:

* a key row is read as bits, 32 values a vector, and multiplied with the query's bits pair by pair
  (:func:`.lanes.dot`: one ``vdpbf16ps`` where the CPU has AVX512-BF16), each query head of the
  group from the same loaded row; the score is the lanes' total times ``scale``;
* the values are swept per query head and 32 dimensions, over the block's positions, with the
  accumulator in registers (16 odd and 16 even dimensions, :func:`.lanes.odd`, :func:`.lanes.even`;
  even and odd positions in two sums, added at the block's end; put back in order at the output);
* the next block's keys and values are asked for while this block's are read, into the L2 cache,
  whose queue of lines in flight is deeper than the L1's (:data:`.lanes.prefetch_l2`).

On this project's 2-core AMD EPYC (one thread, SmolLM2's shapes: 9 query heads over 3 KV heads of
64, 64 sequences of 210 positions, block size 16) a decode step's attention over 30 layers of cache
in DRAM took 28 ms against the loop nest's 42 (asked for into the L1 instead: 44; the same layer's
cache 30 times over, in the L3: 22 against 34). The contract is :func:`.reference.paged_decode`'s;
every sum is in float32, in another order than the loop nest's (the query is multiplied by
``scale`` after its dot products, not before), so the results are within a rounding of its, not its
bits. Where it applies (:func:`.tiles.pairs`, and no AMX tiles, :func:`.tiles.rows`) it is the
decode kernel for every query length (:func:`.compiled.paged_decode`, :mod:`.per_layer`, and drafts
being verified, which are decoded), so a token keeps its bits however many are decoded beside it.

``decode(query, key_cache, value_cache, blocks, seq_lens, scale, out)``: arrays as
:func:`.loop_nest.decode`'s (bfloat16 as ``uint16`` bits; caches contiguous, no scales).
``decode_layer(query, key, value, caches, layer, slots, blocks, seq_lens, scale, out)``:
:func:`.loop_nest.store` then :func:`decode` for one layer, as :func:`.loop_nest.decode_layer`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from numba import njit

from . import lanes
from .lanes import prefetch_l2
from .loop_nest import following, online_softmax, rounded, stamp, store

stamp(Path(__file__))
stamp(Path(__file__), Path(lanes.__file__))  # the vector lanes are compiled into these loops too

#: ``head_dim`` must be a multiple of this (one vector of bfloat16 pairs).
PAIRS = 32


@njit(fastmath=True, cache=True, boundscheck=False, nogil=True, error_model="numpy")
def decode(query, key_cache, value_cache, blocks, seq_lens, scale, out):  # pragma: no cover - compiled
    """Each sequence's blocks in order, each block swept twice (keys, then values) with an online
    softmax per query head between the sweeps, as :func:`.loop_nest.decode`; while a block's keys
    are read the next block's keys are asked for, and while its values are, the next block's values."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    chunks = head_dim // PAIRS
    row = num_kv_heads * head_dim  # elements in one token's keys (or values), all KV heads
    keys, values = key_cache.reshape(-1), value_cache.reshape(-1)
    bits = lanes.aligned((num_heads, head_dim), np.uint16)  # this sequence's query
    acc = lanes.aligned((num_heads, head_dim), np.float32)  # per 32 dimensions: 16 odd, 16 even
    scores = np.empty((num_heads, block_size), np.float32)  # one block's, then its softmax weights
    best = np.empty(num_heads, np.float32)  # running maximum score per query head
    total = np.empty(num_heads, np.float32)  # running sum of exp(score - best)
    for s in range(num_seqs):
        n = seq_lens[s]
        num_blocks = (n + block_size - 1) // block_size
        bits[:, :] = query[s]
        acc[:, :] = 0.0
        best[:] = np.float32(-1e30)  # finite: fast-math assumes no infinities
        total[:] = 0.0
        for j in range(num_blocks):
            block = blocks[s, j]
            count = min(block_size, n - j * block_size)  # the last block may be partial
            upcoming = following(blocks, s, j, num_blocks, num_seqs, block)
            first, ahead = block * block_size * row, upcoming * block_size * row
            for t in range(count):  # the keys (and the next block's keys asked for)
                at = first + t * row
                for c in range(0, row, PAIRS):
                    prefetch_l2(keys, ahead + t * row + c)
                for h in range(num_kv_heads):
                    for g in range(group):
                        i = h * group + g
                        a = lanes.splat(0.0)
                        for c in range(chunks):
                            k = lanes.load(keys, at + h * head_dim + PAIRS * c)
                            a = lanes.dot(a, k, lanes.load(bits, i * head_dim + PAIRS * c))
                        scores[i, t] = lanes.total(a) * np.float32(scale)
            online_softmax(scores, count, best, total, acc)  # (acc's order of dimensions: any)
            for h in range(num_kv_heads):  # the values: per query head and 32 dimensions, in registers
                for c in range(chunks):
                    at = first + h * head_dim + PAIRS * c
                    for t in range(block_size):  # (the next block's same values asked for)
                        prefetch_l2(values, ahead + h * head_dim + PAIRS * c + t * row)
                    for g in range(group):
                        i = h * group + g
                        x = i * head_dim + PAIRS * c
                        # odd, even: dimensions; the first pair sums even positions t, the second odd ones
                        odd, even = lanes.load(acc, x), lanes.load(acc, x + 16)
                        odd2, even2 = lanes.splat(0.0), lanes.splat(0.0)
                        for t in range(0, count - 1, 2):
                            v = lanes.load(values, at + t * row)
                            p = lanes.splat(scores[i, t])
                            odd, even = lanes.fma(p, lanes.odd(v), odd), lanes.fma(p, lanes.even(v), even)
                            v = lanes.load(values, at + (t + 1) * row)
                            p = lanes.splat(scores[i, t + 1])
                            odd2, even2 = lanes.fma(p, lanes.odd(v), odd2), lanes.fma(p, lanes.even(v), even2)
                        if count % 2:
                            v = lanes.load(values, at + (count - 1) * row)
                            p = lanes.splat(scores[i, count - 1])
                            odd, even = lanes.fma(p, lanes.odd(v), odd), lanes.fma(p, lanes.even(v), even)
                        lanes.store(acc, x, odd + odd2)
                        lanes.store(acc, x + 16, even + even2)
        for i in range(num_heads):
            inverse = np.float32(1.0) / total[i]
            for c in range(chunks):
                for lane in range(16):
                    d = PAIRS * c + 2 * lane
                    out[s, i, d + 1] = rounded(acc[i, PAIRS * c + lane] * inverse, out)
                    out[s, i, d] = rounded(acc[i, PAIRS * c + 16 + lane] * inverse, out)


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def decode_layer(query, key, value, caches, layer, slots, blocks, seq_lens, scale, out):  # pragma: no cover
    """:func:`.loop_nest.store` then :func:`decode` for layer ``layer`` of ``caches``
    (``[layers, 2, num_blocks, block_size, H_kv, D]``); the query, keys and values may be strided
    views, as the model hands them over."""
    store(key, value, caches[layer, 0], caches[layer, 1], slots)
    decode(query, caches[layer, 0], caches[layer, 1], blocks, seq_lens, scale, out)
