"""bfloat16 products on a CPU that multiplies bfloat16 pairs (AVX512-BF16): one lane per output column.

:func:`.loop_rows.linear_groups` sums each output across 16 lanes (lane ``j`` takes the pairs
``32 i + 2 j``), so every output ends in a horizontal total, and each input row re-reads the
weights. Here a lane is an output *column*: the weights are arranged (:func:`arrange`) so that one
64-byte vector holds, for 16 output columns, one pair of their weights (``w[n, 2p]``,
``w[n, 2p + 1]``); the input row's pair ``x[2p], x[2p + 1]`` is broadcast to every lane, and one
``vdpbf16ps`` (:func:`.lanes.dot`) adds both products to all 16 sums. No totals at all. A tile is
up to 12 input rows against 32 columns (two vectors): 24 sums in registers, two weight loads per 24
pair instructions; each block of 32 columns' weights streams from memory once per
:data:`BLOCK_ROWS` rows (the processor's prefetcher follows it: asking for lines ahead measured
slower, 150 against 176 GFLOP/s at 12 rows), then from the L2 cache for the block's next tiles.

**The bits.** Each output is one float32 sum over the pairs in order (``p`` rising; within a pair,
``x[2p + 1] w[n, 2p + 1]`` first, as :func:`.lanes.dot`), starting from zero, each step a fused
multiply-add (the exact product added, then rounded to float32); then the bias; then rounded once
to bfloat16 (nearest even, NaN as ``0x7FC0``). That order does not depend on the rows
beside it nor on which tile took it (rows are padded with zeros, their outputs not kept), so **a
row gets the bits it gets alone**: the batch-invariant mode's promise. The bits differ from the row
loop's (another order of sums) and from oneDNN's, within a rounding or two; subnormal values count
as zero where :func:`.lanes.dot` is the instruction itself.

* ``arrange(weight)``: the copy the loop reads, ``[ceil(N / 32), ceil(K / 2), 2, 16, 2]`` (flat,
  on a 64-byte line; the columns past ``N`` and the element past an odd ``K`` are zeros);
* ``linear_columns(x, arranged, bias, out)``: ``out = x @ weight.T + bias``, bfloat16 bits;
* ``linear_columns_at(x_address, rows, weight, arranged, bias, out_address)``: by address.

Measured on this project's 2-core AMD EPYC (Zen 4), one thread, SmolLM2-135M's 121 products in
a row (the weights from memory), ms, this loop / the row loop / oneDNN's packed product, in one run:
1 row 11.3 / 11.4 / 20.9; 4 rows 12.5 / 15.9 / 18.9; 16 rows 25.3 / - / 32.8 (170 GFLOP/s; the
four-row tile of the grouped copy this replaced took 28-30 in runs beside it); 64 rows 93.0 / - /
96.9 (185 GFLOP/s; the instruction's peak on one core, measured alone: ~233).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from . import lanes, loop_rows
from .loop_nest import stamp, widen
from .loop_rows import views

stamp(Path(__file__))
stamp(Path(__file__), Path(lanes.__file__))  # the vector lanes are compiled into these loops too
stamp(Path(__file__), Path(loop_rows.__file__))  # and the row loop's views (linear_columns_at)

#: Output columns per block: two vectors of 16 lanes.
COLUMNS = 32
#: Input rows per pass over the weights (their bits stay in the L2 cache: 120 rows of K = 1,536 take
#: 360 KiB); more rows pass over the weights again.
BLOCK_ROWS = 120


@intrinsic
def _once(typingctx):
    """An empty instruction with side effects, first in each tile's loop: LLVM then leaves the loop
    as written. Without it the loop, optimized again where it is linked into :func:`linear_columns`,
    was unrolled and its 24 sums spilled to the stack: 2x slower (a process that compiled the
    loops ran the first copy, clean; one that loaded them from Numba's cache, the spilled one)."""

    def codegen(context, builder, signature, args):
        asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "", "", side_effect=True)
        builder.call(asm, [])
        return context.get_dummy_value()

    return types.void(), codegen


def arrange(weight):
    """The bits of ``weight[N, K]`` (``uint16``) as :func:`linear_columns` reads them (see the
    module): for each 32 columns, for each pair of ``K``, the 16 first columns' pairs, then the 16
    next. A copy, on a 64-byte line."""
    n_out, k_in = weight.shape
    wide, half = -(-n_out // COLUMNS) * COLUMNS, -(-k_in // 2)
    padded = np.zeros((wide, 2 * half), weight.dtype)
    padded[:n_out, :k_in] = weight
    raw = np.empty(padded.nbytes + 64, np.uint8)
    skip = (-raw.ctypes.data) % 64  # (as :func:`.lanes.aligned`, in Python)
    out = raw[skip : skip + padded.nbytes].view(weight.dtype)
    blocks = padded.reshape(wide // COLUMNS, 2, 16, half, 2).transpose(0, 3, 1, 2, 4)
    out.reshape(blocks.shape)[...] = blocks
    return out


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def linear_columns(x, arranged, bias, out):  # pragma: no cover - compiled
    """``out = x @ weight.T + bias`` for ``x[M, K]``, ``bias[N]`` (length 0: none), ``out[M, N]``,
    bfloat16 bits, ``arranged = arrange(weight)`` (see the module for the order of the sums)."""
    rows, k_in = x.shape
    n_out = out.shape[1]
    half = (k_in + 1) // 2
    blocks = (n_out + COLUMNS - 1) // COLUMNS  # (as arrange made them)
    width = 2 * half
    inputs = lanes.aligned((rows + 12, width), np.uint16)  # (zeros: an odd K's last pair, padded rows)
    inputs[:rows, :k_in] = x
    flat = inputs.reshape(-1)
    biases = np.zeros(blocks * COLUMNS, np.float32)
    for n in range(bias.shape[0]):
        biases[n] = widen(bias[n])
    whole = n_out // COLUMNS  # (blocks whose 32 columns are all kept; the last may keep fewer)
    target = out.reshape(-1)
    if rows == 1:  # (one row: two blocks at a time, four sums in flight)
        for b in range(0, whole - 1, 2):
            _one(flat, arranged, b, half, target, biases)
        if whole % 2 == 1:
            _four(flat, width, arranged, whole - 1, half, target, n_out, COLUMNS * (whole - 1), biases, 0, 1)
    else:
        for lo in range(0, rows, BLOCK_ROWS):
            hi = min(rows, lo + BLOCK_ROWS)
            for b in range(whole):
                _block(flat, width, arranged, b, half, target, n_out, COLUMNS * b, biases, lo, hi)
    if whole < blocks:  # the last columns, through a block of 32 aside
        aside = np.empty((rows + 12, COLUMNS), np.uint16)
        _block(flat, width, arranged, whole, half, aside.reshape(-1), COLUMNS, 0, biases, 0, rows)
        out[:, COLUMNS * whole :] = aside[:rows, : n_out - COLUMNS * whole]


@njit(boundscheck=False, nogil=True, error_model="numpy")
def _block(flat, width, arranged, b, half, out, stride, col, biases, lo, hi):  # pragma: no cover - compiled
    """Rows ``lo:hi`` against block ``b``, in tiles of 12, then 8 or 4 (padded), to ``out`` (rows
    ``stride`` apart) from column ``col``."""
    m = lo
    while m < hi:
        left = hi - m
        if left > 8:
            _twelve(flat, width, arranged, b, half, out, stride, col, biases, m, left)
            m += 12
        elif left > 4:
            _eight(flat, width, arranged, b, half, out, stride, col, biases, m, left)
            m += 8
        else:
            _four(flat, width, arranged, b, half, out, stride, col, biases, m, left)
            m += 4


@njit(inline="always")
def _two(a, c, w0, w1, flat, j):  # pragma: no cover - compiled
    """The two sums of one input row plus its pair at ``j`` times the two weight vectors."""
    v = lanes.pair(flat, j)
    return lanes.dot(a, w0, v), lanes.dot(c, w1, v)


@njit(inline="always")
def _keep(out, at, a, c, biases, b):  # pragma: no cover - compiled
    """One row's two vectors of sums plus block ``b``'s bias, rounded, to ``out[at : at + 32]``."""
    lanes.put(out, at, lanes.narrowed(a + lanes.load(biases, COLUMNS * b)))
    lanes.put(out, at + 16, lanes.narrowed(c + lanes.load(biases, COLUMNS * b + 16)))


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def _twelve(flat, width, arranged, b, half, out, stride, col, biases, m, left):  # pragma: no cover
    """Rows ``m : m + 12`` (the first ``left`` kept) against block ``b``: 24 sums in registers."""
    z = lanes.splat(0.0)
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = a8 = a9 = a10 = a11 = z
    c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = c8 = c9 = c10 = c11 = z
    at, row = b * half * 2 * COLUMNS, m * width
    for p in range(half):
        _once()
        w0, w1 = lanes.load(arranged, at + 64 * p), lanes.load(arranged, at + 64 * p + 32)
        j = row + 2 * p
        a0, c0 = _two(a0, c0, w0, w1, flat, j)
        a1, c1 = _two(a1, c1, w0, w1, flat, j + width)
        a2, c2 = _two(a2, c2, w0, w1, flat, j + 2 * width)
        a3, c3 = _two(a3, c3, w0, w1, flat, j + 3 * width)
        a4, c4 = _two(a4, c4, w0, w1, flat, j + 4 * width)
        a5, c5 = _two(a5, c5, w0, w1, flat, j + 5 * width)
        a6, c6 = _two(a6, c6, w0, w1, flat, j + 6 * width)
        a7, c7 = _two(a7, c7, w0, w1, flat, j + 7 * width)
        a8, c8 = _two(a8, c8, w0, w1, flat, j + 8 * width)
        a9, c9 = _two(a9, c9, w0, w1, flat, j + 9 * width)
        a10, c10 = _two(a10, c10, w0, w1, flat, j + 10 * width)
        a11, c11 = _two(a11, c11, w0, w1, flat, j + 11 * width)
    _keep(out, m * stride + col, a0, c0, biases, b)
    _keep(out, (m + 1) * stride + col, a1, c1, biases, b)
    _keep(out, (m + 2) * stride + col, a2, c2, biases, b)
    _keep(out, (m + 3) * stride + col, a3, c3, biases, b)
    _keep(out, (m + 4) * stride + col, a4, c4, biases, b)
    _keep(out, (m + 5) * stride + col, a5, c5, biases, b)
    _keep(out, (m + 6) * stride + col, a6, c6, biases, b)
    _keep(out, (m + 7) * stride + col, a7, c7, biases, b)
    _keep(out, (m + 8) * stride + col, a8, c8, biases, b)
    if left > 9:
        _keep(out, (m + 9) * stride + col, a9, c9, biases, b)
    if left > 10:
        _keep(out, (m + 10) * stride + col, a10, c10, biases, b)
    if left > 11:
        _keep(out, (m + 11) * stride + col, a11, c11, biases, b)


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def _eight(flat, width, arranged, b, half, out, stride, col, biases, m, left):  # pragma: no cover - compiled
    """Rows ``m : m + 8`` (the first ``left`` kept) against block ``b``: 16 sums."""
    z = lanes.splat(0.0)
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = z
    c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = z
    at, row = b * half * 2 * COLUMNS, m * width
    for p in range(half):
        _once()
        w0, w1 = lanes.load(arranged, at + 64 * p), lanes.load(arranged, at + 64 * p + 32)
        j = row + 2 * p
        a0, c0 = _two(a0, c0, w0, w1, flat, j)
        a1, c1 = _two(a1, c1, w0, w1, flat, j + width)
        a2, c2 = _two(a2, c2, w0, w1, flat, j + 2 * width)
        a3, c3 = _two(a3, c3, w0, w1, flat, j + 3 * width)
        a4, c4 = _two(a4, c4, w0, w1, flat, j + 4 * width)
        a5, c5 = _two(a5, c5, w0, w1, flat, j + 5 * width)
        a6, c6 = _two(a6, c6, w0, w1, flat, j + 6 * width)
        a7, c7 = _two(a7, c7, w0, w1, flat, j + 7 * width)
    _keep(out, m * stride + col, a0, c0, biases, b)
    _keep(out, (m + 1) * stride + col, a1, c1, biases, b)
    _keep(out, (m + 2) * stride + col, a2, c2, biases, b)
    _keep(out, (m + 3) * stride + col, a3, c3, biases, b)
    _keep(out, (m + 4) * stride + col, a4, c4, biases, b)
    if left > 5:
        _keep(out, (m + 5) * stride + col, a5, c5, biases, b)
    if left > 6:
        _keep(out, (m + 6) * stride + col, a6, c6, biases, b)
    if left > 7:
        _keep(out, (m + 7) * stride + col, a7, c7, biases, b)


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def _four(flat, width, arranged, b, half, out, stride, col, biases, m, left):  # pragma: no cover - compiled
    """Rows ``m : m + 4`` (the first ``left`` kept) against block ``b``: 8 sums."""
    z = lanes.splat(0.0)
    a0 = a1 = a2 = a3 = c0 = c1 = c2 = c3 = z
    at, row = b * half * 2 * COLUMNS, m * width
    for p in range(half):
        _once()
        w0, w1 = lanes.load(arranged, at + 64 * p), lanes.load(arranged, at + 64 * p + 32)
        j = row + 2 * p
        a0, c0 = _two(a0, c0, w0, w1, flat, j)
        a1, c1 = _two(a1, c1, w0, w1, flat, j + width)
        a2, c2 = _two(a2, c2, w0, w1, flat, j + 2 * width)
        a3, c3 = _two(a3, c3, w0, w1, flat, j + 3 * width)
    _keep(out, m * stride + col, a0, c0, biases, b)
    if left > 1:
        _keep(out, (m + 1) * stride + col, a1, c1, biases, b)
    if left > 2:
        _keep(out, (m + 2) * stride + col, a2, c2, biases, b)
    if left > 3:
        _keep(out, (m + 3) * stride + col, a3, c3, biases, b)


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def _one(flat, arranged, b, half, out, biases):  # pragma: no cover - compiled
    """The one input row against blocks ``b`` and ``b + 1``: four sums, so that the pair
    instructions' latency is hidden (two sums: 10.9 ms against 9.8 over SmolLM2's products)."""
    z = lanes.splat(0.0)
    a0 = a1 = a2 = a3 = z
    at, next_at = b * half * 2 * COLUMNS, (b + 1) * half * 2 * COLUMNS
    for p in range(half):
        _once()
        v = lanes.pair(flat, 2 * p)
        a0 = lanes.dot(a0, lanes.load(arranged, at + 64 * p), v)
        a1 = lanes.dot(a1, lanes.load(arranged, at + 64 * p + 32), v)
        a2 = lanes.dot(a2, lanes.load(arranged, next_at + 64 * p), v)
        a3 = lanes.dot(a3, lanes.load(arranged, next_at + 64 * p + 32), v)
    _keep(out, COLUMNS * b, a0, a1, biases, b)
    _keep(out, COLUMNS * (b + 1), a2, a3, biases, b + 1)


@njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
def linear_columns_at(x_address, rows, weight, arranged, bias, out_address):  # pragma: no cover - compiled
    """:func:`linear_columns` of ``x`` and ``out`` at the addresses given (:func:`.loop_rows.views`)."""
    x, out = views(x_address, rows, weight, out_address)
    linear_columns(x, arranged, bias, out)
