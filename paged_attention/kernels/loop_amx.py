"""In-place attention on the AMX tiles (:mod:`.amx`): decode and prompts, bfloat16 caches.

* ``attend(query, key_cache, value_cache, blocks, seq_lens, starts, seqs, scale, rows, record, out)``:
  causal attention of each listed sequence's new tokens (``query[starts[s]:starts[s + 1]]``, the
  last of its ``seq_lens[s]`` positions) over its blocks, in place; ``rows`` query rows at a time
  (1 for decode), ``record`` the tile shapes from :func:`shapes`. Arrays as in :mod:`.loop_nest`
  (bfloat16 as ``uint16`` bits); the caches contiguous, their block size a multiple of 16, the
  head size a multiple of 32, ``rows * group <= 16``; the query's rows and heads at any strides,
  each head's dimensions contiguous.
* ``decode_layer(query, key, value, caches, layer, slots, blocks, seq_lens, scale, record, out)``:
  :func:`.loop_nest.store` then ``attend`` for one layer of a decode step.

Per sequence, per tile of ``rows`` query rows, every KV head's *columns* (``rows x group`` query
heads, GQA) sweep the positions the tile may see, 32 at a time:

1. scores ``S^T[32, columns] = K . Q^T`` on the tiles, the key rows loaded from the cache as they
   lie (16 positions, 32 dimensions a tile; a tile of 16 positions never crosses a block), stored
   as rows of 16 vector lanes: a lane per column, the columns of as many KV heads as fit;
2. the online softmax of all those columns at once (:mod:`.column_softmax`), in float32,
   over the positions each column's row may see (the others get weight 0 and are never part of its
   maximum); the weights rounded to bfloat16, the tiles' input;
3. the weights of each 16 positions transposed into two ``A`` tiles, a row per column
   (:func:`.amx.spread16`): one holds each weight in the even slot of its pair, the other in the odd
   slot, zeros beside them;
4. ``acc += P . V`` on the tiles with the value rows as they lie in the cache as ``B`` (16 positions,
   32 dimensions, read as 16 pairs of dimensions): the even tile sums the weights times the even
   dimensions, the odd tile times the odd ones, so the values are never rearranged (where the
   columns are at most 8, as in decode, one tile holds a head's even rows and then its odd rows:
   half the products); rows past the sequence are copied as zeros first (a zero weight times NaN
   would be NaN). After the rescale of step 2; the two halves of the accumulator are put back in
   order as the rows are written out.

A column's arithmetic does not depend on the other columns, nor on its lane, nor on where its tile
starts: the sweep's 32-position chunks start at position 0 for every row, a chunk a row may not see
leaves its maximum, sum and accumulator exactly as they were (weight 0, rescale 1), and every sum
the tiles take is over the same 16 positions in the same slots. A row gets the same bits as a
prompt row, a chunk after a cached prefix, or a decode step. (A prompt kernel that multiplied the
values transposed, ``O^T = V^T . P^T`` with the weights in pairs of positions, took 4.7-5.0 ms on
the prompts below, but the tiles round a sum of pairs otherwise than a sum of single products
beside zeros: 10 rows of 240 had an element that differed from the decode step's.)
While one chunk is computed, the next one's keys and values are prefetched, a few cache lines at
every step of it (:func:`_fetch`), so that memory is kept busy while the tiles work.

Measured (one thread, 2-core Xeon with AMX, alternating; the ranges span this host's drift within
a day): decode of SmolLM2's heads, 64 sequences of 100-430 tokens, block size 16, 30 layers' caches:
1.41-1.53 ms a layer (0.66-0.75 with the cache in L2) against 2.3 for :func:`.loop_nest.decode`; a
plain walk over the same blocks reads them in 1.2-1.3 ms; vLLM 0.32's AMX kernel took 1.5 ms on its
own head-major layout (block size 32 or 128), its AVX-512 kernel 2.7-2.8 ms. With the softmax a
column at a time (vectorized along the 32 positions) and the values rearranged into pairs of
positions for every chunk: 1.87 ms (1.0-1.15 in L2). Prompts (16 of 27-300 tokens, 2,520 in all):
5.5-6.4 ms a layer, 0.67-0.77 of the time of torch's SDPA over the gathered pages in the same runs
(7.2-9.3 ms; SDPA does not compute a row alone), against 23.1 for the loop nest. Timed with the
processor's cycle counter, a prompt call spends 39% of its time in the softmax, the weights'
transposition and the rescale, 26% in the values' product, 12% in the scores, 12% putting the
accumulators back in order and writing the rows out, 7% laying out the queries; a decode call
(caches in L2) 36%, 23%, 24%, 3% and 4%.
Prefetching the next chunk all at once at its start was slower (the fill buffers run out and the
pipeline stalls), and so was the values' product with vector multiply-adds instead of the tiles.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from numba import njit

from . import amx, lanes
from .column_softmax import CHUNK, soften
from .lanes import LANES, prefetch
from .loop_nest import narrow_bits, stamp, store

stamp(Path(__file__))
stamp(Path(__file__), Path(amx.__file__))  # the intrinsics are compiled into these loops too
stamp(Path(__file__), Path(lanes.__file__))  # and the vector lanes
stamp(Path(__file__), Path(__file__).with_name("column_softmax.py"))  # and the softmax


_load_key, _load_key2, _load_query, _load_query2 = amx.load(1), amx.load(2), amx.load(3), amx.load(4)
_load_weights, _load_values, _load_acc = amx.load(5), amx.load(6), amx.load(7)
_store_scores, _store_acc = amx.store(0), amx.store(7)
_zero_scores = amx.zero(0)
_score, _score2, _weigh = amx.dot(0, 1, 3), amx.dot(0, 2, 4), amx.dot(7, 5, 6)


def shapes(columns: int) -> np.ndarray:
    """The tile record for ``columns`` query heads of one KV head (``rows x group``, at most 16):
    0 scores ``[16 positions, columns]`` float32; 1-2 keys ``[16, 32]`` bfloat16; 3-4 queries in
    pairs ``[16, columns]``; 5 weights ``[columns, 32]`` in even or odd slots; 6 value rows as they
    lie ``[16 positions, 32]`` (16 pairs of dimensions); 7 accumulator ``[columns, 16]`` float32
    (even or odd dimensions). Where ``2 x columns <= 16``, tiles 5 and 7 have ``2 x columns``
    rows: the even rows, then the odd ones."""
    wide, stacked = 4 * columns, 2 * columns if 2 * columns <= 16 else columns  # both parities a tile
    return amx.config({0: (16, wide), 1: (16, 64), 2: (16, 64), 3: (16, wide), 4: (16, wide),
                       5: (stacked, 64), 6: (16, 64), 7: (stacked, 64)})  # fmt: skip


@njit(inline="always")
def _chunk_at(blocks, seq, position, block_size, row):
    """Element offset of position ``position``'s row (all KV heads) of sequence ``seq``."""
    return (blocks[seq, position // block_size] * block_size + position % block_size) * row


@njit(inline="always")
def _fetch(key_cache, value_cache, ahead, span, i, per):
    """Prefetch the ``i``-th ``per`` cache lines of each half of the next chunk, keys and values:
    called at every step of a chunk, so that memory is asked for evenly while the tiles work."""
    for half in range(2):
        for e in range(i * per * 32, min((i + 1) * per * 32, span[half]), 32):
            prefetch(key_cache, ahead[half] + e)
            prefetch(value_cache, ahead[half] + e)
    return i + 1


@njit(inline="always")
def lay_queries(query, first, used, context, group, pairs, limit, block):
    """A tile's queries, rows ``query[first:first + used]`` (the first at position ``context``; each
    head's dimensions contiguous, the rows and heads at any strides), as ``B`` tiles:
    ``pairs[h, step, p, c]`` holds dimensions ``32 step + 2p`` and ``+ 1`` of column ``c`` (row
    ``c // group``, query head ``h * group + c % group``; idle columns zeros), each tile the
    transpose of the columns' rows (:func:`.amx.transpose16`, ``block``: 16 x 16 words of scratch);
    ``limit[c]`` the last position column ``c`` may see (-1: an idle column)."""
    num_kv_heads, steps = pairs.shape[0], pairs.shape[1]
    limit[:] = -1
    block[:] = 0
    for h in range(num_kv_heads):
        for step in range(steps):
            c = 0
            for r in range(used):
                for g in range(group):
                    head = query[first + r, h * group + g]  # 32 bfloat16 a step: 16 pairs, as bits
                    lanes.store(block, c * 16, lanes.load(head, step * 32))
                    limit[c] = context + r
                    c += 1
            amx.transpose16(pairs, (h * steps + step) * 16 * LANES, block, 0)


@njit(inline="always")
def score(key_cache, key_at, row, pairs, scores):
    """``scores[:16, :columns]`` (rows of 16 lanes) = ``S^T`` of 16 positions and one KV head's
    columns: the key rows that start at element ``key_at`` of the cache, ``row`` elements apart,
    times the head's query pairs (``pairs[step, p, c]``, :func:`lay_queries`), 32 dimensions a step."""
    steps = pairs.shape[0]
    _zero_scores()
    for step in range(steps):
        if step % 2 == 0:
            _load_key(key_cache, key_at + step * 32, row * 2)
            _load_query(pairs, step * 16 * LANES, LANES * 4)
            _score()
        else:
            _load_key2(key_cache, key_at + step * 32, row * 2)
            _load_query2(pairs, step * 16 * LANES, LANES * 4)
            _score2()
    _store_scores(scores, 0, LANES * 4)


@njit(inline="always")
def begin(acc, best, total):
    """A tile of rows starts its sweep: nothing summed, every running maximum below any score."""
    acc[:] = 0.0
    best[:] = np.float32(-1e30)  # finite: fast-math assumes no infinities
    total[:] = 0.0


@njit(inline="always")
def finish(halves, total, fold, out, first, used, group):
    """A tile's ``used`` rows (``out[first:first + used]``) written: each column's accumulator
    (``halves[h, g, parity, c, n]``: dimension ``32 g + 2n + parity``) over its sum (``total`` of
    the pass ``h // fold``, lane ``(h % fold) columns + c``), rounded to bfloat16; column ``c`` is
    row ``c // group``, query head ``h * group + c % group``."""
    columns, groups = halves.shape[3], halves.shape[1]
    for c in range(used * group):
        for h in range(halves.shape[0]):
            inverse = np.float32(1.0) / total[h // fold, (h % fold) * columns + c]
            o = out[first + c // group, h * group + c % group]
            for g in range(groups):
                for n in range(16):
                    o[g * 32 + 2 * n] = narrow_bits(halves[h, g, 0, c, n] * inverse)
                    o[g * 32 + 2 * n + 1] = narrow_bits(halves[h, g, 1, c, n] * inverse)


@njit(inline="always")
def _ahead(blocks, seq_lens, starts, seqs, k, rows, base, last, r0, count, block_size, row, ahead, span):
    """Where the chunk after the one at ``base`` starts (``ahead``, each half) and how many elements
    (``span``): the next of this sweep, the next tile's first, or the next sequence's first."""
    span[:] = 0
    s = seqs[k]
    nxt, upto = s, last + 1
    if base + CHUNK <= last:
        start = base + CHUNK
    elif r0 + rows < count:
        start = 0
    elif k + 1 < seqs.shape[0]:
        nxt, start = seqs[k + 1], 0
        new = starts[nxt + 1] - starts[nxt]
        upto = seq_lens[nxt] - new + min(rows, new)  # the end of its first tile's sweep
    else:
        start = upto
    for half in range(2):
        if start + 16 * half < upto:
            ahead[half] = _chunk_at(blocks, nxt, start + 16 * half, block_size, row)
            span[half] = min(16, upto - start - 16 * half) * row


@njit(inline="always")
def _rescale(halves, rescale, h, lane, columns):
    """Head ``h``'s accumulators (``halves[h]``: every 32 dimensions, both parities, a row per
    column) times their columns' rescale (lanes ``lane``, ``lane + 1``, ...); a factor of exactly
    1 skipped (the same bits)."""
    groups = halves.shape[1]
    for c in range(columns):
        r = rescale[lane + c]
        if r != np.float32(1.0):
            factor = lanes.splat(r)
            for g in range(2 * groups):  # each 32 dimensions, both parities
                x = ((h * 2 * groups + g) * columns + c) * 16
                lanes.store(halves, x, lanes.load(halves, x) * factor)


@njit(inline="always")
def _stack(spread, stacked, p, h, lane, columns):
    """Head ``h``'s even rows, then its odd rows, of both halves' ``A`` tiles (``spread`` of pass
    ``p``, rows ``lane`` on) into ``stacked[h]``: one tile for both parities."""
    for half in range(2):
        for c in range(columns):
            even = ((p * 2 + half) * 2 * LANES + lane + c) * 16
            for parity in range(2):
                row = lanes.load(spread, even + parity * LANES * 16)
                lanes.store(stacked, ((h * 2 + half) * 2 * columns + parity * columns + c) * 16, row)


@njit(inline="always")
def _tail(flat_values, source, kept, flat_tail):
    """The last half's value rows (``kept`` elements from ``source``: its rows lie one after
    another in a block) into ``flat_tail``, zeros after them (a zero weight times NaN is NaN)."""
    for e in range(0, kept, 32):  # 32 bfloat16 a vector, as bits
        lanes.store(flat_tail, e, lanes.load(flat_values, source + e))
    for e in range(kept, flat_tail.shape[0], 32):
        lanes.store(flat_tail, e, lanes.splat(np.float32(0.0)))


@njit(fastmath=True, cache=True, boundscheck=False, nogil=True, error_model="numpy")
def attend(
    query, key_cache, value_cache, blocks, seq_lens, starts, seqs, scale, rows, record, out
):  # pragma: no cover - compiled
    """See the module's docstring."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    columns = rows * group
    row = num_kv_heads * head_dim  # elements in one position's keys, all KV heads
    steps = head_dim // 32  # key tiles per 16 positions
    line = 32  # bfloat16 elements in a 64-byte cache line
    fold = LANES // columns  # KV heads whose columns share the softmax's lanes
    passes = (num_kv_heads + fold - 1) // fold
    together = 2 if 2 * columns <= 16 else 1  # parities one A tile holds (its rows: 16 at most)
    pairs = lanes.aligned((num_kv_heads, steps, 16, LANES), np.uint32)  # queries as B tiles
    block = lanes.aligned((16, 16), np.uint32)
    scores = lanes.aligned((passes, CHUNK, LANES), np.float32)  # S^T, lane (h % fold) columns + c
    weights = lanes.aligned((CHUNK, LANES), np.float32)  # the softmax's, a row per position
    spread = lanes.aligned((passes, 2, 2, LANES, 16), np.uint32)  # A: each half even, then odd
    stacked = lanes.aligned((num_kv_heads, 2, 2 * columns, 16), np.uint32)  # A: a head's both
    tail = lanes.aligned((16, row), np.uint16)  # a last half's value rows, zeros past the sequence
    rescale = lanes.aligned((LANES,), np.float32)
    halves = lanes.aligned((num_kv_heads, head_dim // 32, 2, columns, 16), np.float32)  # by parity
    best = lanes.aligned((passes, LANES), np.float32)
    total = lanes.aligned((passes, LANES), np.float32)
    limit = np.full(LANES, -1, np.int64)  # the last position each column may see
    visible = lanes.aligned((LANES,), np.int32)
    at = np.zeros(2, np.int64)  # where this chunk's two halves start
    ahead = np.zeros(2, np.int64)  # where the next chunk's halves start, and how many elements
    span = np.zeros(2, np.int64)
    calls = num_kv_heads * (2 + head_dim // 32 * 4 // together) + passes  # _fetch's calls a chunk
    per = (16 * row // line + calls - 1) // calls  # cache lines each asks for, a half
    flat_values, flat_tail = value_cache.reshape(-1), tail.reshape(-1)
    amx.configure(record)
    for k in range(seqs.shape[0]):
        s = seqs[k]
        first, count = starts[s], starts[s + 1] - starts[s]
        context = seq_lens[s] - count
        for r0 in range(0, count, rows):
            used = min(rows, count - r0)
            last = context + r0 + used - 1
            lay_queries(query, first + r0, used, context + r0, group, pairs, limit, block)
            begin(halves, best, total)
            for base in range(0, last + 1, CHUNK):
                size = min(CHUNK, last + 1 - base)
                for half in range(2):
                    if 16 * half < size:
                        at[half] = _chunk_at(blocks, s, base + 16 * half, block_size, row)
                _ahead(
                    blocks,
                    seq_lens,
                    starts,
                    seqs,
                    k,
                    rows,
                    base,
                    last,
                    r0,
                    count,
                    block_size,
                    row,
                    ahead,
                    span,
                )
                i = 0
                for h in range(num_kv_heads):  # 1. scores
                    lane = (h % fold) * columns
                    for half in range(2):
                        i = _fetch(key_cache, value_cache, ahead, span, i, per)
                        if half * 16 < size:
                            chunk = scores[h // fold, 16 * half :, lane:]
                            score(key_cache, at[half] + h * head_dim, row, pairs[h], chunk)
                for lane in range(LANES):
                    c = lane % columns if lane < fold * columns else LANES
                    visible[lane] = max(0, min(size, limit[c] + 1 - base)) if c < LANES else 0
                for p in range(passes):  # 2. the softmax of ``fold`` KV heads' columns; 3. A tiles
                    i = _fetch(key_cache, value_cache, ahead, span, i, per)
                    lanes.store(rescale, 0, soften(scores[p], visible, scale, best[p], total[p], weights))
                    for half in range(2):
                        amx.spread16(spread, (p * 2 + half) * 2 * LANES * 16, weights, half * 16 * LANES)
                    for h in range(p * fold, min(num_kv_heads, (p + 1) * fold)):
                        _rescale(halves, rescale, h, (h % fold) * columns, columns)
                        if together == 2:
                            _stack(spread, stacked, p, h, (h % fold) * columns, columns)
                if size % 16:  # the last half's rows past the sequence
                    _tail(flat_values, at[size // 16], (size % 16) * row, flat_tail)
                for h in range(num_kv_heads):  # 4. acc += P . V, even and odd dimensions apart
                    for g in range(head_dim // 32):
                        for parity in range(0, 2, together):
                            acc_at = (((h * (head_dim // 32) + g) * 2 + parity) * columns) * 16
                            _load_acc(halves, acc_at, 64)
                            for half in range(2):
                                i = _fetch(key_cache, value_cache, ahead, span, i, per)
                                if 16 * half >= size:
                                    continue
                                if together == 2:
                                    _load_weights(stacked, (h * 2 + half) * 2 * columns * 16, 64)
                                else:
                                    tile = ((h // fold * 2 + half) * 2 + parity) * LANES + (
                                        h % fold
                                    ) * columns
                                    _load_weights(spread, tile * 16, 64)
                                if 16 * half + 16 <= size:
                                    _load_values(value_cache, at[half] + h * head_dim + g * 32, row * 2)
                                else:
                                    _load_values(tail, h * head_dim + g * 32, row * 2)
                                _weigh()
                            _store_acc(halves, acc_at, 64)
            finish(halves, total, fold, out, first + r0, used, group)
    amx.release()


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def decode_layer(
    query, key, value, caches, layer, slots, blocks, seq_lens, scale, record, out
):  # pragma: no cover - compiled
    """:func:`.loop_nest.store` then :func:`attend` (one row per sequence) for layer ``layer`` of
    ``caches`` (``[layers, 2, num_blocks, block_size, H_kv, D]``)."""
    store(key, value, caches[layer, 0], caches[layer, 1], slots)
    order = np.arange(query.shape[0])
    starts = np.arange(query.shape[0] + 1)
    attend(query, caches[layer, 0], caches[layer, 1], blocks, seq_lens, starts, order, scale, 1, record, out)
