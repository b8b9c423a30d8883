"""Triton paged decode: one new query token per sequence, reading K/V through the block table.

**One program per (sequence, KV head).** With grouped-query attention, ``group = num_heads //
num_kv_heads`` query heads share one KV head. The program loads all of the group's queries as the
rows of a ``[GROUP_PAD, HEAD_PAD]`` tile, so each key and value is read from memory once per group,
not once per query head. Decode is memory-bound: those bytes are the whole cost. The loop over the
sequence's pages is :func:`paged_attention.kernels.online_softmax.attend_tiles`.

``tl.dot`` sizes: Triton's NVIDIA backend (``min_dot_size`` in ``triton/backends/nvidia/compiler.py``)
compiles a dot only if its inner dimension K is at least 16 (32 for 8-bit inputs); the rows M and
columns N may be as small as 1. Our K's are the head size in ``q @ k^T`` (padded to ``HEAD_PAD >= 16``)
and the tile in ``p @ v`` (``TILE >= 16``, see ``default_tile``). The query rows are also padded to
``GROUP_PAD >= 16``, which the Triton we require does not need (older releases asserted M, N and
K >= 16); the padded rows load nothing and store nothing. The interpreter accepts any size, so
``compile_check`` builds every kernel for a GPU.

Split-K ("flash-decoding", vLLM's ``paged_attention_v2``): a single long sequence gives the GPU only
``num_kv_heads`` programs, too few to fill it. Cutting the context into partitions of
``PARTITION`` tokens gives each partition its own program; each writes a partial output with its
own ``m`` and ``l``, and a small reduction kernel merges them exactly:
``out = sum_s exp(m_s - M) l_s o_s / sum_s exp(m_s - M) l_s`` with ``M = max_s m_s``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .online_softmax import LOG2E, NEG_BIG, attend_tiles, default_tile, scale_args, use_native_dot
from .validation import check_cache, check_scales, check_tables, default_scale

PARTITION_SIZE = 512  # tokens per split-K partition (a multiple of every TILE below)


@triton.jit
def _attend_group(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq, kv_head, start, end, qk_scale,
    stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    k_scale_ptr, v_scale_ptr, stride_sb, stride_sh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, NATIVE_DOT: tl.constexpr, QUANT: tl.constexpr,
):  # fmt: skip
    """One KV head's query group against tokens ``start .. end - 1`` of one sequence: the normalised
    output ``[GROUP_PAD, HEAD_PAD]``, its running max and sum, the query heads and their mask."""
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_PAD)
    row_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    heads = kv_head * GROUP + g
    q_ptrs = query_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=row_mask, other=0.0).to(tl.float32) * qk_scale
    acc, m, l = attend_tiles(
        q, g, key_cache_ptr, value_cache_ptr, block_tables_ptr + seq * stride_bt, kv_head, start, end,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        k_scale_ptr, v_scale_ptr, stride_sb, stride_sh,
        HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE, CAUSAL=False, NATIVE_DOT=NATIVE_DOT, QUANT=QUANT,
    )  # fmt: skip
    return acc / l[:, None], m, l, heads, row_mask


@triton.jit
def _decode_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr, qk_scale,
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    k_scale_ptr, v_scale_ptr, stride_sb, stride_sh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, NATIVE_DOT: tl.constexpr, QUANT: tl.constexpr,
):  # fmt: skip
    """Program (sequence, KV head): the group's queries against the whole context."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    out, _m, _l, heads, row_mask = _attend_group(
        query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq, kv_head, 0,
        tl.load(seq_lens_ptr + seq), qk_scale, stride_qs, stride_qh,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
        k_scale_ptr, v_scale_ptr, stride_sb, stride_sh,
        GROUP, GROUP_PAD, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE, NATIVE_DOT, QUANT,
    )  # fmt: skip
    d = tl.arange(0, HEAD_PAD)
    o_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _decode_split_kernel(
    partial_ptr,  # [num_seqs, num_heads, num_splits, head_dim] float32: each partition's output
    m_ptr,  # [num_seqs, num_heads, num_splits] float32: its running max (log2 units)
    l_ptr,  # same shape: its running sum
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr, qk_scale,
    stride_qs, stride_qh, stride_ps, stride_ph, stride_psplit,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt, num_splits,
    k_scale_ptr, v_scale_ptr, stride_sb, stride_sh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PARTITION: tl.constexpr, NATIVE_DOT: tl.constexpr,
    QUANT: tl.constexpr,
):  # fmt: skip
    """Program (sequence, KV head, partition): the group's queries against ``PARTITION`` tokens."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    start = split * PARTITION
    end = tl.minimum(start + PARTITION, tl.load(seq_lens_ptr + seq))
    if start < end:  # an empty partition writes nothing; the reduction masks it out
        out, m, l, heads, row_mask = _attend_group(
            query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq, kv_head, start, end,
            qk_scale, stride_qs, stride_qh,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
            k_scale_ptr, v_scale_ptr, stride_sb, stride_sh,
            GROUP, GROUP_PAD, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE, NATIVE_DOT, QUANT,
        )  # fmt: skip
        d = tl.arange(0, HEAD_PAD)
        p_ptrs = (
            partial_ptr + seq * stride_ps + heads[:, None] * stride_ph + split * stride_psplit + d[None, :]
        )
        tl.store(p_ptrs, out, mask=row_mask)
        ml_offsets = (seq * GROUP * tl.num_programs(1) + heads) * num_splits + split
        real = tl.arange(0, GROUP_PAD) < GROUP  # the group's heads, not its padding rows
        tl.store(m_ptr + ml_offsets, m, mask=real)
        tl.store(l_ptr + ml_offsets, l, mask=real)


@triton.jit
def _reduce_kernel(
    out_ptr,
    partial_ptr,  # [num_seqs, num_heads, num_splits, head_dim] float32
    m_ptr,
    l_ptr,
    seq_lens_ptr,
    stride_os,
    stride_oh,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    PARTITION: tl.constexpr,
):
    """Merge the split-K partials of one (sequence, head) with their log-sum-exp weights."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    used = tl.cdiv(seq_len, PARTITION)  # partitions that hold at least one token
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_PAD)
    s_mask = s < used
    row = (seq * num_heads + head) * num_splits
    m = tl.load(m_ptr + row + s, mask=s_mask, other=NEG_BIG)
    l = tl.load(l_ptr + row + s, mask=s_mask, other=0.0)
    weight = tl.exp2(m - tl.max(m, axis=0)) * l
    weight = tl.where(s_mask, weight, 0.0)
    partial = tl.load(
        partial_ptr + (row + s[:, None]) * HEAD_DIM + d[None, :],
        mask=s_mask[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    out = tl.sum(weight[:, None] * partial, axis=0) / tl.sum(weight, axis=0)
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM
    )


def should_split_k(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132) -> bool:
    """The split-K heuristic: split when the context is long and the batch too small to fill the GPU.

    Without splitting the grid has ``num_seqs * num_kv_heads`` programs. If that is below the
    number of streaming multiprocessors (132 on an H100/H200) and each sequence spans more than one
    partition, splitting turns idle SMs into parallel work; otherwise the extra reduction pass and
    the partial outputs' memory traffic only cost time (the same trade vLLM's v1/v2 choice makes).
    """
    return max_seq_len > PARTITION_SIZE and num_seqs * num_kv_heads < num_sms


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    split_k: bool | None = None,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Triton paged decode (see the module docstring). ``split_k=None`` applies :func:`should_split_k`;
    an 8-bit cache is read with its ``k_scale``/``v_scale`` (:mod:`.quantization`)."""
    check_cache(query, key_cache, value_cache)
    scales = scale_args(key_cache, *check_scales(key_cache, k_scale, v_scale))
    block_size = key_cache.shape[1]
    block_tables, seq_lens, max_seq_len = check_tables(block_tables, seq_lens, key_cache, query.device)
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs != seq_lens.shape[0]:
        raise ValueError(
            f"decode has one query per sequence: {num_seqs} queries, {seq_lens.shape[0]} seq_lens"
        )
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if query.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("query and caches must be contiguous in head_dim (stride 1)")
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    if split_k is None:
        num_sms = (
            torch.cuda.get_device_properties(query.device).multi_processor_count if query.is_cuda else 132
        )
        split_k = should_split_k(num_seqs, num_kv_heads, max_seq_len, num_sms)
    qk_scale = default_scale(head_dim, scale) * LOG2E
    meta = dict(
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        TILE=default_tile(block_size),
        NATIVE_DOT=use_native_dot(query.dtype, key_cache.dtype),
        QUANT=scales[-1],
    )
    cache_strides = (*key_cache.stride()[:3], *value_cache.stride()[:3])
    if not split_k:
        _decode_kernel[(num_seqs, num_kv_heads)](
            out, query, key_cache, value_cache, block_tables, seq_lens, qk_scale,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            *cache_strides, block_tables.stride(0), *scales[:-1], **meta,
        )  # fmt: skip
        return out
    num_splits = triton.cdiv(max_seq_len, PARTITION_SIZE)
    partial = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    m = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    l = torch.empty_like(m)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        partial, m, l, query, key_cache, value_cache, block_tables, seq_lens, qk_scale,
        query.stride(0), query.stride(1), partial.stride(0), partial.stride(1), partial.stride(2),
        *cache_strides, block_tables.stride(0), num_splits, *scales[:-1], PARTITION=PARTITION_SIZE, **meta,
    )  # fmt: skip
    _reduce_kernel[(num_seqs, num_heads)](
        out, partial, m, l, seq_lens, out.stride(0), out.stride(1), num_heads, num_splits,
        HEAD_DIM=head_dim, HEAD_PAD=meta["HEAD_PAD"], SPLITS_PAD=triton.next_power_of_2(num_splits),
        PARTITION=PARTITION_SIZE,
    )  # fmt: skip
    return out
