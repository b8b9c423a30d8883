"""The loop nests Numba compiles for the CPU: attention in place and the K/V store (rows: :mod:`.loop_rows`).

:mod:`.compiled` calls them and tells why. All arguments are
NumPy arrays; bfloat16 arrives as its raw 16 bits (``uint16``), float32 as itself.

* ``decode(query, key_cache, value_cache, k_scales, v_scales, table, blocks, seq_lens, scale, out)``:
  ``query[S, H, D]``; caches ``[num_blocks, block_size, H_kv, D]``; ``k_scales``/``v_scales``
  ``[num_blocks, H_kv]`` float32, what each block's head is multiplied by as it is read (an 8-bit
  cache's scales; strides of 0 for one scale per tensor, or for a float cache's 1.0); ``fp8_format``
  int64 ``[mantissa bits, exponent bias]`` of an fp8 cache, which arrives as its bytes (``uint8``);
  ``blocks[S, W]`` and ``seq_lens[S]`` int64; ``out[S, H, D]`` of the query's kind, written. Float32
  arithmetic whatever the kinds: the query is widened and multiplied by ``scale`` once per sequence,
  the result rounded once (round to nearest even, as torch's ``.to(torch.bfloat16)``).
* ``store(key, value, key_cache, value_cache, slot_mapping)``: rows of ``[tokens, H_kv, D]`` into
  their slots (``-1``: skip), a copy of bits.
* ``decode_layer(query, key, value, caches, layer, slots, blocks, seq_lens, scale, out)``: the two
  above in one call, for one layer of every layer's ``caches[layers, 2, ...]`` (one dispatch from
  Python instead of two, and no per-layer views of the caches to make).
* ``store_int8(x, cache, scales, map_blocks, map_tokens)`` and ``decode_layer_int8(...)``: the int8
  cache's store, block by block with a scale per block and KV head (the arithmetic of
  :func:`.quantization.store_block_scaled`, to the bit), and the fused layer step over it.
Numba compiles one machine-code version per combination of kinds and keeps it in its disk cache.
The helpers live in this file on purpose: Numba's disk cache checks only the source file of the
cached function, so an edited helper imported from another file would go unnoticed.

libm's ``expf`` and ``floorf`` are calls, one per element, that stop LLVM from vectorizing a loop;
:func:`exp` uses the textbook range reduction ``e**x = 2**n * e**r`` (``n`` the nearest integer to
``x / ln 2``, ``|r| <= ln(2) / 2``) and Cephes' degree-6 polynomial for ``e**r``: within a relative
4e-7 of the exact value over the clamped range, and every step vectorizes.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload


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


@intrinsic
def prefetch(typingctx, array, offset):
    """Ask the memory system for the cache line that holds element ``offset`` (flat, C order) of
    ``array`` (x86 ``prefetcht0``): a hint that never faults and returns nothing."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        address = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
        word = ir.IntType(32)
        hint = ir.FunctionType(ir.VoidType(), [address.type, word, word, word])
        function = builder.module.declare_intrinsic("llvm.prefetch", [address.type], hint)
        builder.call(function, [address, word(0), word(3), word(1)])  # read, keep close, data
        return context.get_dummy_value()

    return types.void(array, offset), codegen


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
    """Each sequence's blocks in order; each block swept front to back twice, its keys (every
    query head of every KV head scored: a GQA group shares each key row it loads) then its values;
    an online softmax per query head between the sweeps, float32 accumulators. The block table
    sends the sweep to a new place in memory at every block, where the hardware's own prefetcher
    loses the trail: while the keys are swept, the same rows of values are prefetched, and while the
    values are swept, the next block's keys (on this machine: 1.7x faster when the cache is in DRAM,
    as it is in a model with many layers)."""
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
            if j + 1 < num_blocks:
                upcoming = blocks[s, j + 1]
            elif s + 1 < num_seqs:
                upcoming = blocks[s + 1, 0]
            else:
                upcoming = block
            for t in range(count):  # the keys
                for c in range(0, row, line):
                    prefetch(value_cache, (block * block_size + t) * row + c)
                for h in range(num_kv_heads):
                    k = row_of(keys[t, h], fp8, wide)
                    for g in range(group):  # the query heads sharing KV head h (GQA)
                        i = h * group + g
                        a = np.float32(0.0)
                        for d in range(head_dim):
                            a += scaled[i, d] * widen(k[d])
                        scores[i, t] = a * k_scale[h]
            for i in range(num_heads):  # online softmax: rescale what came before
                m = best[i]
                for t in range(count):
                    m = max(m, scores[i, t])
                rescale = exp(best[i] - m)
                best[i] = m
                for d in range(head_dim):
                    acc[i, d] *= rescale
                subtotal = np.float32(0.0)
                for t in range(count):
                    p = exp(scores[i, t] - m)
                    scores[i, t] = p
                    subtotal += p
                total[i] = total[i] * rescale + subtotal
            for t in range(count):  # the values
                for c in range(0, row, line):
                    prefetch(key_cache, (upcoming * block_size + t) * row + c)
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
