"""Argument checks shared by every attention backend, so all of them fail the same, helpful way.

The kernels index raw memory: a wrong dtype, a block id past the end of the cache or a seq_len past
the end of a block table would not raise inside a kernel, it would read garbage. Everything is
checked here first. The checks that look at values (lengths, block ids) copy a few numbers from the
device to the host; that is the price of a teaching codebase that never fails silently.

The functions return the index tensors made contiguous (the kernels assume unit stride along a row)
together with the maxima the launchers need, so nothing is computed twice.
"""

from __future__ import annotations

import torch

from .quantization import QUANTIZED_DTYPES  # 8-bit caches: read with scales, beside a float query

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

MAX_HEAD_DIM = 256


def check_cache(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, allow_float64: bool = False
) -> None:
    """Query ``[tokens, heads, head_dim]`` against NHD caches ``[blocks, block_size, kv_heads, head_dim]``.

    ``allow_float64``: the PyTorch reference also computes in float64 (tests that must rule out
    rounding use it); the Triton kernels do not.
    """
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if query.dim() != 3:
        raise ValueError(
            f"query must be a 3-d tensor [num_tokens, num_heads, head_dim], got {tuple(query.shape)}"
        )
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape or 0 in key_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be non-empty "
            "[num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    allowed = (*FLOAT_DTYPES, torch.float64) if allow_float64 else FLOAT_DTYPES
    names = "float32, float16, bfloat16 or float64" if allow_float64 else "float32, float16 or bfloat16"
    if query.dtype not in allowed:
        raise TypeError(f"query must be {names}, got {query.dtype}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dtype not in allowed and t.dtype not in QUANTIZED_DTYPES:
            raise TypeError(
                f"{name} must be {names}, or an 8-bit format (fp8 e4m3/e5m2, int8), got {t.dtype}"
            )
    quantized = key_cache.dtype in QUANTIZED_DTYPES
    if key_cache.dtype != value_cache.dtype or (not quantized and query.dtype != key_cache.dtype):
        raise TypeError(
            f"query, key_cache and value_cache must share one dtype (or the caches one 8-bit format), got "
            f"{query.dtype}, {key_cache.dtype}, {value_cache.dtype}"
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
    block_tables: torch.Tensor, seq_lens: torch.Tensor, key_cache: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Check ``block_tables`` int32 ``[num_seqs, max_blocks]`` and ``seq_lens`` int32 ``[num_seqs]``.

    Every seq_len is at least 1 and fits its row, and every block id a kernel will read (the first
    ``cdiv(seq_len, block_size)`` of a row) names a block of the cache. Returns contiguous copies
    of both tensors and the longest seq_len.
    """
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
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
    if not seq_lens.numel():
        return block_tables.contiguous(), seq_lens.contiguous(), 0
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    shortest, longest = int(seq_lens.min()), int(seq_lens.max())
    if shortest < 1:
        raise ValueError(f"every seq_len must be >= 1, got {shortest}")
    capacity = block_tables.shape[1] * block_size
    if longest > capacity:
        raise ValueError(
            f"seq_len {longest} exceeds what a block table row holds: "
            f"{block_tables.shape[1]} blocks x block_size {block_size} = {capacity} tokens"
        )
    used = torch.arange(block_tables.shape[1], device=device)[None, :] * block_size < seq_lens[:, None]
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"block_tables[{row}, {col}] = {int(block_tables[row, col])} is not a block of the cache "
            f"(0..{num_blocks - 1}) but sequence {row} reads it"
        )
    return block_tables.contiguous(), seq_lens.contiguous(), longest


def check_query_start_loc(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, int]:
    """``query_start_loc`` int32 ``[num_seqs + 1]``: 0, increasing, ending at ``num_tokens``.

    Returns it contiguous, and the most new tokens of any one sequence.
    """
    n = seq_lens.shape[0]
    if not isinstance(query_start_loc, torch.Tensor):
        raise TypeError(f"query_start_loc must be a torch.Tensor, got {type(query_start_loc).__name__}")
    if query_start_loc.dtype != torch.int32 or query_start_loc.shape != (n + 1,):
        raise TypeError(
            f"query_start_loc must be an int32 [num_seqs + 1 = {n + 1}] tensor, got "
            f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}"
        )
    if query_start_loc.device != seq_lens.device:
        raise ValueError(f"query_start_loc must be on {seq_lens.device} like seq_lens")
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    if int(query_start_loc[0]) != 0 or int(query_start_loc[-1]) != num_tokens:
        raise ValueError(f"query_start_loc must start at 0 and end at num_tokens={num_tokens}")
    if n and (int(q_lens.min()) < 1 or bool((q_lens > seq_lens).any())):
        raise ValueError("every sequence needs 1 <= new tokens <= seq_len (query_start_loc vs seq_lens)")
    return query_start_loc.contiguous(), int(q_lens.max()) if n else 0


def check_scales(
    key_cache: torch.Tensor, k_scale: torch.Tensor | float | None, v_scale: torch.Tensor | float | None
) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """The scales that go with a cache (:mod:`.quantization`): none for a float cache; per tensor for
    fp8 (a number or a 0-d tensor each; ``None``: 1.0); per block and KV head for int8 (float32
    ``[num_blocks, num_kv_heads]`` each, required, contiguous). Returns them as float32 tensors."""
    if key_cache.dtype not in QUANTIZED_DTYPES:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale go with an 8-bit cache; this one is {key_cache.dtype}")
        return None, None
    out = []
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if key_cache.dtype == torch.int8:
            want = (key_cache.shape[0], key_cache.shape[2])
            if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or tuple(s.shape) != want:
                got = f"{s.dtype} {tuple(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
                raise ValueError(
                    f"an int8 cache keeps one scale per block and KV head: {name} must be a float32 "
                    f"[num_blocks, num_kv_heads] = {list(want)} tensor, got {got}"
                )
            if not s.is_contiguous() or s.device != key_cache.device:
                raise ValueError(f"{name} must be contiguous and on {key_cache.device} like the cache")
        else:
            if s is None:
                s = 1.0
            if isinstance(s, bool) or not isinstance(s, (int, float, torch.Tensor)):
                raise TypeError(f"{name} must be a number or a 0-d tensor for an fp8 cache, got {s!r}")
            positive = not isinstance(s, (int, float)) or s > 0  # (a tensor's value is not read: no sync)
            s = torch.as_tensor(s, dtype=torch.float32, device=key_cache.device)
            if s.dim() != 0 or not positive:
                raise ValueError(
                    f"an fp8 cache has one positive scale per tensor: {name} must be 0-d and > 0"
                )
        out.append(s)
    return out[0], out[1]


def default_scale(head_dim: int, scale: float | None) -> float:
    return head_dim**-0.5 if scale is None else float(scale)


def check_store_args(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """New tokens ``[num_tokens, num_kv_heads, head_dim]`` against NHD caches and an int64 slot
    mapping whose entries are slots of the cache or ``-1`` (skip)."""
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            "key and value must both be [num_tokens, num_kv_heads, head_dim], "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(
            f"key is {tuple(key.shape)} but the cache holds "
            f"(num_kv_heads, head_dim)={tuple(key_cache.shape[2:])}"
        )
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (key.shape[0],):
        raise ValueError(
            f"slot_mapping must be int64 [num_tokens={key.shape[0]}], "
            f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if not key.device == value.device == key_cache.device == value_cache.device == slot_mapping.device:
        raise ValueError("key, value, the caches and slot_mapping must all be on one device")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not cache.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous (the store writes through a flat view of its slots); "
                "pass the cache tensor itself, not a transposed or sliced view"
            )
    if slot_mapping.numel():
        num_slots = key_cache.shape[0] * key_cache.shape[1]
        low, high = int(slot_mapping.min()), int(slot_mapping.max())
        if low < -1 or high >= num_slots:
            bad = low if low < -1 else high
            raise ValueError(
                f"slot_mapping holds slot {bad}: slots are 0..{num_slots - 1}, or -1 to skip a token"
            )
