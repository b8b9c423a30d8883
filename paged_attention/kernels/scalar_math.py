"""Scalar float32 helpers that Numba inlines into the compiled loops of :mod:`.loop_nest`:
bfloat16 -> float32 by its bits, and an ``exp`` built from arithmetic only.

libm's ``expf`` and ``floorf`` are calls, one per element, that stop LLVM from vectorizing a loop;
:func:`exp` uses the textbook range reduction ``e**x = 2**n * e**r`` (``n`` the nearest integer to
``x / ln 2``, ``|r| <= ln(2) / 2``) and Cephes' degree-6 polynomial for ``e**r``: within 2 float32
ulps over the clamped range, and every step vectorizes.
"""

from __future__ import annotations

import numpy as np
from numba import njit


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
