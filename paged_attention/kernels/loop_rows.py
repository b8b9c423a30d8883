"""The row-wise loops Numba compiles for the CPU: few-row products and RMSNorm (:mod:`.rows`, :mod:`.tiled`).

All arguments are NumPy arrays (but the addresses ``linear_rows_at`` takes); bfloat16 arrives as its
raw 16 bits (``uint16``), float32 as itself.

* ``linear_rows(x, weight, bias, out)``: ``x[M, K] @ weight[N, K].T + bias[N]`` for a few rows
  (``bias`` of length 0: none), float32 sums in 16 lanes (:mod:`.lanes`), each weight row read from
  memory once: a matrix-vector product that streams the weights near the memory's pace.
* ``linear_rows_at(x_address, rows, weight, bias, out_address)``: the same, ``x`` and ``out``
  given by the addresses of C-order ``[rows, K]`` and ``[rows, N]`` bfloat16 (:class:`.rows.Streamed`
  calls it so: no NumPy views to make, ~10 us less a call).
* ``tiled_rows(x, tiles, block, bias, out)``: the same product in float32 from
  ``tiles[ceil(N / T), K, T]``, summed in oneDNN's order (:mod:`.tiled` says which).
* ``widened(bits, out)``: bfloat16 bits widened to float32, exactly (:mod:`.widened` multiplies
  with them where the CPU has no bfloat16 arithmetic).
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
from .loop_nest import address, prefetch, rounded, stamp, widen

stamp(Path(__file__))
stamp(Path(__file__), Path(lanes.__file__))  # the vector lanes are compiled into these loops too


#: Weight rows multiplied together: their vectors interleave, 4 independent sums in flight.
GROUP = 4
#: How far ahead of the rows being read the loop asks for the weights, in elements (16 KiB; on
#: SmolLM2's layers a pass of this loop alone took 0.76-0.85x oneDNN's time with it, 0.94x without:
#: a Xeon, one thread).
AHEAD = 8192


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def linear_rows(x, weight, bias, out):  # pragma: no cover - compiled
    """``out = x @ weight.T + bias`` for a few rows ``x[M, K]``, ``weight[N, K]`` (C order),
    ``bias[N]`` (length 0: none), all bfloat16 bits. Each output alone, so its bits do not depend
    on ``M``: lane ``j`` sums the products of ``k = 32 i + 2 j + 1`` then ``32 i + 2 j``, ``i``
    rising (:func:`.lanes.dot`); the lanes' total (:func:`.lanes.total`), then the last ``K % 32``
    products in order, then the bias; rounded once. The weights come from memory once for all
    ``M`` rows: ``GROUP`` rows at a time, ``M`` times over from the L1 cache."""
    rows, k_in = x.shape
    n_out = weight.shape[0]
    whole = k_in // 32 * 32
    row = (k_in + 31) // 32 * 32  # (each row of inputs on 64-byte lines: a vector, one line)
    inputs = lanes.aligned((rows, row), np.uint16)
    inputs[:, :k_in] = x
    flat = weight.reshape(-1)
    grouped = n_out // GROUP * GROUP
    for n in range(0, grouped, GROUP):
        at = n * k_in
        for m in range(rows):
            a0, a1, a2, a3 = lanes.splat(0.0), lanes.splat(0.0), lanes.splat(0.0), lanes.splat(0.0)
            for k in range(0, whole, 32):
                if m == 0:  # the lines that hold as many elements a little further on
                    for line in range(GROUP):
                        prefetch(flat, at + AHEAD + GROUP * k + 32 * line)
                v = lanes.load(inputs, m * row + k)
                a0 = lanes.dot(a0, lanes.load(flat, at + k), v)
                a1 = lanes.dot(a1, lanes.load(flat, at + k_in + k), v)
                a2 = lanes.dot(a2, lanes.load(flat, at + 2 * k_in + k), v)
                a3 = lanes.dot(a3, lanes.load(flat, at + 3 * k_in + k), v)
            _finish(x, weight, bias, out, m, n, whole, lanes.total(a0))
            _finish(x, weight, bias, out, m, n + 1, whole, lanes.total(a1))
            _finish(x, weight, bias, out, m, n + 2, whole, lanes.total(a2))
            _finish(x, weight, bias, out, m, n + 3, whole, lanes.total(a3))
    for n in range(grouped, n_out):  # the last N % GROUP rows, one at a time
        for m in range(rows):
            a0 = lanes.splat(0.0)
            for k in range(0, whole, 32):
                a0 = lanes.dot(a0, lanes.load(flat, n * k_in + k), lanes.load(inputs, m * row + k))
            _finish(x, weight, bias, out, m, n, whole, lanes.total(a0))


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def linear_rows_at(x_address, rows, weight, bias, out_address):  # pragma: no cover - compiled
    """:func:`linear_rows` of the C-order bfloat16 ``x[rows, K]`` and ``out[rows, N]`` at the
    addresses given (the caller keeps both alive and of that shape and kind)."""
    n_out, k_in = weight.shape
    x = carray(address(x_address), (rows, k_in), np.uint16)
    out = carray(address(out_address), (rows, n_out), np.uint16)
    linear_rows(x, weight, bias, out)


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


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def widened(bits, out):  # pragma: no cover - compiled
    """``out[i]``: the bfloat16 bits ``bits[i]`` as a float32 (exact: they are its top half); one
    vector shift per 16 values."""
    for i in range(bits.shape[0]):
        out[i] = widen(bits[i])


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
