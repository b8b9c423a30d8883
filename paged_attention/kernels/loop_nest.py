"""The loop nests Numba compiles for the CPU: attention in place, the K/V store, and their helpers.

:mod:`.compiled` calls them and tells why. All arguments are NumPy arrays; bfloat16 arrives as its
raw 16 bits (``uint16``), float32 as itself.

* ``decode(query, key_cache, value_cache, k_scales, v_scales, fp8_format, blocks, seq_lens, scale, out)``:
  ``query[S, H, D]``; caches ``[num_blocks, block_size, H_kv, D]``; ``k_scales``/``v_scales``
  ``[num_blocks, H_kv]`` float32 (an 8-bit cache's scales; strides of 0 for one per tensor, or a float
  cache's 1.0); ``fp8_format`` int64 ``[mantissa bits, exponent bias]`` of an fp8 cache (its bytes,
  ``uint8``); ``blocks[S, W]``, ``seq_lens[S]`` int64; ``out[S, H, D]`` of the query's kind. Float32
  arithmetic: the query widened and multiplied by ``scale`` once per sequence, the result rounded once
  (to nearest even, as torch's ``.to(torch.bfloat16)``).
* ``prefill(query, ..., blocks, seq_lens, starts, seqs, scale, out)``: causal attention of the
  listed sequences' new tokens (``query[starts[s]:starts[s + 1]]``) over their blocks, in place.
* ``store(key, value, key_cache, value_cache, slot_mapping)``: rows of ``[tokens, H_kv, D]`` into their
  slots (``-1``: skip), a copy of bits.
* ``decode_layer(query, key, value, caches, layer, slots, blocks, seq_lens, scale, out)``: the two
  above in one call, for one layer of every layer's ``caches[layers, 2, ...]`` (:mod:`.per_layer`).

Numba compiles one machine-code version per combination of kinds and keeps it in its disk cache,
which checks only the source file of a cached function: the other ``loop_*`` files, which use this
file's helpers, :func:`stamp` their own files when this one is newer.

libm's ``expf`` and ``floorf`` are calls, one per element, that stop LLVM from vectorizing a loop; :func:`exp`
uses the textbook range reduction ``e**x = 2**n * e**r`` (``n`` the nearest integer to ``x / ln 2``,
``|r| <= ln(2) / 2``) and Cephes' degree-6 polynomial for ``e**r``: within a relative 4e-7 of the exact
value over the clamped range, and every step vectorizes.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from numba import njit, types
from numba.extending import overload

from . import lanes
from .lanes import prefetch_l2


def stamp(target: Path, dependency: Path = Path(__file__)) -> bool:
    """Set ``target``'s modification time to now if ``dependency`` (this file) is newer, as ``make``
    does, so that Numba compiles its loops again; whether it did."""
    try:
        if dependency.stat().st_mtime > target.stat().st_mtime:
            os.utime(target)
            return True
    except OSError:  # a read-only install: its caches were built from its own, unedited files
        pass
    return False


stamp(Path(__file__), Path(lanes.__file__))  # the prefetch hints are compiled into these loops too


@njit(inline="always")
def widen_bits(bits):
    """bfloat16 bits (``uint16``) -> float32, exactly: they are the float32's top half."""
    return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)


@njit(inline="always")
def exp(x):
    """``e**x`` in float32, ``x`` clamped to [-87, 88] (where float32 under- and overflows)."""
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    t = x * np.float32(1.4426950408889634)
    n = np.float32(np.int32(t + (np.float32(0.5) if t >= 0 else np.float32(-0.5))))  # nearest
    r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)  # ln 2 in two parts
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * np.uint32((np.int32(n) + np.int32(127)) << np.int32(23)).view(np.float32)


def widen(x):
    """A cache element as float32 (Python stand-in; compiled code uses the overload below)."""
    return x


@overload(widen, inline="always")
def _widen(x):
    if isinstance(x, types.Integer) and x.bitwidth == 16:  # bfloat16 bits: the top half of a float32
        return lambda x: widen_bits(x)
    return lambda x: np.float32(x)


@njit(inline="always")
def narrow_bits(x):
    """float32 -> bfloat16 bits, rounded to nearest, ties to even (torch's rounding); NaN stays NaN."""
    bits = np.float32(x).view(np.uint32)
    if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16(0x7FC0)
    bias = ((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    return np.uint16((bits + bias) >> np.uint32(16))


def rounded(x, like):
    """float32 ``x`` rounded to the element kind of the array ``like`` (stand-in; see below)."""
    return x


@overload(rounded)
def _rounded(x, like):
    if isinstance(like.dtype, types.Integer):  # bfloat16 bits: round, and keep the bits
        return lambda x, like: narrow_bits(x)
    return lambda x, like: np.float32(x)


@njit(inline="always")
def following(blocks, s, j, num_blocks, num_seqs, block):  # pragma: no cover - compiled
    """The block a decode walk of ``num_seqs`` sequences reads after block ``j`` (``block``) of
    sequence ``s``, whose blocks number ``num_blocks``: its next, else the next sequence's first,
    else ``block`` itself (what the walk asks for ahead of time)."""
    if j + 1 < num_blocks:
        return blocks[s, j + 1]
    if s + 1 < num_seqs:
        return blocks[s + 1, 0]
    return block


@njit(inline="always")
def online_softmax(scores, count, best, total, acc):
    """One block's scores ``scores[i, :count]`` of each query head ``i`` into their weights
    ``exp(score - max)``, and the head's running maximum ``best[i]``, sum ``total[i]`` and accumulator
    row ``acc[i]`` rescaled to the new maximum: FlashAttention's online softmax, between the sweeps."""
    for i in range(scores.shape[0]):
        m = best[i]
        for t in range(count):
            m = max(m, scores[i, t])
        rescale = exp(best[i] - m)
        best[i] = m
        for d in range(acc.shape[1]):
            acc[i, d] *= rescale
        subtotal = np.float32(0.0)
        for t in range(count):
            p = exp(scores[i, t] - m)
            scores[i, t] = p
            subtotal += p
        total[i] = total[i] * rescale + subtotal


@njit(inline="always")
def fp8_bits(bits, mantissa, bias):
    """An fp8 byte (``mantissa`` bits, exponent ``bias``: e4m3 3 and 7, e5m2 2 and 15) -> float32,
    exactly, in integer steps without a branch, so that the loop around it vectorizes: a normal
    number's exponent and mantissa move into a float32's fields, the exponent rebiased; a subnormal
    is its mantissa times the smallest step; a mask picks one of the two, and the sign goes on last."""
    u32 = np.uint32  # (Numba widens arithmetic on 32-bit integers to 64 bits: each step is cast back)
    byte = u32(bits)
    magnitude = u32(byte & u32(0x7F))
    normal = u32(u32(magnitude << u32(u32(23) - mantissa)) + u32(u32(u32(127) - bias) << u32(23)))
    step = u32(u32(u32(128) - bias - mantissa) << u32(23)).view(np.float32)  # 2 ** (1 - bias - mantissa)
    subnormal = np.float32(np.float32(magnitude) * step).view(np.uint32)
    keep = u32(u32(0) - u32(magnitude >= u32(u32(1) << mantissa)))  # all ones for a normal number
    sign = u32(u32(byte & u32(0x80)) << u32(24))
    return u32(u32(normal & keep) | u32(subnormal & u32(~keep)) | sign).view(np.float32)


def row_of(x, fp8, wide):
    """A cache row as the dot products read it: an fp8 row decoded once into ``wide`` (float32), so
    that a GQA group's query heads do not each decode it again; any other row as it is, widened value
    by value (one shift for bfloat16) (stand-in; compiled code uses the overload below)."""
    return x


@overload(row_of, inline="always")
def _row_of(x, fp8, wide):
    if isinstance(x.dtype, types.Integer) and x.dtype.bitwidth == 8 and not x.dtype.signed:

        def decode_row(x, fp8, wide):
            for d in range(x.shape[0]):
                wide[d] = fp8_bits(x[d], fp8[0], fp8[1])
            return wide

        return decode_row
    return lambda x, fp8, wide: x


@njit(fastmath=True, cache=True, boundscheck=False, nogil=True, error_model="numpy")
def decode(
    query, key_cache, value_cache, k_scales, v_scales, fp8_format, blocks, seq_lens, scale, out
):  # pragma: no cover - compiled
    """Each sequence's blocks in order; each block swept twice, its keys (every query head of every
    KV head scored: a GQA group shares each key row it loads) then its values; an online softmax per
    query head between the sweeps, float32 accumulators. The block table sends the sweep to a new
    place in memory at every block, where the hardware's prefetcher loses the trail: while the keys
    are swept, the same rows of values are asked for, and while the values are, the next block's keys
    (1.7x faster with the cache in DRAM), into the L2 cache (a 2-core AMD EPYC, float32, 64 sequences
    of 210 positions, 30 layers: 47 ms a step against 65 into the L1)."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    row = num_kv_heads * head_dim  # elements in one token's keys (or values), all KV heads
    line = max(1, 64 // key_cache.itemsize)  # elements in a 64-byte cache line
    scores = np.empty((num_heads, block_size), np.float32)  # one block's, then its softmax weights
    fp8 = (np.uint32(fp8_format[0]), np.uint32(fp8_format[1]))  # an fp8 cache's (mantissa bits, bias)
    acc = np.empty((num_heads, head_dim), np.float32)
    best = np.empty(num_heads, np.float32)  # running maximum score per query head
    total = np.empty(num_heads, np.float32)  # running sum of exp(score - best)
    scaled = np.empty((num_heads, head_dim), np.float32)  # this sequence's query, widened and scaled
    k_scale = np.empty(num_kv_heads, np.float32)  # this block's scales, per KV head
    v_scale = np.empty(num_kv_heads, np.float32)
    wide = np.empty(head_dim, np.float32)  # an fp8 row of one KV head, decoded once for its group
    for s in range(num_seqs):
        n = seq_lens[s]
        num_blocks = (n + block_size - 1) // block_size
        for i in range(num_heads):
            for d in range(head_dim):
                scaled[i, d] = widen(query[s, i, d]) * np.float32(scale)
        acc[:] = 0.0
        best[:] = np.float32(-1e30)  # finite: fast-math assumes no infinities
        total[:] = 0.0
        for j in range(num_blocks):
            block = blocks[s, j]
            keys = key_cache[block]
            values = value_cache[block]
            count = min(block_size, n - j * block_size)  # the last block may be partial
            for h in range(num_kv_heads):
                k_scale[h] = k_scales[block, h]
                v_scale[h] = v_scales[block, h]
            upcoming = following(blocks, s, j, num_blocks, num_seqs, block)
            for t in range(count):  # the keys
                for c in range(0, row, line):
                    prefetch_l2(value_cache, (block * block_size + t) * row + c)
                for h in range(num_kv_heads):
                    k = row_of(keys[t, h], fp8, wide)
                    for g in range(group):  # the query heads sharing KV head h (GQA)
                        i = h * group + g
                        a = np.float32(0.0)
                        for d in range(head_dim):
                            a += scaled[i, d] * widen(k[d])
                        scores[i, t] = a * k_scale[h]
            online_softmax(scores, count, best, total, acc)
            for t in range(count):  # the values
                for c in range(0, row, line):
                    prefetch_l2(key_cache, (upcoming * block_size + t) * row + c)
                for h in range(num_kv_heads):
                    v = row_of(values[t, h], fp8, wide)
                    for g in range(group):
                        i = h * group + g
                        p = scores[i, t] * v_scale[h]
                        for d in range(head_dim):
                            acc[i, d] += p * widen(v[d])
        for i in range(num_heads):
            inverse = np.float32(1.0) / total[i]
            for d in range(head_dim):
                out[s, i, d] = rounded(acc[i, d] * inverse, out)


#: Query rows of one sequence, and cached positions, that :func:`prefill` takes at a time.
TILE_ROWS, TILE_KEYS = 16, 64


@njit(fastmath=True, cache=True, boundscheck=False, nogil=True, error_model="numpy")
def prefill(
    query, key_cache, value_cache, k_scales, v_scales, fp8_format, blocks, seq_lens, starts, seqs, scale, out
):  # pragma: no cover - compiled
    """Causal attention of each listed sequence's new tokens (``query[starts[s]:starts[s + 1]]``,
    the last of its ``seq_lens[s]`` positions) over its blocks, in place. Per KV head, per tile of
    :data:`TILE_ROWS` query rows, per tile of :data:`TILE_KEYS` positions the rows can see, read
    through the block table (whatever the block size): the keys widened, scaled and transposed to
    ``[D, TILE_KEYS]`` (a row's scores are then one run of lanes), the values widened; every row and
    query head of the GQA group scores them, an online softmax per row and head, then the values
    are added. Positions past the tile's last row are never read; positions past a row's own never
    enter its softmax (weight 0)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    fp8 = (np.uint32(fp8_format[0]), np.uint32(fp8_format[1]))
    wide = np.empty(head_dim, np.float32)
    scaled = np.empty((TILE_ROWS, group, head_dim), np.float32)
    acc = np.empty((TILE_ROWS, group, head_dim), np.float32)
    best = np.empty((TILE_ROWS, group), np.float32)
    total = np.empty((TILE_ROWS, group), np.float32)
    scores = np.empty((TILE_ROWS, group, TILE_KEYS), np.float32)
    keys = np.zeros((head_dim, TILE_KEYS), np.float32)  # lanes past a tile's end: scored, weight 0
    values = np.zeros((TILE_KEYS, head_dim), np.float32)
    for s in seqs:
        first, n = starts[s], starts[s + 1] - starts[s]
        context = seq_lens[s] - n  # positions cached before these tokens
        for h in range(num_kv_heads):
            for r0 in range(0, n, TILE_ROWS):
                rows = min(TILE_ROWS, n - r0)
                for r in range(rows):
                    for g in range(group):
                        q = query[first + r0 + r, h * group + g]
                        for d in range(head_dim):
                            scaled[r, g, d] = widen(q[d]) * np.float32(scale)
                acc[:] = 0.0
                best[:] = np.float32(-1e30)  # finite: fast-math assumes no infinities
                total[:] = 0.0
                last = context + r0 + rows - 1  # the tile's last position
                for base in range(0, last + 1, TILE_KEYS):
                    count = min(TILE_KEYS, last + 1 - base)
                    for t in range(count):
                        block, offset = blocks[s, (base + t) // block_size], (base + t) % block_size
                        k = row_of(key_cache[block, offset, h], fp8, wide)
                        for d in range(head_dim):
                            keys[d, t] = widen(k[d]) * k_scales[block, h]
                        v = row_of(value_cache[block, offset, h], fp8, wide)
                        for d in range(head_dim):
                            values[t, d] = widen(v[d]) * v_scales[block, h]
                    for t in range(count, (count + 3) // 4 * 4):  # the value pass reads lanes in
                        for d in range(head_dim):  # fours: the last four's unused lanes hold zeros
                            values[t, d] = 0.0
                    scores[:] = 0.0
                    for d in range(0, head_dim, 4):  # scores: a run of lanes per row and head,
                        for r in range(rows):  # four dimensions a pass (a quarter of the stores)
                            for g in range(group):
                                q = scaled[r, g]
                                if d + 4 <= head_dim:
                                    q0, q1, q2, q3 = q[d], q[d + 1], q[d + 2], q[d + 3]
                                    for t in range(TILE_KEYS):
                                        scores[r, g, t] += (
                                            q0 * keys[d, t]
                                            + q1 * keys[d + 1, t]
                                            + q2 * keys[d + 2, t]
                                            + q3 * keys[d + 3, t]
                                        )
                                else:
                                    for e in range(d, head_dim):
                                        for t in range(TILE_KEYS):
                                            scores[r, g, t] += q[e] * keys[e, t]
                    for r in range(rows):  # online softmax over the positions each row may see
                        seen = min(count, context + r0 + r + 1 - base)
                        for g in range(group):
                            m = best[r, g]
                            for t in range(seen):
                                m = max(m, scores[r, g, t])
                            rescale = exp(best[r, g] - m)
                            best[r, g] = m
                            subtotal = np.float32(0.0)
                            for t in range(TILE_KEYS):
                                p = exp(scores[r, g, t] - m) if t < seen else np.float32(0.0)
                                scores[r, g, t] = p
                                subtotal += p
                            total[r, g] = total[r, g] * rescale + subtotal
                            for d in range(head_dim):
                                acc[r, g, d] *= rescale
                    for t in range(0, count, 4):  # values, weighted by each row's softmax
                        for r in range(rows):  # (weight 0: a position the row may not see)
                            for g in range(group):
                                p = scores[r, g]
                                p0, p1, p2, p3 = p[t], p[t + 1], p[t + 2], p[t + 3]
                                for d in range(head_dim):
                                    acc[r, g, d] += (
                                        p0 * values[t, d] + p1 * values[t + 1, d] + p2 * values[t + 2, d]
                                        + p3 * values[t + 3, d]
                                    )  # fmt: skip
                for r in range(rows):
                    for g in range(group):
                        inverse = np.float32(1.0) / total[r, g]
                        for d in range(head_dim):
                            out[first + r0 + r, h * group + g, d] = rounded(acc[r, g, d] * inverse, out)


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def store(key, value, key_cache, value_cache, slot_mapping):  # pragma: no cover - compiled
    """Copy row ``t`` of ``key``/``value`` ``[tokens, H_kv, D]`` into slot ``slot_mapping[t]`` of the
    caches (``-1``: skip); the arrays share one dtype (bfloat16 as ``uint16``: a copy of bits)."""
    block_size, num_kv_heads, head_dim = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    for t in range(slot_mapping.shape[0]):
        slot = slot_mapping[t]
        if slot >= 0:
            block, offset = slot // block_size, slot % block_size
            for h in range(num_kv_heads):
                for d in range(head_dim):
                    key_cache[block, offset, h, d] = key[t, h, d]
                    value_cache[block, offset, h, d] = value[t, h, d]


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def decode_layer(
    query, key, value, caches, layer, slots, blocks, seq_lens, scale, ones, fp8_format, out
):  # pragma: no cover - compiled
    """:func:`store` then :func:`decode` for layer ``layer`` of ``caches`` (every layer's keys and
    values, ``[layers, 2, num_blocks, block_size, H_kv, D]``): one layer of a decode step in one
    call; the query, keys and values may be strided views, as the model hands them over. ``ones``:
    scales of 1.0 (``[num_blocks, H_kv]``, strides of 0); ``fp8_format``: unused, any two int64."""
    store(key, value, caches[layer, 0], caches[layer, 1], slots)
    decode(query, caches[layer, 0], caches[layer, 1], ones, ones, fp8_format, blocks, seq_lens, scale, out)
