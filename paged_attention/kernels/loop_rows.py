"""The row-wise loops Numba compiles for the CPU: few-row products and RMSNorm (:mod:`.rows`, :mod:`.tiled`).

All arguments are NumPy arrays; bfloat16 arrives as its raw 16 bits (``uint16``), float32 as itself.

* ``linear_rows(x, weight, bias, out)``: ``x[M, K] @ weight[N, K].T + bias[N]`` for a few rows
  (``bias`` of length 0: none), float32 sums, each weight row read once: a matrix-vector product
  that streams the weights at the memory's pace.
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
from numba import njit

from .loop_nest import rounded, stamp, widen

stamp(Path(__file__))


@njit(fastmath={"reassoc", "contract"}, cache=True, boundscheck=False, nogil=True, error_model="numpy")
def linear_rows(x, weight, bias, out):  # pragma: no cover - compiled
    """``out = x @ weight.T + bias`` for a few rows ``x[M, K]``, ``weight[N, K]``, ``bias[N]``
    (length 0: none): each weight row comes in from memory once for all ``M`` rows, float32 sums,
    rounded once."""
    rows, k_in = x.shape
    wide = np.empty((rows, k_in), np.float32)
    for m in range(rows):
        for k in range(k_in):
            wide[m, k] = widen(x[m, k])
    for n in range(weight.shape[0]):
        w = weight[n]
        for m in range(rows):
            a = np.float32(0.0)
            for k in range(k_in):
                a += widen(w[k]) * wide[m, k]
            if bias.shape[0] > 0:
                a += widen(bias[n])
            out[m, n] = rounded(a, out)


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
