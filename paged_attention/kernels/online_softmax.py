"""The inner loop both attention kernels share: online softmax over tiles gathered through pages.

``attend_tiles`` takes a tile of queries (one row per query head and token the program owns) and
walks positions ``[start, end)`` of one sequence, ``TILE`` tokens at a time:

* token ``pos`` lives in physical block ``block_table[pos // BLOCK_SIZE]`` at offset
  ``pos % BLOCK_SIZE``: the kernel loads the block id of every token of the tile (neighbours share
  it, so that is a cache hit) and gathers keys and values from wherever their pages are. The tile is
  independent of the block size, so a block size of 8 still gives ``p @ v`` the inner dimension of
  at least 16 that Triton's NVIDIA backend requires of a compiled ``tl.dot`` (K >= 16);
* online softmax keeps a running maximum ``m``, running sum ``l`` and running output ``acc`` per
  row and rescales them whenever the maximum grows, so no row ever needs all its scores at once
  (Milakov & Gimelshein 2018; FlashAttention). Scores are in log2 units (the caller folds
  ``log2(e)`` into the scale) because ``exp2`` is the cheaper instruction on GPUs;
* masks, not branches: head sizes such as 80 are padded to a power of two (``tl.arange`` needs
  one) and masked, positions at or past ``end`` are never loaded, and with ``CAUSAL`` a row at
  absolute position ``q_pos`` sees only positions ``<= q_pos``.

Precision: compiled on a GPU with fp16/bf16 caches (``NATIVE_DOT``), both products take their
inputs in that dtype, so they run on tensor cores, and accumulate in float32, as FlashAttention does.
Under the interpreter, and for float32 caches, everything is converted to float32 at once: the
interpreter computes bf16 arithmetic wrongly, and float32 makes the CPU results exact.

Quantized pages (``QUANT``, :mod:`.quantization`): an 8-bit row is widened to float32 and multiplied
by its scale in registers, right after the load, and the products run in float32. The scale of a
row is found through the same block id as the row itself: one per (block, KV head) for int8, or one
for the whole tensor (fp8), which the launcher expresses as strides of 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_env import triton_interpreted
from .quantization import is_quantized

LOG2E = 1.4426950408889634
NEG_BIG = tl.constexpr(
    -1.0e30
)  # a finite "minus infinity" for m: keeps exp2(m_old - m_new) free of inf - inf


@triton.jit
def attend_tiles(
    q,  # [ROWS, HEAD_PAD] float32, already multiplied by scale * log2(e)
    q_pos,  # [ROWS] absolute position of each row's query (read only when CAUSAL)
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,  # this sequence's row of the block table
    kv_head,
    start,
    end,  # attend to positions [start, end)
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    k_scale_ptr,  # an 8-bit cache's scales: (block, kv_head)'s at block * stride_sb + kv_head * stride_sh
    v_scale_ptr,
    stride_sb,  # 0 and 0 for one scale per tensor (fp8)
    stride_sh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    CAUSAL: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    QUANT: tl.constexpr,  # the cache is 8-bit: each row is widened and multiplied by its scale as it loads
):
    """Return ``acc [ROWS, HEAD_PAD]``, ``m [ROWS]``, ``l [ROWS]``; the output is ``acc / l``."""
    ROWS: tl.constexpr = q.shape[0]
    d = tl.arange(0, HEAD_PAD)
    d_mask = d < HEAD_DIM
    m = tl.full([ROWS], NEG_BIG, tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_PAD], tl.float32)
    for tile_start in range(start, end, TILE):
        pos = tile_start + tl.arange(0, TILE)
        in_range = pos < end
        block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        kv_mask = in_range[:, None] & d_mask[None, :]
        k_rows = key_cache_ptr + block * stride_kb + offset * stride_kt + kv_head * stride_kh
        k = tl.load(k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v_rows = value_cache_ptr + block * stride_vb + offset * stride_vt + kv_head * stride_vh
        v = tl.load(v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if QUANT:  # dequantize on load: the 8-bit rows never exist in memory as anything wider
            scale_at = block * stride_sb + kv_head * stride_sh
            k = k.to(tl.float32) * tl.load(k_scale_ptr + scale_at, mask=in_range, other=0.0)[:, None]
            v = v.to(tl.float32) * tl.load(v_scale_ptr + scale_at, mask=in_range, other=0.0)[:, None]
        if NATIVE_DOT:  # compiled fp16/bf16: tensor cores multiply, float32 accumulates
            scores = tl.dot(q.to(k.dtype), tl.trans(k))
        else:  # the interpreter (and float32 caches): exact float32 arithmetic
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")  # [ROWS, TILE]
        visible = in_range[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if NATIVE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    return acc, m, l


def use_native_dot(dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> bool:
    """Feed ``tl.dot`` fp16/bf16 directly (tensor cores) when compiled; float32 under the interpreter
    and for 8-bit caches (dequantized to float32)."""
    quantized = cache_dtype is not None and is_quantized(cache_dtype)
    return dtype in (torch.float16, torch.bfloat16) and not triton_interpreted() and not quantized


def scale_args(
    key_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, int, int, bool]:
    """The scale arguments of :func:`attend_tiles` for a cache and its checked scales: pointers,
    strides (0, 0 per tensor) and ``QUANT``; a float cache passes itself as a pointer never read."""
    if k_scale is None or v_scale is None:
        return key_cache, key_cache, 0, 0, False
    strides = (k_scale.stride(0), k_scale.stride(1)) if k_scale.dim() == 2 else (0, 0)
    return k_scale, v_scale, *strides, True


def default_tile(block_size: int) -> int:
    """Tokens per loop iteration, up to 64 and at least 16: the tile is the inner dimension K of
    ``p @ v``, and a compiled ``tl.dot`` on an NVIDIA GPU needs K >= 16."""
    return max(16, min(block_size, 64))
