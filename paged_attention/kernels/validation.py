"""Argument checks shared by every attention backend, so all of them fail the same, helpful way.

The kernels index raw memory: a wrong dtype or a seq_len past the end of a block table would not
raise inside a kernel, it would read garbage. Everything is checked here first.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def check_cache(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Query ``[tokens, heads, head_dim]`` against NHD caches ``[blocks, block_size, kv_heads, head_dim]``."""
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        got = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        raise ValueError(f"query must be a 3-d tensor [num_tokens, num_heads, head_dim], got {got}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if not query.dtype == key_cache.dtype == value_cache.dtype:
        raise TypeError(
            f"query, key_cache and value_cache must share one dtype, got {query.dtype}, "
            f"{key_cache.dtype}, {value_cache.dtype}"
        )
    if not query.device == key_cache.device == value_cache.device:
        raise ValueError(f"all tensors must be on one device, got {query.device} and {key_cache.device}")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"query head_dim={head_dim} but the cache's head_dim={key_cache.shape[3]}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be between 1 and {MAX_HEAD_DIM}, got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads} (GQA/MQA groups)"
        )


def check_tables(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, device: torch.device
) -> None:
    """``block_tables`` int32 ``[num_seqs, max_blocks]`` and ``seq_lens`` int32 ``[num_seqs]`` in range."""
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise TypeError(
            f"block_tables must be an int32 [num_seqs, max_blocks] tensor, got {block_tables.dtype} "
            f"{tuple(block_tables.shape)}"
        )
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (block_tables.shape[0],):
        raise TypeError(
            f"seq_lens must be an int32 [num_seqs={block_tables.shape[0]}] tensor, got {seq_lens.dtype} "
            f"{tuple(seq_lens.shape)}"
        )
    if block_tables.device != device or seq_lens.device != device:
        raise ValueError(f"block_tables and seq_lens must be on {device} like the query")
    if seq_lens.numel():
        shortest, longest = int(seq_lens.min()), int(seq_lens.max())
        if shortest < 1:
            raise ValueError(f"every seq_len must be >= 1, got {shortest}")
        capacity = block_tables.shape[1] * block_size
        if longest > capacity:
            raise ValueError(
                f"seq_len {longest} exceeds what a block table row holds: "
                f"{block_tables.shape[1]} blocks x block_size {block_size} = {capacity} tokens"
            )


def check_query_start_loc(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int) -> None:
    """``query_start_loc`` int32 ``[num_seqs + 1]``: 0, increasing, ending at ``num_tokens``."""
    n = seq_lens.shape[0]
    if query_start_loc.dtype != torch.int32 or query_start_loc.shape != (n + 1,):
        raise TypeError(
            f"query_start_loc must be an int32 [num_seqs + 1 = {n + 1}] tensor, got "
            f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}"
        )
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    if int(query_start_loc[0]) != 0 or int(query_start_loc[-1]) != num_tokens:
        raise ValueError(f"query_start_loc must start at 0 and end at num_tokens={num_tokens}")
    if n and (int(q_lens.min()) < 1 or bool((q_lens > seq_lens.to(q_lens.device)).any())):
        raise ValueError("every sequence needs 1 <= new tokens <= seq_len (query_start_loc vs seq_lens)")


def default_scale(head_dim: int, scale: float | None) -> float:
    return head_dim**-0.5 if scale is None else float(scale)
