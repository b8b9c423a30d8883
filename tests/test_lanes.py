"""The 16-lane vector values of :mod:`paged_attention.kernels.lanes`: each operation lane by lane
against NumPy (and torch's bfloat16 rounding), exact even inside a fast-math function, and scratch
arrays that start on a 64-byte line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

lanes = pytest.importorskip("paged_attention.kernels.lanes")
numba = pytest.importorskip("numba")


@numba.njit(boundscheck=False)
def _apply(a, b, limits, t, out):  # pragma: no cover - compiled
    x, y = lanes.load(a, 0), lanes.load(b, 16)  # an offset into the second array
    lanes.store(out, 0, x + y)
    lanes.store(out, 16, x - y)
    lanes.store(out, 32, x * y)
    lanes.store(out, 48, lanes.maximum(x, y))
    lanes.store(out, 64, lanes.rounded(x))
    lanes.store(out, 80, lanes.keep(x, limits, t, lanes.splat(-7.0)))


@pytest.mark.parametrize("t", [0, 5, 40])
def test_each_operation_acts_lane_by_lane_as_numpy_does(t):
    generator = np.random.default_rng(t)
    a = (generator.standard_normal(16) * 30).astype(np.float32)
    a[:4] = [1.00390625, 1.01171875, -2.0, 0.0]  # bfloat16 ties: to even, down then up
    b = generator.standard_normal(32).astype(np.float32)
    limits = generator.integers(0, 10, 16).astype(np.int32)
    out = np.zeros(96, np.float32)
    _apply(a, b, limits, t, out)
    y = b[16:]
    np.testing.assert_array_equal(out[:16], a + y)
    np.testing.assert_array_equal(out[16:32], a - y)
    np.testing.assert_array_equal(out[32:48], a * y)
    np.testing.assert_array_equal(out[48:64], np.maximum(a, y))
    np.testing.assert_array_equal(out[64:80], torch.from_numpy(a).bfloat16().float().numpy())
    np.testing.assert_array_equal(out[80:96], np.where(t < limits, a, np.float32(-7.0)))


@numba.njit(boundscheck=False)
def _powers(x, out):  # pragma: no cover - compiled
    for i in range(0, x.size, 16):
        lanes.store(out, i, lanes.power2(lanes.load(x, i)))


def test_power2_is_within_float32_precision_of_two_to_the_x_down_to_the_least_normal():
    generator = np.random.default_rng(0)
    x = -np.concatenate([np.linspace(0, 140, 1600), generator.uniform(0, 20, 1600)]).astype(np.float32)
    out = np.empty_like(x)
    _powers(x, out)
    exact = np.exp2(np.maximum(x.astype(np.float64), -126.0))
    assert np.abs(out / exact - 1).max() < 3e-7
    assert out[0] == 1.0  # 2**0 exactly: a running maximum that did not move rescales by 1


@numba.njit(fastmath=True, boundscheck=False)
def _cancel(x, big, out):  # pragma: no cover - compiled
    v, b = lanes.load(x, 0), lanes.splat(big)
    lanes.store(out, 0, (v + b) - b)
    lanes.store(out, 16, v * v - lanes.splat(np.float32(1.0 + 2.0**-11)))


def test_a_fast_math_function_may_not_reorder_or_fuse_the_lanes_arithmetic():
    """Reassociated, ``(x + big) - big`` would be ``x``; as written in float32 it is 0. Fused into
    one multiply-add, ``(1 + 2**-12)**2 - (1 + 2**-11)`` would keep the product's last bit, 2**-24;
    rounded first, as written, it is 0."""
    out = np.full(32, np.nan, np.float32)
    _cancel(np.ones(16, np.float32), np.float32(1e8), out)
    np.testing.assert_array_equal(out[:16], np.zeros(16, np.float32))
    _cancel(np.full(16, 1.0 + 2.0**-12, np.float32), np.float32(1e8), out)
    np.testing.assert_array_equal(out[16:], np.zeros(16, np.float32))


@numba.njit
def _scratch(n):  # pragma: no cover - compiled
    a = lanes.aligned((n, 16), np.float32)
    b = lanes.aligned((3, n, 7), np.uint16)
    return a.ctypes.data % 64, b.ctypes.data % 64, a.shape, b.shape, a.sum(), b.sum()


@pytest.mark.parametrize("n", [1, 5, 33])
def test_scratch_arrays_start_on_a_64_byte_line_and_hold_zeros(n):
    assert _scratch(n) == (0, 0, (n, 16), (3, n, 7), 0.0, 0)


def _dots():
    @numba.njit(boundscheck=False)
    def dots(a, b, start, out):  # pragma: no cover - compiled
        acc = lanes.load(start, 0)
        for i in range(0, a.size, 32):
            acc = lanes.dot(acc, lanes.load(a, i), lanes.load(b, i))
        lanes.store(out, 0, lanes.fma(acc, acc, acc))
        out[16] = lanes.total(acc)

    return dots


def _expected_dots(a, b, start):
    """lanes.dot's contract in float64 steps rounded to float32 (the products are exact)."""
    acc = start.astype(np.float32)
    wa, wb = (torch.from_numpy(v.view(np.int16)).view(torch.bfloat16).double().numpy() for v in (a, b))
    for i in range(0, a.size, 32):
        for first in (1, 0):  # the odd element of each pair first, then the even one
            products = wa[i + first : i + 32 : 2] * wb[i + first : i + 32 : 2]
            acc = (acc.astype(np.float64) + products).astype(np.float32)
    return acc


@pytest.mark.parametrize("paired", [True, False])
def test_dot_adds_the_pairs_odd_first_rounding_each_step_with_or_without_the_bf16_instruction(
    monkeypatch, paired
):
    """Both codings of :func:`dot` (AVX512-BF16's instruction where this CPU has it, and fused
    multiply-adds) give the contract's bits; :func:`total` sums the halves in its fixed order."""
    if paired and not lanes.paired():
        pytest.skip("this CPU has no AVX512-BF16")
    monkeypatch.setattr(lanes, "paired", lambda: paired)
    generator = np.random.default_rng(1)
    wide = (generator.standard_normal((2, 32 * 8)) * np.array([[1.0], [300.0]])).astype(np.float32)
    a, b = (torch.from_numpy(w).bfloat16().view(torch.int16).numpy().view(np.uint16) for w in wide)
    start = generator.standard_normal(16).astype(np.float32) * 1000  # large: the roundings show
    out = np.zeros(17, np.float32)
    _dots()(a, b, start, out)
    acc = _expected_dots(a, b, start)
    np.testing.assert_array_equal(out[:16], (acc.astype(np.float64) ** 2 + acc).astype(np.float32))
    halves = acc.copy()
    for n in (8, 4, 2, 1):
        halves = (halves[:n] + halves[n : 2 * n]).astype(np.float32)
    assert out[16] == halves[0]


@numba.njit(boundscheck=False)
def _narrowed(x, bits, spread, stored):  # pragma: no cover - compiled
    lanes.store(bits, 0, lanes.narrowed(lanes.load(x, 0)))
    lanes.store(spread, 0, lanes.pair(stored, 3))
    lanes.put(stored, 8, lanes.narrowed(lanes.load(x, 0)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_narrowed_is_torchs_rounding_and_pair_and_put_move_bfloat16_bits(seed):
    """``narrowed`` puts each lane's bfloat16 bits (torch's rounding, ties to even, NaN as 0x7FC0)
    in its high half; ``put`` stores those 16 halves, nothing beside them; ``pair`` reads the 32
    bits at an element (unaligned) into every lane."""
    generator = np.random.default_rng(seed)
    x = (generator.standard_normal(16) * 10.0 ** generator.integers(-8, 9, 16)).astype(np.float32)
    x[:6] = [1.00390625, 1.01171875, np.inf, -np.inf, np.nan, 3.0e38]  # ties, specials, near overflow
    bits, spread = np.zeros(16, np.uint32), np.zeros(16, np.uint32)
    stored = np.arange(32, dtype=np.uint16)
    _narrowed(x, bits, spread, stored)
    expected = torch.from_numpy(x).bfloat16().view(torch.int16).numpy().view(np.uint16)
    expected = np.where(np.isnan(x), np.uint16(0x7FC0), expected)
    np.testing.assert_array_equal(bits >> 16, expected)
    assert not (bits & 0xFFFF).any()
    assert (spread == (4 << 16 | 3)).all()  # (elements 3 and 4, little-endian)
    np.testing.assert_array_equal(stored[8:24], expected)
    np.testing.assert_array_equal(stored[:8], np.arange(8))  # (nothing beside the 16 written)
    np.testing.assert_array_equal(stored[24:], np.arange(24, 32))
