"""Triton KV store: copy each new token's keys and values into its cache slot.

One program per token. The token's ``num_kv_heads x head_dim`` values are contiguous in ``key``
and, because the cache is NHD (``[block, offset, head, dim]``), contiguous in its slot too, so
the whole copy is one vector load and one vector store of ``num_kv_heads * head_dim`` elements. A
slot of ``-1`` means "skip this token" (padding) and the program returns at once.

Quantized pages (:mod:`.quantization`): an fp8 cache is written by the same program, each value
divided by the layer's scale, saturated and converted as it is stored. An int8 cache keeps a scale
per block and KV head that may grow as the block fills, so its store works **per (block, KV head)**
instead (one program each, over a :class:`~.quantization.StoreMap`): the program loads the block's
old scale and the new rows for its head, takes the new scale (the old one, or the new rows' largest
``|x|`` / 127 if larger), requantizes the rows already there when the scale grew, and writes the
block and its scale back. No two programs touch one block's head, so nothing races.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quantization import StoreMap, fp8_grid, fp8_max, per_block
from .validation import check_scales, check_store_args


@triton.jit
def _round_to_fp8(x, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """``x`` (float32, within the format's range) rounded to the nearest fp8 number, ties to even,
    in float32 arithmetic: the spacing of numbers near ``x`` is ``2**(exponent - MANTISSA)`` (the
    exponent no lower than the format's smallest normal one: subnormals share its spacing), and
    ``x / spacing`` is rounded to an integer. The conversion that follows is then exact. (Triton's
    interpreter converts float32 to fp8 wrongly when rounding carries into the exponent, 31.99 ->
    16.0, and rounds ties away from zero; a GPU converts correctly, and computes the same here.)"""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, MIN_EXP) - MANTISSA
    spacing = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    y = tl.abs(x) * ((127 - exponent) << 23).to(tl.float32, bitcast=True)  # times 1 / spacing, exact
    nearest = tl.floor(y + 0.5)
    odd = (nearest.to(tl.int32) & 1) == 1
    nearest = tl.where((nearest - y == 0.5) & odd, nearest - 1.0, nearest)  # a tie goes to the even one
    nearest = nearest * spacing
    return tl.where(x.to(tl.int32, bitcast=True) < 0, -nearest, nearest)  # the sign back, -0.0 included


@triton.jit
def _store_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_vt,
    stride_cslot,  # elements between consecutive slots of the cache
    k_scale_ptr,  # fp8 (FP8_MAX > 0): the layer's one key scale, and value scale
    v_scale_ptr,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    ROW_PAD: tl.constexpr,
    FP8_MAX: tl.constexpr,  # 0.0: a float cache (a copy); else the fp8 format's largest number
    MANTISSA: tl.constexpr,  # the fp8 format's mantissa bits and smallest normal exponent
    MIN_EXP: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        i = tl.arange(0, ROW_PAD)
        mask = i < ROW
        k = tl.load(key_ptr + token * stride_kt + i, mask=mask)
        v = tl.load(value_ptr + token * stride_vt + i, mask=mask)
        if FP8_MAX > 0:  # quantize on write: x / scale, saturated, rounded to the nearest fp8 number
            one = tl.cast(1.0, tl.float32)
            k = tl.clamp(k.to(tl.float32) * tl.div_rn(one, tl.load(k_scale_ptr)), -FP8_MAX, FP8_MAX)
            v = tl.clamp(v.to(tl.float32) * tl.div_rn(one, tl.load(v_scale_ptr)), -FP8_MAX, FP8_MAX)
            k = _round_to_fp8(k, MANTISSA, MIN_EXP)
            v = _round_to_fp8(v, MANTISSA, MIN_EXP)
        dst = slot.to(tl.int64) * stride_cslot + i
        tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_int8_kernel(
    x_ptr,  # [tokens, H_kv, D]: the new keys (or values)
    cache_ptr,  # int8 [num_blocks, block_size, H_kv, D]
    scale_ptr,  # float32 [num_blocks, H_kv]
    blocks_ptr,  # int64 [n]: the blocks this store touches (StoreMap)
    tokens_ptr,  # int64 [n, BLOCK_SIZE]: the new token at each offset, -1 for none
    stride_xt,
    stride_xh,
    stride_cb,
    stride_ct,
    stride_ch,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ROWS_PAD: tl.constexpr,
):
    """Program (touched block, KV head): one scale for the block's head, all its rows rewritten."""
    entry = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.load(blocks_ptr + entry)
    r = tl.arange(0, ROWS_PAD)
    d = tl.arange(0, HEAD_PAD)
    in_block = r < BLOCK_SIZE
    token = tl.load(tokens_ptr + entry * BLOCK_SIZE + r, mask=in_block, other=-1)
    new = token >= 0
    mask = in_block[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(
        x_ptr + token[:, None] * stride_xt + head * stride_xh + d[None, :],
        mask=mask & new[:, None],
        other=0.0,
    ).to(tl.float32)
    largest = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    fresh = tl.load(tokens_ptr + entry * BLOCK_SIZE) >= 0  # it writes offset 0: the block starts afresh
    old = tl.where(fresh, 0.0, tl.load(scale_ptr + block * num_kv_heads + head))
    # divisions rounded correctly (div_rn), as torch's: a GPU's `/` on float32 is approximate
    one, levels = tl.cast(1.0, tl.float32), tl.cast(127.0, tl.float32)  # (INT8_MAX: no Python global here)
    scale = tl.maximum(old, tl.div_rn(largest, levels))
    inverse = tl.where(scale > 0, tl.div_rn(one, tl.where(scale > 0, scale, one)), 0.0)
    rows = cache_ptr + block * stride_cb + r[:, None] * stride_ct + head * stride_ch + d[None, :]
    kept = tl.floor(tl.load(rows, mask=mask, other=0).to(tl.float32) * (old * inverse) + 0.5)
    written = tl.clamp(tl.floor(x * inverse + 0.5), -127.0, 127.0)
    tl.store(rows, tl.where(new[:, None], written, kept).to(tl.int8), mask=mask)
    tl.store(scale_ptr + block * num_kv_heads + head, scale)


def _store_int8(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    plan: StoreMap,
) -> None:
    n = plan.blocks.shape[0]
    if n == 0:
        return
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    tokens = plan.tokens.contiguous()
    for x, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        _store_int8_kernel[(n, num_kv_heads)](
            x, cache, scale, plan.blocks, tokens, x.stride(0), x.stride(1), *cache.stride()[:3], num_kv_heads,
            HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
            ROWS_PAD=triton.next_power_of_2(block_size),
        )  # fmt: skip


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    plan: StoreMap | None = None,
) -> None:
    """Triton twin of :func:`.reference.store_kv` (same checks, same result; an int8 cache's
    ``plan`` is the step's :class:`~.quantization.StoreMap`, built here if not given)."""
    check_store_args(key, value, key_cache, value_cache, slot_mapping)
    k_scale, v_scale = check_scales(key_cache, k_scale, v_scale)
    slot_mapping = slot_mapping.contiguous()
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    key, value = key.contiguous(), value.contiguous()
    row = key.shape[1] * key.shape[2]
    if key.shape[0] == 0:
        return
    if per_block(key_cache.dtype):
        assert k_scale is not None and v_scale is not None
        plan = plan or StoreMap.build(slot_mapping, key_cache.shape[1])
        _store_int8(key, value, key_cache, value_cache, k_scale, v_scale, plan)
        return
    limit = fp8_max(key_cache.dtype) if k_scale is not None else 0.0
    grid = fp8_grid(key_cache.dtype) if k_scale is not None else (0, 0)
    _store_kernel[(key.shape[0],)](
        key, value, key_cache, value_cache, slot_mapping, key.stride(0), value.stride(0), key_cache.stride(1),
        key_cache if k_scale is None else k_scale, value_cache if v_scale is None else v_scale,
        ROW=row, ROW_PAD=triton.next_power_of_2(row), FP8_MAX=limit,
        MANTISSA=grid[0], MIN_EXP=grid[1],
    )  # fmt: skip
