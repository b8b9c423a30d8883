"""Prompts on the AMX tiles: the keys and values of a sequence laid out for the tiles once, then
every tile of query rows multiplied against them (:mod:`.loop_amx` tells the shared story).

* ``prompt(query, keys, value_cache, blocks, seq_lens, starts, seqs, scale, rows, record, out)``:
  :func:`.loop_amx.attend`'s contract for prompts (and chunks after a cached prefix); ``keys`` is
  the key cache viewed as ``uint32`` pairs (``[num_blocks, block_size, H_kv, D / 2]``), ``record``
  from :func:`shapes`.

Decode reads each key once, so :func:`.loop_amx.attend` multiplies the keys as they lie in the
cache (``S^T = K . Q^T``) and transposes the small score tile. A prompt of ``n`` tokens reads each
key ``n / rows`` times, so here each KV head's keys are first written transposed, in pairs of
dimensions (``B``'s layout: row ``r`` holds dimensions ``2r, 2r + 1`` of every position), and its
values in pairs of positions, once per sequence; then ``S = Q . K^T`` has a row per query column,
positions along it, and each column's softmax reads one contiguous run of 32 scores. The score of a
column and position is the same sum of the same products either way (the tiles' dot product is
symmetric in its two operands), and the softmax and a tile's start and finish are
:mod:`.loop_amx`'s (:func:`.loop_amx.soften`, :func:`.loop_amx.begin`, :func:`.loop_amx.finish`), so
a row gets the same bits here as in a decode step.

Measured (SmolLM2's heads, 16 prompts of 27-300 tokens, 2,520 in all, block size 16, one thread,
bfloat16, 2-core Xeon with AMX): 10.1-11.1 ms a layer against 23.1 for :func:`.loop_nest.prefill` and
8.0-8.6 for torch's SDPA over the gathered pages (which does not compute a row alone);
:func:`.loop_amx.attend` on the same prompts, re-reading the cache for every tile of rows and
transposing every score tile, 11.1-11.4 ms, the same bits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from numba import njit

from . import amx
from .loop_amx import CHUNK, begin, finish, soften
from .loop_nest import stamp

stamp(Path(__file__))
stamp(Path(__file__), Path(amx.__file__))  # the intrinsics are compiled into these loops too
stamp(Path(__file__), Path(__file__).with_name("loop_amx.py"))  # and soften, shared with decode

_load_query, _load_query2, _load_key, _load_key2 = amx.load(1), amx.load(2), amx.load(3), amx.load(4)
_load_weights, _load_values, _load_acc = amx.load(5), amx.load(6), amx.load(7)
_store_scores, _store_acc = amx.store(0), amx.store(7)
_zero_scores = amx.zero(0)
_score, _score2, _weigh = amx.dot(0, 1, 3), amx.dot(0, 2, 4), amx.dot(7, 5, 6)


def shapes(columns: int) -> np.ndarray:
    """The tile record for ``columns`` query columns (at most 16): 0 scores ``[columns, 16
    positions]`` float32; 1-2 queries ``[columns, 32]`` bfloat16; 3-4 keys in pairs ``[16, 16]``;
    5 weights ``[columns, 32]``; 6 values in pairs ``[16, 16]``; 7 accumulator ``[columns, 16]``."""
    return amx.config({0: (columns, 64), 1: (columns, 64), 2: (columns, 64), 3: (16, 64), 4: (16, 64),
                       5: (columns, 64), 6: (16, 64), 7: (columns, 64)})  # fmt: skip


@njit(fastmath=True, cache=True, boundscheck=False, nogil=True, error_model="numpy")
def prompt(
    query, keys, value_cache, blocks, seq_lens, starts, seqs, scale, rows, record, out
):  # pragma: no cover - compiled
    """See the module's docstring."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads, half_dim = keys.shape[1], keys.shape[2], keys.shape[3]
    group = num_heads // num_kv_heads
    columns = rows * group
    steps = head_dim // 32
    longest = 0
    for k in range(seqs.shape[0]):
        longest = max(longest, seq_lens[seqs[k]])
    width = (longest + CHUNK - 1) // CHUNK * CHUNK  # positions, padded to whole chunks
    transposed = np.zeros((num_kv_heads, half_dim, width), np.uint32)  # keys: [pair of dims, position]
    paired = np.zeros((num_kv_heads, width // 2, head_dim), np.uint32)  # values: [pair of positions, dim]
    flat_paired, flat_values = paired.reshape(-1), value_cache.reshape(-1)
    asked = np.zeros((num_kv_heads, columns, head_dim), np.uint16)  # the tile's queries, A tiles
    scores = np.empty((columns, CHUNK), np.float32)
    weights = np.zeros((num_kv_heads, columns, CHUNK), np.uint16)
    seen = np.empty(CHUNK, np.float32)
    part = np.empty(16, np.float32)
    acc = np.empty((num_kv_heads, columns, head_dim), np.float32)
    best = np.empty((num_kv_heads, columns), np.float32)
    total = np.empty((num_kv_heads, columns), np.float32)
    limit = np.empty(columns, np.int64)
    row = num_kv_heads * head_dim
    amx.configure(record)
    for k in range(seqs.shape[0]):
        s = seqs[k]
        first, count, length = starts[s], starts[s + 1] - starts[s], seq_lens[s]
        context = length - count
        padded = (length + CHUNK - 1) // CHUNK * CHUNK
        for t in range(length):  # the sequence's keys and values, laid out for the tiles once
            block, offset = blocks[s, t // block_size], t % block_size
            for h in range(num_kv_heads):
                key = keys[block, offset, h]
                for r in range(half_dim):
                    transposed[h, r, t] = key[r]
        for h in range(num_kv_heads):
            for r in range(half_dim):
                for t in range(length, padded):
                    transposed[h, r, t] = 0
            for p in range(padded // 2):
                t, v = 2 * p, paired[h, p]
                if t >= length:
                    v[:] = 0
                    continue
                one = (blocks[s, t // block_size] * block_size + t % block_size) * row + h * head_dim
                if t + 1 < length:
                    two = (blocks[s, (t + 1) // block_size] * block_size + (t + 1) % block_size) * row
                    for d in range(0, head_dim, 32):
                        amx.interleave32(flat_paired, (h * (width // 2) + p) * head_dim + d, flat_values,
                                         one + d, two + h * head_dim + d)  # fmt: skip
                else:
                    for d in range(head_dim):
                        v[d] = np.uint32(flat_values[one + d])
        for r0 in range(0, count, rows):
            used = min(rows, count - r0)
            last = context + r0 + used - 1
            for c in range(columns):
                r = min(c // group, used - 1)
                limit[c] = context + r0 + r
                for h in range(num_kv_heads):
                    q, a = query[first + r0 + r, h * group + c % group], asked[h, c]
                    for d in range(head_dim):
                        a[d] = q[d]
            begin(acc, best, total)
            for base in range(0, last + 1, CHUNK):
                size = min(CHUNK, last + 1 - base)
                for h in range(num_kv_heads):
                    for half in range(0, size, 16):  # 1. scores, a row per column
                        _zero_scores()
                        for step in range(steps):
                            query_at = h * columns * head_dim + step * 32
                            key_at = (h * half_dim + step * 16) * width + base + half
                            if step % 2 == 0:
                                _load_query(asked, query_at, head_dim * 2)
                                _load_key(transposed, key_at, width * 4)
                                _score()
                            else:
                                _load_query2(asked, query_at, head_dim * 2)
                                _load_key2(transposed, key_at, width * 4)
                                _score2()
                        _store_scores(scores, half, CHUNK * 4)
                    for c in range(columns):  # 2. online softmax, per column
                        visible = min(size, limit[c] + 1 - base)
                        for t in range(CHUNK):
                            x = scores[c, t] * np.float32(scale)
                            seen[t] = x if t < visible else np.float32(-1e30)
                        soften(seen, visible, best[h], total[h], c, weights[h, c], acc[h, c], part)
                    _load_weights(weights, h * columns * CHUNK, CHUNK * 2)  # 3. acc += P . V
                    for d in range(0, head_dim, 16):
                        _load_values(paired, (h * (width // 2) + base // 2) * head_dim + d, head_dim * 4)
                        _load_acc(acc, h * columns * head_dim + d, head_dim * 4)
                        _weigh()
                        _store_acc(acc, h * columns * head_dim + d, head_dim * 4)
            finish(acc, total, out, first + r0, used, group)
    amx.release()
