"""The row-wise loops Numba compiles for the CPU: few-row products and RMSNorm (:mod:`.rows`, :mod:`.tiled`).

All arguments are NumPy arrays (but the addresses ``linear_rows_at`` takes); bfloat16 arrives as its
raw 16 bits (``uint16``), float32 as itself.

* ``linear_rows(x, weight, bias, out)``: ``x[M, K] @ weight[N, K].T + bias[N]`` for a few rows
  (``bias`` of length 0: none), float32 sums in 16 lanes (:mod:`.lanes`), each weight row read from
  memory once: a matrix-vector product bound by reading the weights.
* ``linear_groups(x, weight, grouped, bias, out)``: the same, the same bits, reading the weights
  from ``grouped = group(weight)``, a copy laid out in the order the loop reads it: one stream the
  processor's own prefetcher follows (on this project's 2-core AMD EPYC, one thread, one of
  SmolLM2's weights at one row through :class:`.rows.Streamed`: 20-29 GB/s, against 11-17 for the
  weights in their own layout).
* ``linear_rows_at(x_address, rows, weight, grouped, bias, out_address)``: ``linear_groups``, ``x``
  and ``out`` given by the addresses of C-order ``[rows, K]`` and ``[rows, N]`` bfloat16
  (:class:`.rows.Streamed` calls it so: no NumPy views to make, ~10 us less a call).
* ``linear_quads(x, weight, bias, out)``: the same product, each output's sums in the same order
  and so the same bits, four input rows at a time (:mod:`.widened`, for a CPU without bfloat16
  arithmetic): each weight vector is widened once for four rows, a block of weight rows stays in
  the L2 cache while every four rows pass over it. ``linear_quads_at``: by address.
* ``tiled_rows(x, tiles, block, bias, out)``: the same product in float32 from
  ``tiles[ceil(N / T), K, T]``, summed in oneDNN's order (:mod:`.tiled` says which).
* ``rms_norm(x, weight, eps, out)``: ``x[T, D]``, ``weight[D]``, ``out[T, D]`` of one kind. The
  arithmetic and roundings of transformers' ``LlamaRMSNorm``: the row widened to float32,
  ``y = x * (1 / sqrt(mean(x**2) + eps))``, ``y`` rounded to the input's kind, then multiplied by the
  weight and rounded again. The mean is summed in another order than torch's (float32 results a few
  ulps apart, as any two vector reductions; bfloat16 results nearly always the same bits).

The bfloat16 helpers (``widen``, ``rounded``) are :mod:`.loop_nest`'s: on import this file is
stamped newer when that one is (:func:`.loop_nest.stamp`), so that an edited helper is compiled in.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from numba import carray, njit

from . import lanes
from .lanes import address, prefetch
from .loop_nest import narrow_bits, rounded, stamp, widen

stamp(Path(__file__))
stamp(Path(__file__), Path(lanes.__file__))  # the vector lanes are compiled into these loops too


#: Weight rows multiplied together: their vectors interleave, 4 independent sums in flight.
GROUP = 4
#: How far ahead of the rows being read the loop asks for the weights, in elements (16 KiB), when it
#: reads them in their own layout (on SmolLM2's layers a pass of this loop alone took 0.76-0.85x
#: oneDNN's time with it, 0.94x without: a Xeon, one thread). The grouped layout needs no hint.
AHEAD = 8192


def group(weight):
    """The bits of ``weight[N, K]`` (C order) laid out as :func:`linear_groups` reads them, one
    stream: for each ``GROUP`` rows, for each 32 columns, the rows' 32 values one after the other
    (``[N // GROUP, K // 32, GROUP, 32]``, flat, starting on a 64-byte line; the last ``N % GROUP``
    rows and ``K % 32`` columns are left out: the loop reads those from ``weight``). A copy."""
    n_out, k_in = weight.shape
    rows, whole = n_out // GROUP * GROUP, k_in // 32 * 32
    blocks = weight[:rows, :whole].reshape(rows // GROUP, GROUP, whole // 32, 32)
    raw = np.empty(rows * whole * weight.itemsize + 64, np.uint8)
    skip = (-raw.ctypes.data) % 64  # (as :func:`.lanes.aligned`, in Python)
    out = raw[skip : skip + rows * whole * weight.itemsize].view(weight.dtype)
    out.reshape(blocks.shape[0], blocks.shape[2], GROUP, 32)[...] = blocks.transpose(0, 2, 1, 3)
    return out


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def linear_rows(x, weight, bias, out):  # pragma: no cover - compiled
    """:func:`linear_groups` reading the weights in their own layout."""
    linear_groups(x, weight, weight.reshape(-1)[:0], bias, out)


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def linear_groups(x, weight, grouped, bias, out):  # pragma: no cover - compiled
    """``out = x @ weight.T + bias`` for a few rows ``x[M, K]``, ``weight[N, K]`` (C order),
    ``bias[N]`` (length 0: none), all bfloat16 bits; ``grouped``: :func:`group` of ``weight``, or
    length 0 (then the loop reads ``weight`` itself, four rows side by side, and asks for them
    ahead). Each output alone, so its bits do not depend on ``M`` nor on the layout: lane ``j``
    sums the products of ``k = 32 i + 2 j + 1`` then ``32 i + 2 j``, ``i`` rising
    (:func:`.lanes.dot`); the lanes' total (:func:`.lanes.total`), then the last ``K % 32``
    products in order, then the bias; rounded once. The weights come from memory once for all
    ``M`` rows: ``GROUP`` rows at a time, ``M`` times over from the L1 cache."""
    rows, k_in = x.shape
    n_out = weight.shape[0]
    whole = k_in // 32 * 32
    row = (k_in + 31) // 32 * 32  # (each row of inputs on 64-byte lines: a vector, one line)
    inputs = lanes.aligned((rows, row), np.uint16)
    inputs[:, :k_in] = x
    own = weight.reshape(-1)
    laid = grouped.shape[0] > 0
    flat = grouped if laid else own
    across, along, stride = (32, GROUP, whole) if laid else (k_in, 1, k_in)  # next row, next 32 columns
    grouped_rows = n_out // GROUP * GROUP
    sums = np.empty(GROUP, np.float32)
    for n in range(0, grouped_rows, GROUP):
        at = n * stride
        for m in range(rows):
            a0, a1, a2, a3 = lanes.splat(0.0), lanes.splat(0.0), lanes.splat(0.0), lanes.splat(0.0)
            for k in range(0, whole, 32):
                if m == 0 and not laid:  # the lines that hold as many elements a little further on
                    for line in range(GROUP):
                        prefetch(own, at + AHEAD + GROUP * k + 32 * line)
                v = lanes.load(inputs, m * row + k)
                i = at + along * k
                a0 = lanes.dot(a0, lanes.load(flat, i), v)
                a1 = lanes.dot(a1, lanes.load(flat, i + across), v)
                a2 = lanes.dot(a2, lanes.load(flat, i + 2 * across), v)
                a3 = lanes.dot(a3, lanes.load(flat, i + 3 * across), v)
            sums[0], sums[1], sums[2], sums[3] = _totals(a0, a1, a2, a3)
            for g in range(GROUP):  # (:func:`_finish`'s steps written here: see :func:`_quads`)
                t = sums[g]
                for k in range(whole, k_in):
                    t += widen(x[m, k]) * widen(weight[n + g, k])
                if bias.shape[0] > 0:
                    t += widen(bias[n + g])
                out[m, n + g] = rounded(t, out)
    for n in range(grouped_rows, n_out):  # the last N % GROUP rows, one at a time
        for m in range(rows):
            a0 = lanes.splat(0.0)
            for k in range(0, whole, 32):
                a0 = lanes.dot(a0, lanes.load(own, n * k_in + k), lanes.load(inputs, m * row + k))
            _finish(x, weight, bias, out, m, n, whole, lanes.total(a0))


@njit(inline="always")
def views(x_address, rows, weight, out_address):  # pragma: no cover - compiled
    """The C-order bfloat16 ``x[rows, K]`` and ``out[rows, N]`` at the addresses given, as arrays
    (``K``, ``N``: ``weight``'s; the caller keeps both alive and of that shape and kind)."""
    n_out, k_in = weight.shape
    return carray(address(x_address), (rows, k_in), np.uint16), carray(
        address(out_address), (rows, n_out), np.uint16
    )


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def linear_rows_at(x_address, rows, weight, grouped, bias, out_address):  # pragma: no cover - compiled
    """:func:`linear_groups` of ``x`` and ``out`` at the addresses given (:func:`views`)."""
    x, out = views(x_address, rows, weight, out_address)
    linear_groups(x, weight, grouped, bias, out)


#: Bytes of weight rows that the quads of input rows pass over before the next such block: it stays
#: in a core's L2 cache (1.25-2 MiB on the Xeons measured) beside the widened inputs.
BLOCK_BYTES = 1 << 18


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def linear_quads(x, weight, bias, out):  # pragma: no cover - compiled
    """:func:`linear_rows`, its bits on a CPU without AVX512-BF16 (where :func:`.lanes.dot` is two
    fused multiply-adds; elsewhere the same but near float32's least normal number), four rows of
    ``x`` at a time: 16 sums in registers, each weight vector widened once for four rows, each
    input widened once for the whole product. Rows past the last quad, one at a time."""
    rows, k_in = x.shape
    n_out = weight.shape[0]
    chunks = k_in // 32
    whole = chunks * 32
    wide = lanes.aligned((rows, whole), np.float32)  # per 32 inputs: 16 odd ones, then 16 even ones
    for m in range(rows):
        for c in range(chunks):
            bits = lanes.load(x[m], 32 * c)
            lanes.store(wide[m], 32 * c, lanes.odd(bits))
            lanes.store(wide[m], 32 * c + 16, lanes.even(bits))
    flat = wide.reshape(-1)
    weights = weight.reshape(-1)
    grouped = n_out // GROUP * GROUP
    quads = rows // 4 * 4
    block = max(GROUP, BLOCK_BYTES // (2 * max(1, k_in)) // GROUP * GROUP)
    for lo in range(0, grouped, block):
        hi = min(grouped, lo + block)
        for m in range(0, quads, 4):
            _quads(x, weight, weights, bias, out, flat, m, lo, hi, chunks, m == 0)
        for m in range(quads, rows):
            _singles(x, weight, weights, bias, out, flat, m, lo, hi, chunks, quads == 0 and m == 0)
    for n in range(grouped, n_out):  # the last N % GROUP weight rows, one at a time
        for m in range(rows):
            a = lanes.splat(0.0)
            for c in range(chunks):
                w = lanes.load(weights, n * k_in + 32 * c)
                at = m * whole + 32 * c
                a = lanes.fma(lanes.odd(w), lanes.load(flat, at), a)
                a = lanes.fma(lanes.even(w), lanes.load(flat, at + 16), a)
            _finish(x, weight, bias, out, m, n, whole, lanes.total(a))


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def _quads(x, weight, weights, bias, out, flat, m, lo, hi, chunks, first):  # pragma: no cover - compiled
    """Outputs ``[m:m+4, lo:hi]`` of :func:`linear_quads`, ``GROUP`` weight rows at a time (``first``:
    the weights come from memory, so ask for them ahead). Its own function, and every output
    finished here rather than by a helper: a first version (the tile inlined into the loop nest, the
    outputs finished by :func:`_finish` from a loop over a tuple of the sums) kept 12 of the 16 sums
    on the stack, and an inlined helper given arrays counts references to each of them (atomic
    operations) at every call: 0.2-0.4 multiply-adds a cycle where this runs about one."""
    k_in = weight.shape[1]
    whole = chunks * 32
    sums = np.empty((4, GROUP), np.float32)
    for n in range(lo, hi, GROUP):
        at = n * k_in
        a00, a01, a02, a03 = lanes.splat(0.0), lanes.splat(0.0), lanes.splat(0.0), lanes.splat(0.0)
        a10, a11, a12, a13 = lanes.splat(0.0), lanes.splat(0.0), lanes.splat(0.0), lanes.splat(0.0)
        a20, a21, a22, a23 = lanes.splat(0.0), lanes.splat(0.0), lanes.splat(0.0), lanes.splat(0.0)
        a30, a31, a32, a33 = lanes.splat(0.0), lanes.splat(0.0), lanes.splat(0.0), lanes.splat(0.0)
        for c in range(chunks):
            k = 32 * c
            if first:
                for line in range(GROUP):
                    prefetch(weights, at + AHEAD + GROUP * k + 32 * line)
            w = lanes.load(weights, at + k)
            o0, e0 = lanes.odd(w), lanes.even(w)
            w = lanes.load(weights, at + k_in + k)
            o1, e1 = lanes.odd(w), lanes.even(w)
            w = lanes.load(weights, at + 2 * k_in + k)
            o2, e2 = lanes.odd(w), lanes.even(w)
            w = lanes.load(weights, at + 3 * k_in + k)
            o3, e3 = lanes.odd(w), lanes.even(w)
            i = m * whole + k
            xo, xe = lanes.load(flat, i), lanes.load(flat, i + 16)
            a00 = lanes.fma(e0, xe, lanes.fma(o0, xo, a00))
            a01 = lanes.fma(e1, xe, lanes.fma(o1, xo, a01))
            a02 = lanes.fma(e2, xe, lanes.fma(o2, xo, a02))
            a03 = lanes.fma(e3, xe, lanes.fma(o3, xo, a03))
            i += whole
            xo, xe = lanes.load(flat, i), lanes.load(flat, i + 16)
            a10 = lanes.fma(e0, xe, lanes.fma(o0, xo, a10))
            a11 = lanes.fma(e1, xe, lanes.fma(o1, xo, a11))
            a12 = lanes.fma(e2, xe, lanes.fma(o2, xo, a12))
            a13 = lanes.fma(e3, xe, lanes.fma(o3, xo, a13))
            i += whole
            xo, xe = lanes.load(flat, i), lanes.load(flat, i + 16)
            a20 = lanes.fma(e0, xe, lanes.fma(o0, xo, a20))
            a21 = lanes.fma(e1, xe, lanes.fma(o1, xo, a21))
            a22 = lanes.fma(e2, xe, lanes.fma(o2, xo, a22))
            a23 = lanes.fma(e3, xe, lanes.fma(o3, xo, a23))
            i += whole
            xo, xe = lanes.load(flat, i), lanes.load(flat, i + 16)
            a30 = lanes.fma(e0, xe, lanes.fma(o0, xo, a30))
            a31 = lanes.fma(e1, xe, lanes.fma(o1, xo, a31))
            a32 = lanes.fma(e2, xe, lanes.fma(o2, xo, a32))
            a33 = lanes.fma(e3, xe, lanes.fma(o3, xo, a33))
        sums[0, 0], sums[0, 1], sums[0, 2], sums[0, 3] = _totals(a00, a01, a02, a03)
        sums[1, 0], sums[1, 1], sums[1, 2], sums[1, 3] = _totals(a10, a11, a12, a13)
        sums[2, 0], sums[2, 1], sums[2, 2], sums[2, 3] = _totals(a20, a21, a22, a23)
        sums[3, 0], sums[3, 1], sums[3, 2], sums[3, 3] = _totals(a30, a31, a32, a33)
        for r in range(4):
            for g in range(GROUP):
                t = sums[r, g]
                for k in range(whole, k_in):
                    t += widen(x[m + r, k]) * widen(weight[n + g, k])
                if bias.shape[0] > 0:
                    t += widen(bias[n + g])
                out[m + r, n + g] = narrow_bits(t)


@njit(inline="always")
def _totals(s0, s1, s2, s3):  # pragma: no cover - compiled
    """The lanes' totals of four sums (:func:`.lanes.total`)."""
    return lanes.total(s0), lanes.total(s1), lanes.total(s2), lanes.total(s3)


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def _singles(x, weight, weights, bias, out, flat, m, lo, hi, chunks, first):  # pragma: no cover - compiled
    """Outputs ``[m, lo:hi]`` of :func:`linear_quads` (a row past the last quad), as :func:`_quads`."""
    k_in = weight.shape[1]
    whole = chunks * 32
    sums = np.empty(GROUP, np.float32)
    for n in range(lo, hi, GROUP):
        at = n * k_in
        a0, a1, a2, a3 = lanes.splat(0.0), lanes.splat(0.0), lanes.splat(0.0), lanes.splat(0.0)
        for c in range(chunks):
            k = 32 * c
            if first:
                for line in range(GROUP):
                    prefetch(weights, at + AHEAD + GROUP * k + 32 * line)
            i = m * whole + k
            xo, xe = lanes.load(flat, i), lanes.load(flat, i + 16)
            w = lanes.load(weights, at + k)
            a0 = lanes.fma(lanes.even(w), xe, lanes.fma(lanes.odd(w), xo, a0))
            w = lanes.load(weights, at + k_in + k)
            a1 = lanes.fma(lanes.even(w), xe, lanes.fma(lanes.odd(w), xo, a1))
            w = lanes.load(weights, at + 2 * k_in + k)
            a2 = lanes.fma(lanes.even(w), xe, lanes.fma(lanes.odd(w), xo, a2))
            w = lanes.load(weights, at + 3 * k_in + k)
            a3 = lanes.fma(lanes.even(w), xe, lanes.fma(lanes.odd(w), xo, a3))
        sums[0], sums[1], sums[2], sums[3] = _totals(a0, a1, a2, a3)
        for g in range(GROUP):
            t = sums[g]
            for k in range(whole, k_in):
                t += widen(x[m, k]) * widen(weight[n + g, k])
            if bias.shape[0] > 0:
                t += widen(bias[n + g])
            out[m, n + g] = narrow_bits(t)


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def linear_quads_at(x_address, rows, weight, bias, out_address):  # pragma: no cover - compiled
    """:func:`linear_quads` of ``x`` and ``out`` at the addresses given (:func:`views`)."""
    x, out = views(x_address, rows, weight, out_address)
    linear_quads(x, weight, bias, out)


@njit(inline="always")
def _finish(x, weight, bias, out, m, n, whole, s):  # pragma: no cover - compiled
    """``out[m, n]``: the lanes' total ``s``, plus the products past ``whole`` and the bias, rounded."""
    for k in range(whole, x.shape[1]):
        s += widen(x[m, k]) * widen(weight[n, k])
    if bias.shape[0] > 0:
        s += widen(bias[n])
    out[m, n] = rounded(s, out)


@njit(fastmath={"contract"}, cache=True, boundscheck=False, nogil=True, error_model="numpy")
def tiled_rows(x, tiles, block, bias, out):  # pragma: no cover - compiled
    """``out = x @ weight.T + bias`` (float32) from ``tiles[ceil(N / T), K, T]``: per output, fused
    multiply-adds in the order of ``k`` from zero within each block of ``block``, the blocks' sums
    added in order, then the bias (oneDNN's order: contraction is the only liberty taken)."""
    rows, k_in = x.shape
    width, n_out = tiles.shape[2], out.shape[1]
    total = np.empty((rows, width), np.float32)
    part = np.empty((rows, width), np.float32)
    for t in range(tiles.shape[0]):
        for lo in range(0, k_in, block):
            part[:] = 0.0
            for k in range(lo, min(k_in, lo + block)):
                w = tiles[t, k]
                for m in range(rows):
                    xm = x[m, k]
                    for j in range(width):
                        part[m, j] += xm * w[j]
            if lo == 0:
                total[:] = part
            else:
                for m in range(rows):
                    for j in range(width):
                        total[m, j] += part[m, j]
        for m in range(rows):
            for j in range(min(width, n_out - t * width)):
                out[m, t * width + j] = total[m, j] + bias[t * width + j] if bias.shape[0] else total[m, j]


@njit(fastmath={"reassoc", "nsz"}, cache=True, boundscheck=False, nogil=True, error_model="numpy")
def rms_norm(x, weight, eps, out):  # pragma: no cover - compiled
    """``out[t] = weight * round(x[t] / sqrt(mean(x[t]**2) + eps))``, rounded (see the module)."""
    rows, dim = x.shape
    row = np.empty(dim, np.float32)
    for t in range(rows):
        total = np.float32(0.0)
        for d in range(dim):
            v = widen(x[t, d])
            row[d] = v
            total += v * v
        mean = total * (np.float32(1.0) / np.float32(dim))
        inverse = np.float32(1.0) / np.sqrt(mean + np.float32(eps))
        for d in range(dim):
            normed = widen(rounded(row[d] * inverse, out))
            out[t, d] = rounded(widen(weight[d]) * normed, out)
