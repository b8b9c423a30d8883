"""Pure-PyTorch paged attention: the oracle every kernel is tested against, and the CPU fast path.

The recipe is the definition of PagedAttention with nothing clever in it: for each sequence,
gather its keys and values out of the pages its block table lists, then run ordinary attention.
Arithmetic is in float32 whatever the cache dtype, and the result is cast back to the query's dtype.
"""

from __future__ import annotations

import torch

from .validation import check_cache, check_query_start_loc, check_tables, default_scale


def gather_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys and values, contiguous: ``[seq_len, num_kv_heads, head_dim]`` each."""
    block_size = key_cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    keys = key_cache[blocks].flatten(0, 1)[:seq_len]
    values = value_cache[blocks].flatten(0, 1)[:seq_len]
    return keys, values


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int | None
) -> torch.Tensor:
    """q ``[q_len, H, D]``, k/v ``[kv_len, H_kv, D]`` -> ``[q_len, H, D]`` in float32.

    With ``causal_offset`` set, query ``i`` sits at position ``causal_offset + i`` and sees keys
    ``0 .. causal_offset + i``; without it every query sees every key (decode).
    """
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # GQA: each KV head serves `group` query heads
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if causal_offset is not None:
        q_pos = causal_offset + torch.arange(q.shape[0], device=q.device)[:, None]
        k_pos = torch.arange(k.shape[0], device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One new query token per sequence attends to all ``seq_lens[i]`` cached tokens of sequence ``i``."""
    check_cache(query, key_cache, value_cache)
    check_tables(block_tables, seq_lens, key_cache, query.device)
    if query.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"decode has one query per sequence: {query.shape[0]} queries, {seq_lens.shape[0]} seq_lens"
        )
    scale = default_scale(query.shape[2], scale)
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens.tolist()):
        k, v = gather_kv(key_cache, value_cache, block_tables[i], seq_len)
        out[i] = _attend(query[i : i + 1], k, v, scale, causal_offset=None)[0].to(query.dtype)
    return out


def paged_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Packed new tokens attend causally: the ``j``-th of ``q_len`` new tokens of a sequence with
    ``seq_len`` cached tokens (new ones included) sits at position ``seq_len - q_len + j``."""
    check_cache(query, key_cache, value_cache)
    check_tables(block_tables, seq_lens, key_cache, query.device)
    check_query_start_loc(query_start_loc, seq_lens, query.shape[0])
    scale = default_scale(query.shape[2], scale)
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        k, v = gather_kv(key_cache, value_cache, block_tables[i], seq_len)
        context = seq_len - (end - start)
        out[start:end] = _attend(query[start:end], k, v, scale, causal_offset=context).to(query.dtype)
    return out
