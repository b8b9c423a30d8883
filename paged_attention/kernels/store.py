"""Triton KV store: copy each new token's keys and values into its cache slot.

One program per token. The token's ``num_kv_heads x head_dim`` values are contiguous in ``key``
and, because the cache is NHD (``[block, offset, head, dim]``), contiguous in its slot too, so
the whole copy is one vector load and one vector store of ``num_kv_heads * head_dim`` elements. A
slot of ``-1`` means "skip this token" (padding) and the program returns at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .validation import check_store_args


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
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    ROW_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        i = tl.arange(0, ROW_PAD)
        mask = i < ROW
        k = tl.load(key_ptr + token * stride_kt + i, mask=mask)
        v = tl.load(value_ptr + token * stride_vt + i, mask=mask)
        dst = slot.to(tl.int64) * stride_cslot + i
        tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton twin of :func:`paged_attention.engine.worker.kv_cache.store_kv` (same checks, same result)."""
    check_store_args(key, value, key_cache, value_cache, slot_mapping)
    slot_mapping = slot_mapping.contiguous()
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    key, value = key.contiguous(), value.contiguous()
    row = key.shape[1] * key.shape[2]
    if key.shape[0] == 0:
        return
    _store_kernel[(key.shape[0],)](
        key, value, key_cache, value_cache, slot_mapping, key.stride(0), value.stride(0), key_cache.stride(1),
        ROW=row, ROW_PAD=triton.next_power_of_2(row),
    )  # fmt: skip
