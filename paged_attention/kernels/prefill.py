"""Triton paged prefill: many new tokens per sequence, attending causally through the page table.

The new tokens of all sequences arrive packed in one ``query[num_tokens, num_heads, head_dim]``;
sequence ``s`` owns rows ``query_start_loc[s] : query_start_loc[s+1]``. Its keys and values, the new
ones included, are already in the cache (the store kernel ran first), ``seq_lens[s]`` of them. So
the ``j``-th new token of a sequence with ``q_len`` new tokens sits at absolute position
``context + j`` with ``context = seq_len - q_len``, and sees every cached position up to its own.
That one rule covers a fresh prompt (``context = 0``), a chunk of a long prompt whose earlier chunks
are cached (chunked prefill), and a prompt whose prefix came from the prefix cache.

Grid: ``(query tiles, sequences, KV heads)``. A program takes ``BLOCK_M`` new tokens of one sequence
and all ``group`` query heads that share one KV head, as ``BLOCK_M * GROUP_PAD`` rows of one tile
(row ``r`` is token ``r // GROUP_PAD``, head ``r % GROUP_PAD``), so keys and values are loaded once
per group. It walks the KV positions only up to its last query's position: causality lets it skip
the rest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_env import triton_interpreted
from .online_softmax import LOG2E, attend_tiles, default_tile, scale_args, use_native_dot
from .validation import check_cache, check_query_start_loc, check_scales, check_tables, default_scale


@triton.jit
def _prefill_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    k_scale_ptr,
    v_scale_ptr,
    stride_sb,
    stride_sh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    QUANT: tl.constexpr,
):
    q_tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_M < q_len:  # sequences shorter than the longest leave some programs idle
        seq_len = tl.load(seq_lens_ptr + seq)
        context = seq_len - q_len
        r = tl.arange(0, BLOCK_M * GROUP_PAD)
        token = q_tile * BLOCK_M + r // GROUP_PAD
        g = r % GROUP_PAD
        d = tl.arange(0, HEAD_PAD)
        row_mask = ((token < q_len) & (g < GROUP))[:, None] & (d < HEAD_DIM)[None, :]
        heads = kv_head * GROUP + g
        q_ptrs = query_ptr + (q_start + token)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptrs, mask=row_mask, other=0.0).to(tl.float32) * qk_scale
        last_query = context + tl.minimum(q_len, (q_tile + 1) * BLOCK_M)  # one past the last position
        acc, _m, l = attend_tiles(
            q, context + token, key_cache_ptr, value_cache_ptr, block_tables_ptr + seq * stride_bt, kv_head,
            0, last_query, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            k_scale_ptr, v_scale_ptr, stride_sb, stride_sh,
            HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE, CAUSAL=True, NATIVE_DOT=NATIVE_DOT, QUANT=QUANT,
        )  # fmt: skip
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        o_ptrs = out_ptr + (q_start + token)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask)


def paged_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
    *,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Triton paged prefill (see the module docstring); same contract as the reference (an 8-bit
    cache read with its ``k_scale``/``v_scale``)."""
    check_cache(query, key_cache, value_cache)
    scales = scale_args(key_cache, *check_scales(key_cache, k_scale, v_scale))
    block_size = key_cache.shape[1]
    block_tables, seq_lens, _ = check_tables(block_tables, seq_lens, key_cache, query.device)
    query_start_loc, max_query_len = check_query_start_loc(query_start_loc, seq_lens, query.shape[0])
    out = torch.empty_like(query)
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens == 0:
        return out
    if query.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("query and caches must be contiguous in head_dim (stride 1)")
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # Rows per program = BLOCK_M tokens x GROUP_PAD heads: 64 when compiled, where prefill is
    # compute-bound and bigger tiles reuse each K/V tile for more rows; 16 under the interpreter,
    # where nothing needs more (a compiled tl.dot needs K >= 16, not rows) and NumPy work stays small.
    native = use_native_dot(query.dtype, key_cache.dtype)
    rows = 16 if triton_interpreted() else 64
    block_m = max(1, rows // group_pad)
    grid = (triton.cdiv(max_query_len, block_m), seq_lens.shape[0], num_kv_heads)
    _prefill_kernel[grid](
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        default_scale(head_dim, scale) * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *key_cache.stride()[:3], *value_cache.stride()[:3], block_tables.stride(0), *scales[:-1],
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
        HEAD_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
        TILE=default_tile(block_size), BLOCK_M=block_m, NATIVE_DOT=native, QUANT=scales[-1],
    )  # fmt: skip
    return out
