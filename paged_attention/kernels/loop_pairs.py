"""bfloat16 products of many rows on a CPU that multiplies bfloat16 pairs (AVX512-BF16): a 4x4 tile.

:func:`.loop_rows.linear_groups` takes each input row alone: the four weight rows of a group are
loaded again for every input row (from the L1 cache), two loads per pair instruction, so from
about six rows it is slower than oneDNN's packed product. Here four input rows pass over four
weight rows at once: per 32 columns, four weight vectors and four input vectors are loaded and
multiplied into 16 sums held in registers (:func:`.lanes.dot`, one ``vdpbf16ps`` each), half a
load per instruction. Each output is still summed alone, in :func:`.loop_rows.linear_groups`'
order (lane ``j`` over the pairs ``k = 32 i + 2 j + 1, 32 i + 2 j``, ``i`` rising; the lanes'
total; the last ``K % 32`` products; the bias; rounded once), so **the same bits**: a row gets the
bits it gets alone, however many rows are beside it.

* ``linear_pairs(x, weight, grouped, bias, out)``: ``out = x @ weight.T + bias`` of bfloat16 bits,
  ``grouped = loop_rows.group(weight)``; four rows at a time (the last four padded with zero
  rows, whose outputs are not kept: six rows cost eight, the weights still read once); fewer
  than four rows, and the weight rows past the last ``GROUP``, by :func:`.loop_rows.linear_groups`.
* ``linear_pairs_at(x_address, rows, weight, grouped, bias, out_address)``: the same by address.

The weights stream from memory once per :data:`BLOCK_ROWS` input rows; while each four rows read
a group, the weights :data:`AHEAD` elements further on are asked for into the L2 cache (on this
project's AMD EPYC, 16 rows over SmolLM2's lm_head: 95 GFLOP/s without; 139 asked for by the
first four rows alone, as fast as from the L3 cache; 161 by every four). A K below 32 (no
grouped copy) goes to :func:`.loop_rows.linear_groups` too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from numba import njit

from . import lanes, loop_rows
from .lanes import prefetch_l2
from .loop_nest import stamp, widen
from .loop_rows import GROUP, _finish, linear_groups, views

stamp(Path(__file__))
stamp(Path(__file__), Path(lanes.__file__))  # the vector lanes are compiled into these loops too
stamp(Path(__file__), Path(loop_rows.__file__))  # and the row loop, for the rows past the quads

#: Input rows that pass over the weights before the next such block: their bits stay in the L2
#: cache (64 rows of K = 1,536: 192 KiB), and the weights are read once per block.
BLOCK_ROWS = 64
#: How far ahead of the group being read the first four rows ask for the weights, in elements
#: (32 KiB; 16 and 64 KiB measured the same on the AMD EPYC, 4 KiB slower).
AHEAD = 16384


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def linear_pairs(x, weight, grouped, bias, out):  # pragma: no cover - compiled
    """``out = x @ weight.T + bias`` for ``x[M, K]``, ``weight[N, K]`` (C order), ``bias[N]``
    (length 0: none), bfloat16 bits, ``grouped = loop_rows.group(weight)``: the bits of
    :func:`.loop_rows.linear_groups` (see the module)."""
    rows, k_in = x.shape
    n_out = weight.shape[0]
    grouped_rows = n_out // GROUP * GROUP
    whole = k_in // 32 * 32
    if rows < 4 or grouped.shape[0] == 0:  # (fewer rows: each alone reads the weights as fast)
        linear_groups(x, weight, grouped, bias, out)
        return
    quads = (rows + 3) // 4 * 4  # (the last four padded with rows of zeros, their outputs not kept)
    width = (k_in + 31) // 32 * 32  # (each input row on 64-byte lines)
    inputs = lanes.aligned((min(quads, BLOCK_ROWS), width), np.uint16)
    biases = np.empty((grouped_rows // GROUP, 4, GROUP), np.float32)  # per group: its bias, 4 times
    for n in range(grouped_rows if bias.shape[0] > 0 else 0):
        biases[n // GROUP, :, n % GROUP] = widen(bias[n])
    biases = biases.reshape(-1)
    for lo in range(0, quads, BLOCK_ROWS):
        hi = min(quads, lo + BLOCK_ROWS)
        inputs[: min(rows, hi) - lo, :k_in] = x[lo:hi]
        inputs[min(rows, hi) - lo :] = 0
        for n in range(0, grouped_rows, GROUP):
            _quads(x, weight, grouped, bias, biases, out, inputs, lo, hi, n, whole)
    if grouped_rows < n_out:  # the last N % GROUP weight rows, each input row alone
        tail = bias[grouped_rows:] if bias.shape[0] > 0 else bias
        linear_groups(x, weight[grouped_rows:], grouped[:0], tail, out[:, grouped_rows:])


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def _quads(x, weight, grouped, bias, biases, out, inputs, lo, hi, n, whole):  # pragma: no cover - compiled
    """Outputs ``[lo:hi, n:n+GROUP]`` (the rows ``x`` has): each four rows of ``inputs`` (rows
    ``lo:hi`` of ``x``, aligned, zeros past its last) against the group of weight rows at ``n``,
    16 sums in registers. Its own function,
    every output finished here (as :func:`.loop_rows._quads`, for the same reason: the sums stay
    in registers)."""
    rows, k_in = x.shape
    width = inputs.shape[1]
    flat = inputs.reshape(-1)
    at = n * whole
    sums = np.empty(16, np.float32)
    bits = sums.view(np.uint32)
    for m in range(lo, hi, 4):
        a00, a01, a02, a03 = lanes.splat(0.0), lanes.splat(0.0), lanes.splat(0.0), lanes.splat(0.0)
        a10, a11, a12, a13 = lanes.splat(0.0), lanes.splat(0.0), lanes.splat(0.0), lanes.splat(0.0)
        a20, a21, a22, a23 = lanes.splat(0.0), lanes.splat(0.0), lanes.splat(0.0), lanes.splat(0.0)
        a30, a31, a32, a33 = lanes.splat(0.0), lanes.splat(0.0), lanes.splat(0.0), lanes.splat(0.0)
        for k in range(0, whole, 32):
            i = at + GROUP * k
            for line in range(GROUP):  # (every four rows ask: measured faster than the first alone)
                prefetch_l2(grouped, i + AHEAD + 32 * line)
            w0, w1 = lanes.load(grouped, i), lanes.load(grouped, i + 32)
            w2, w3 = lanes.load(grouped, i + 64), lanes.load(grouped, i + 96)
            j = (m - lo) * width + k
            a00, a01, a02, a03 = _dots(a00, a01, a02, a03, w0, w1, w2, w3, lanes.load(flat, j))
            a10, a11, a12, a13 = _dots(a10, a11, a12, a13, w0, w1, w2, w3, lanes.load(flat, j + width))
            a20, a21, a22, a23 = _dots(a20, a21, a22, a23, w0, w1, w2, w3, lanes.load(flat, j + 2 * width))
            a30, a31, a32, a33 = _dots(a30, a31, a32, a33, w0, w1, w2, w3, lanes.load(flat, j + 3 * width))
        t = lanes.totals((a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33))
        if whole == k_in:  # (the usual case: the bias and the rounding in lanes too)
            if bias.shape[0] > 0:
                t = t + lanes.load(biases, 4 * n)
            lanes.store(bits, 0, lanes.narrowed(t))
            for r in range(min(4, rows - m)):
                for g in range(GROUP):
                    out[m + r, n + g] = bits[4 * r + g] >> 16
            continue
        lanes.store(sums, 0, t)  # (K % 32 left: the row loop's last steps, rare, so through its helper)
        for r in range(min(4, rows - m)):
            for g in range(GROUP):
                _finish(x, weight, bias, out, m + r, n + g, whole, sums[4 * r + g])


@njit(inline="always")
def _dots(a0, a1, a2, a3, w0, w1, w2, w3, v):  # pragma: no cover - compiled
    """Four sums, each plus its weight's pairs with the input's ``v`` (:func:`.lanes.dot`)."""
    return lanes.dot(a0, w0, v), lanes.dot(a1, w1, v), lanes.dot(a2, w2, v), lanes.dot(a3, w3, v)


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def linear_pairs_at(x_address, rows, weight, grouped, bias, out_address):  # pragma: no cover - compiled
    """:func:`linear_pairs` of ``x`` and ``out`` at the addresses given (:func:`.loop_rows.views`)."""
    x, out = views(x_address, rows, weight, out_address)
    linear_pairs(x, weight, grouped, bias, out)
