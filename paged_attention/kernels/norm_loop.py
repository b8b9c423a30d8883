"""The RMSNorm loop that Numba compiles for the CPU (:mod:`.rows` calls it).

It replaces a chain of eager PyTorch operations, each a pass over memory and a dispatch of its
own, by one pass per row. All arrays are NumPy; bfloat16 arrives as its raw 16 bits (``uint16``).

* ``rms_norm(x, weight, eps, out)``: ``x[T, D]``, ``weight[D]``, ``out[T, D]`` of one kind (float32,
  or bfloat16 bits). The arithmetic and roundings of transformers' ``LlamaRMSNorm``: the row widened
  to float32, ``y = x * (1 / sqrt(mean(x**2) + eps))``, ``y`` rounded to the input dtype, then
  multiplied by the weight and rounded again. The mean is summed in another order than torch's
  (a few float32 ulps apart, as any two vector reductions).

The helpers live in this file on purpose: Numba's disk cache checks only the source file of the
cached function, so an edited helper imported from another file would go unnoticed.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload


@njit(inline="always")
def widen_bits(bits):
    """bfloat16 bits (``uint16``) -> float32, exactly: they are the float32's top half."""
    return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)


@njit(inline="always")
def narrow_bits(x):
    """float32 -> bfloat16 bits, rounded to nearest, ties to even (torch's rounding); NaN stays NaN."""
    bits = np.float32(x).view(np.uint32)
    if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16(0x7FC0)
    bias = ((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    return np.uint16((bits + bias) >> np.uint32(16))


def widen(x):
    """An element as float32 (Python stand-in; compiled code uses the overload below)."""
    return x


@overload(widen)
def _widen(x):
    if isinstance(x, types.Integer):
        return lambda x: widen_bits(x)
    return lambda x: np.float32(x)


def rounded(x, like):
    """float32 ``x`` rounded to the element kind of the array ``like`` (stand-in; see below)."""
    return x


@overload(rounded)
def _rounded(x, like):
    if isinstance(like.dtype, types.Integer):  # bfloat16 bits: round, and keep the bits
        return lambda x, like: narrow_bits(x)
    return lambda x, like: np.float32(x)


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
        mean = total * (np.float32(1.0) / np.float32(dim))  # torch's mean: the sum times 1 / n
        inverse = np.float32(1.0) / np.sqrt(mean + np.float32(eps))
        for d in range(dim):
            normed = widen(rounded(row[d] * inverse, out))
            out[t, d] = rounded(widen(weight[d]) * normed, out)
