"""The online softmax of 16 query columns at once, a float32 vector lane each (:mod:`.lanes`), over
one chunk of :data:`CHUNK` positions: the step :mod:`.loop_amx` takes between its two tile
products.

A column at a time, the softmax is vectorized along the positions: each column's maximum and sum
are reductions across a vector (shuffles), and the columns run one after another (0.1 us a
column, measured in the kernel). Across columns, a row of 16 scores (one position, 16 columns) is
one vector: the maximum and the sum are element-wise steps down the 32 rows, and one pass serves
16 columns (0.19 us). The scale is folded into the exponent (``e**(scale x) =
2**(scale log2(e) x)``), so the scores are read twice and never written.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import lanes
from .lanes import LANES

#: Positions a chunk of the sweep covers: one values' product (two tiles of 16) consumes 32.
CHUNK = 32


@njit(inline="always")
def _weight(scores, t, peak, factor, visible, zero):
    """Position ``t``'s weights, ``2**((s - peak) scale log2(e))`` rounded to bfloat16; 0 where
    the column may not see it."""
    x = lanes.power2((lanes.load(scores, t * LANES) - peak) * factor)
    return lanes.keep(lanes.rounded(x), visible, t, zero)


@njit(inline="always")
def soften(scores, visible, scale, best, total, weights):
    """One chunk's step of the online softmax for 16 query columns at once: ``scores[CHUNK * 16]``
    the chunk's raw scores (``S^T``, a row of 16 lanes per position), ``visible[c]`` (``int32``)
    how many of its positions lane ``c`` may see (the others get weight 0 and are never part of
    its maximum); ``best``/``total`` (16 each) the running maximum of the raw scores and the
    running sum, updated; ``weights[CHUNK * 16]`` the weights written, rounded to bfloat16 (the
    tiles' input). Returns what each lane's accumulator must be multiplied by first. A lane's
    result does not depend on the other lanes or on which lane it is: every lane runs the same
    instructions, none reordered or fused (:mod:`.lanes`), the sum in one order (four running
    sums, ``t % 4``, then ``(0 + 1) + (2 + 3)``)."""
    low, zero = lanes.splat(np.float32(-1e30)), lanes.splat(np.float32(0.0))
    factor = lanes.splat(np.float32(scale * 1.4426950408889634))  # e**(scale s) = 2**(scale log2(e) s)
    old = lanes.load(best, 0)
    peak = old
    for t in range(CHUNK):
        peak = lanes.maximum(peak, lanes.keep(lanes.load(scores, t * LANES), visible, t, low))
    lanes.store(best, 0, peak)
    rescale = lanes.power2((old - peak) * factor)
    s0, s1, s2, s3 = zero, zero, zero, zero
    for t in range(0, CHUNK, 4):
        w0 = _weight(scores, t, peak, factor, visible, zero)
        w1 = _weight(scores, t + 1, peak, factor, visible, zero)
        w2 = _weight(scores, t + 2, peak, factor, visible, zero)
        w3 = _weight(scores, t + 3, peak, factor, visible, zero)
        lanes.store(weights, t * LANES, w0)
        lanes.store(weights, (t + 1) * LANES, w1)
        lanes.store(weights, (t + 2) * LANES, w2)
        lanes.store(weights, (t + 3) * LANES, w3)
        s0, s1, s2, s3 = s0 + w0, s1 + w1, s2 + w2, s3 + w3
    lanes.store(total, 0, lanes.load(total, 0) * rescale + ((s0 + s1) + (s2 + s3)))
    return rescale
