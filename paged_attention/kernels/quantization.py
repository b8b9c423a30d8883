"""Quantized pages: the 8-bit KV-cache formats and their oracle, in plain PyTorch.

A quantized cache keeps each key and value in one byte and a *scale* beside it: the number that
turns the byte back into the value it stands for, ``value ~= stored * scale``. Which bytes and which
scale is the format, named as vLLM names it (``kv_cache_dtype``):

* ``"fp8"`` (= ``"fp8_e4m3"``): ``float8_e4m3fn`` (4 exponent bits, 3 mantissa bits, largest 448) and
  **one scale per layer for the keys and one for the values** ("per tensor", vLLM's). Stored:
  ``x / scale`` saturated to +-448 and rounded to the nearest e4m3 number; read: ``stored * scale``.
  The scale is 1.0 unless ``calculate_kv_scales`` sets it from the first batch the layer sees
  (:func:`calculated_scales`: the largest ``|k|`` over 200 and ``|v|`` over 100, older vLLM's rule).
* ``"fp8_e5m2"``: ``float8_e5m2`` (5 exponent bits, 2 mantissa bits, largest 57344), the same way.
* ``"int8"`` (this project's): ``int8`` with **one scale per block and KV head**, for keys and for
  values apart, kept beside the page (``scales[num_blocks, num_kv_heads]`` per layer). The scale is
  the largest ``|x|`` written into that block's head so far, over 127; stored: ``x * (1 / scale)``
  rounded, halves up (:func:`round_half_up`). A block fills over several steps, so the scale may have to
  grow: when a store brings a larger value, the rows already in the block are requantized to the new
  scale (``round(q * old / new)``: one more rounding, at most half a step of the new scale each
  time the scale grows, so a row's error can add up over several growths), and a
  store that writes a block's first offset starts it afresh (whatever the block held before belonged
  to someone else or to drafts that were refused). Each store call decides one scale per touched
  block and head from *all* the tokens it writes there, so a prompt's full blocks are rounded once.

Why a finer scale: one scale for a whole layer must cover its largest value anywhere (keys and
values have a few outlier channels, notebook 11 shows them), so small values get few levels; a
scale per block and head adapts to each 16-token page and each head, at 4 bytes per block, head, K
and V (at block size 16, a quarter of a byte per token, KV head and K or V, beside its 64 or 128
bytes of values).

Everything here is the oracle the kernels are checked against (:mod:`.reference` reads through
:func:`dequantize_blocks`; the Triton and compiled kernels do the same arithmetic in float32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: ``kv_cache_dtype`` values, vLLM's spelling ("auto": the model's dtype) and this project's "int8".
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
#: The formats that quantize, and the storage dtype of each.
STORAGE = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
QUANTIZED_DTYPES = (*FP8_DTYPES, torch.int8)
INT8_MAX = 127  # symmetric: -127..127 (-128 is never written)
K_SCALE_CONSTANT = 200  # calculate_kv_scales: k_scale = max|k| / 200 (vLLM's envs.K_SCALE_CONSTANT)
V_SCALE_CONSTANT = 100  # and v_scale = max|v| / 100


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a cache of format ``kv_cache_dtype`` holds its K/V in (``"auto"``: the model's)."""
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in STORAGE:
        return STORAGE[kv_cache_dtype]
    if getattr(torch, kv_cache_dtype) != model_dtype:  # attention computes in the model's dtype
        model = str(model_dtype).removeprefix("torch.")
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} differs from the model's dtype ({model}): a float cache "
            f"takes the model's, 'auto' (or {model!r}); 8-bit caches: {tuple(STORAGE)}"
        )
    return model_dtype


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED_DTYPES


def per_block(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` keeps a scale per block and KV head (int8) rather than per tensor."""
    return dtype == torch.int8


def scale_shape(dtype: torch.dtype, num_blocks: int, num_kv_heads: int) -> tuple[int, ...] | None:
    """The shape of one layer's key (or value) scales: ``()`` per tensor (fp8), ``(num_blocks,
    num_kv_heads)`` per block and head (int8), ``None`` for an unquantized cache."""
    if not is_quantized(dtype):
        return None
    return (num_blocks, num_kv_heads) if per_block(dtype) else ()


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def fp8_grid(dtype: torch.dtype) -> tuple[int, int]:
    """An fp8 format's mantissa bits and smallest normal exponent: e4m3 (3, -6), e5m2 (2, -14)."""
    info = torch.finfo(dtype)
    return round(-math.log2(info.eps)), round(math.log2(info.tiny))


def round_half_up(x: torch.Tensor) -> torch.Tensor:
    """``floor(x + 0.5)``: the rounding every int8 kernel here uses (the same bits on torch, NumPy,
    Numba and Triton, where ``round``'s ties-to-even is not one instruction everywhere)."""
    return torch.floor(x + 0.5)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` saturated to ``dtype``'s largest number and rounded to it (to nearest, ties to even)."""
    limit = fp8_max(dtype)
    inverse = 1.0 / torch.as_tensor(scale, dtype=torch.float32)
    return (x.float() * inverse).clamp(-limit, limit).to(dtype)


def dequantize(stored: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``stored * scale`` in float32 (``scale`` broadcast: a number, or per block and head)."""
    return stored.float() * torch.as_tensor(scale, dtype=torch.float32, device=stored.device)


def dequantize_blocks(
    cache_blocks: torch.Tensor, scales: torch.Tensor | None, block_ids: torch.Tensor
) -> torch.Tensor:
    """Blocks ``block_ids`` of a cache, gathered (``cache_blocks = cache[block_ids]``,
    ``[n, block_size, H_kv, D]``) and dequantized to float32 with their scales: per tensor (``[]``)
    or per block and head (``[num_blocks, H_kv]``, indexed by ``block_ids``). An unquantized cache
    (``scales`` None) comes back as it is."""
    if scales is None:
        return cache_blocks
    if scales.dim() == 0:
        return dequantize(cache_blocks, scales)
    return cache_blocks.float() * scales.index_select(0, block_ids)[:, None, :, None]


@dataclass(frozen=True)
class StoreMap:
    """Which new tokens a store writes into which block: the int8 store works block by block.

    ``blocks[n]`` int64, every block the store touches, once; ``tokens[n, block_size]`` int64, the
    index of the new token written at each offset of each block (``-1``: none; a block whose offset
    0 is written starts afresh). It depends only on the slot mapping, so the engine builds it once
    per step for every layer.
    """

    blocks: torch.Tensor
    tokens: torch.Tensor

    @classmethod
    def build(cls, slot_mapping: torch.Tensor, block_size: int) -> StoreMap:
        keep = (slot_mapping >= 0).nonzero().flatten()
        slots = slot_mapping[keep]
        blocks, inverse = torch.unique(slots // block_size, return_inverse=True)
        tokens = torch.full((blocks.shape[0], block_size), -1, dtype=torch.int64, device=slot_mapping.device)
        tokens[inverse, slots % block_size] = keep
        return cls(blocks, tokens)


def store_block_scaled(x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor, plan: StoreMap) -> None:
    """The int8 store of one of K or V (see the module docstring): ``x[tokens, H_kv, D]`` into
    ``cache[num_blocks, block_size, H_kv, D]`` int8, ``scales[num_blocks, H_kv]`` float32 updated."""
    if plan.blocks.numel() == 0:
        return
    new = (plan.tokens >= 0)[:, :, None, None]  # [n, block_size, 1, 1]
    rows = x.float()[plan.tokens.clamp(min=0)]  # [n, block_size, H_kv, D]
    largest = torch.where(new, rows.abs(), 0.0).amax(dim=(1, 3))  # [n, H_kv]
    fresh = plan.tokens[:, :1] >= 0  # [n, 1]: the store writes the block's offset 0
    old = torch.where(fresh, 0.0, scales[plan.blocks])
    scale = torch.maximum(old, largest / INT8_MAX)
    inverse = torch.where(scale > 0, 1.0 / scale, 0.0)
    ratio = (old * inverse)[:, None, :, None]
    kept = round_half_up(cache[plan.blocks].float() * ratio)  # the rows already there, on the new scale
    written = round_half_up(rows * inverse[:, None, :, None]).clamp(-INT8_MAX, INT8_MAX)
    cache[plan.blocks] = torch.where(new, written, kept).to(torch.int8)
    scales[plan.blocks] = scale


def store_quantized(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    plan: StoreMap | None = None,
) -> None:
    """Quantize ``key``/``value`` ``[tokens, H_kv, D]`` into their slots (``-1``: skip): fp8 per
    tensor, or int8 per block and head (``plan``: the step's :class:`StoreMap`, built if not given)."""
    if per_block(key_cache.dtype):
        plan = plan or StoreMap.build(slot_mapping, key_cache.shape[1])
        store_block_scaled(key, key_cache, k_scale, plan)
        store_block_scaled(value, value_cache, v_scale, plan)
        return
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for x, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        flat = cache.view(-1, *cache.shape[2:])
        flat[slots] = quantize_fp8(x[keep], scale, cache.dtype)


def calculated_scales(key: torch.Tensor, value: torch.Tensor) -> tuple[float, float]:
    """``calculate_kv_scales``: a layer's fp8 scales from the first batch it stores, ``max|k| / 200``
    and ``max|v| / 100`` (the headroom leaves later, larger values room); 1.0 where all are zero."""
    k, v = float(key.abs().max()) if key.numel() else 0.0, float(value.abs().max()) if value.numel() else 0.0
    return (k / K_SCALE_CONSTANT or 1.0), (v / V_SCALE_CONSTANT or 1.0)
