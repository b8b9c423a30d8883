"""Check of the quantized-pages exercise (notebook 11): a block quantized to int8 with one scale per
KV head, compared with the package's oracle
(:func:`paged_attention.kernels.quantization.store_block_scaled`) on named and random cases, with a
hint for each likely mistake."""

from __future__ import annotations

import random
from typing import Any

import torch

from ..kernels.quantization import StoreMap, store_block_scaled
from .checking import expect
from .student import Student, driver


@driver
def block_run(state: dict, objects: tuple, block: list) -> Any:
    """The student's ``quantize_block(block)``: its values and scales, as lists."""
    x = torch.tensor(block, dtype=torch.float32)
    values, scales = objects[0](x.clone())
    if not isinstance(values, torch.Tensor) or not isinstance(scales, torch.Tensor):
        return f"quantize_block returned {type(values).__name__}, {type(scales).__name__}, not two tensors"
    if values.dtype != torch.int8 or tuple(values.shape) != tuple(x.shape):
        got = f"{values.dtype} {list(values.shape)}"
        return f"values must be int8 of the block's shape {list(x.shape)}, got {got}"
    return [values.tolist(), [round(float(s), 9) for s in scales.flatten()]]


def reference(block: list) -> list:
    """The oracle: the engine's own int8 store of a fresh block, then its dequantization."""
    x = torch.tensor(block, dtype=torch.float32)
    block_size, heads, dim = x.shape
    cache = torch.zeros(1, block_size, heads, dim, dtype=torch.int8)
    scales = torch.zeros(1, heads)
    plan = StoreMap.build(torch.arange(block_size), block_size)
    store_block_scaled(x, cache, scales, plan)
    return [cache[0].tolist(), [round(float(s), 9) for s in scales[0]]]


def _variant(
    block: list, *, per_block: bool = False, rounding: str = "half_up", divisor: float = 127.0
) -> list:
    """Likely mistakes, computed the way a student would: one scale for the whole block, another
    rounding, another divisor."""
    x = torch.tensor(block, dtype=torch.float32)
    largest = x.abs().amax() if per_block else x.abs().amax(dim=(0, 2))
    scales = (largest / divisor).expand(x.shape[1]) if per_block else largest / divisor
    inverse = torch.where(scales > 0, 1.0 / scales, 0.0)[None, :, None]
    y = x * inverse
    q = {"half_up": torch.floor(y + 0.5), "even": torch.round(y), "truncate": torch.trunc(y)}[rounding]
    values = q.clamp(-127, 127).to(torch.int8)
    return [values.tolist(), [round(float(s), 9) for s in scales]]


def _case(rng: random.Random) -> list:
    block_size, heads, dim = rng.randint(1, 16), rng.randint(1, 4), rng.randint(1, 8)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    x = torch.randn(block_size, heads, dim, generator=gen) * rng.choice([0.01, 1.0, 30.0])
    if heads > 1 and rng.random() < 0.3:
        x[:, rng.randrange(heads)] *= 20  # an outlier head
    if rng.random() < 0.2:
        x[:, rng.randrange(heads)] = 0.0  # a head of zeros
    return x.tolist()


NAMED = [
    ("one head: the largest |x| is 127 steps of the scale", [[[127.0, 2.5, -2.5, 1.7, -1.7]]]),
    ("a half step rounds up, as floor(x / scale + 0.5): 2.5 -> 3, -2.5 -> -2", [[[127.0, 2.5, -2.5, -0.5]]]),
    ("two heads, each its own scale", [[[254.0, 1.0], [1.27, -0.635]], [[-127.0, 100.0], [0.0, 0.01]]]),
    ("a head of zeros: scale 0, values 0 (no NaN)", [[[0.0, 0.0], [3.0, -1.0]]]),
]


def quantize_block(student: Student, seed: int = 0, thorough: bool = False) -> int:
    """``quantize_block(block) -> (values, scales)``: int8 values of the block's shape, float32 scales
    ``[num_kv_heads]``."""
    rng = random.Random(seed)
    cases = [*NAMED, *(("random", _case(rng)) for _ in range(30 if not thorough else 150))]
    for name, block in cases:
        shape = list(torch.tensor(block).shape)
        case = f"a block of shape {shape}" + ("" if name == "random" else f" ({name})")
        want = reference(block)
        got = student.call(case, "checks_quantization:block_run", block)
        hint = "each KV head's scale is its largest |x| over the block's rows and channels, over 127"
        if got == _variant(block, per_block=True) != want:
            hint = (
                "one scale per KV head, not one for the whole block (amax over rows and channels, per head)"
            )
        elif got == _variant(block, rounding="even") != want:
            hint = "halves round up here, floor(x / scale + 0.5), as the kernels do (torch.round: to even)"
        elif got == _variant(block, rounding="truncate") != want:
            hint = "round to the nearest step, don't truncate: floor(x / scale + 0.5), then .to(torch.int8)"
        elif got == _variant(block, divisor=128.0) != want or got == _variant(block, divisor=255.0) != want:
            hint = "int8 is symmetric here, -127..127: the scale is max|x| / 127"
        elif isinstance(got, list) and any(s != s for s in got[1]):
            hint = "a head of zeros has scale 0: its values are 0 (guard the division), not NaN"
        expect(case, want, got, hint)
    return len(cases)
