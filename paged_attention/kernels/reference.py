"""Pure-PyTorch paged attention: the oracle every kernel is tested against, and the CPU fast path.

The recipe is the definition of PagedAttention with nothing clever in it: gather each sequence's
keys and values out of the pages its block table lists, then run ordinary attention. Decode does
it for the whole batch at once (pad every sequence to the longest, mask the padding), because on a
CPU one big tensor operation beats a Python loop of small ones; prefill walks the sequences that
bring several new tokens one by one, since their causal masks differ. Arithmetic is in float32
whatever the cache dtype (float64 for a float64 cache, which tests use to rule rounding out), and
the result is cast back to the query's dtype.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .._checks import cdiv
from .quantization import StoreMap, dequantize_blocks, store_quantized
from .validation import (
    check_cache,
    check_query_start_loc,
    check_scales,
    check_store_args,
    check_tables,
    default_scale,
)

Scale = torch.Tensor | None  # an 8-bit cache's scales (:mod:`.quantization`), checked; None: a float cache


def gather_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys and values, contiguous: ``[seq_len, num_kv_heads, head_dim]`` each
    (an 8-bit cache's dequantized to float32 with its scales)."""
    block_size = key_cache.shape[1]
    num_blocks = cdiv(seq_len, block_size)
    blocks = block_table[:num_blocks].long()
    keys = dequantize_blocks(key_cache.index_select(0, blocks), k_scale, blocks)
    values = dequantize_blocks(value_cache.index_select(0, blocks), v_scale, blocks)
    return keys.flatten(0, 1)[:seq_len], values.flatten(0, 1)[:seq_len]


@dataclass(frozen=True)
class GatherPlan:
    """Which cache blocks each sequence of a decode batch reads, padded to the longest sequence.

    It depends only on the block tables and lengths, not on the layer, so the model runner builds it
    once per step and every layer reuses it (vLLM's attention backends do the same with their
    per-step "metadata": work that is the same for every layer is done once).
    """

    blocks: torch.Tensor  # int64 [num_seqs * width]: block ids, padding entries pointing at block 0
    valid: torch.Tensor  # bool [num_seqs, max_len]: real positions
    width: int  # blocks per padded row
    max_len: int
    seq_lens: torch.Tensor  # [num_seqs], as given

    @classmethod
    def build(cls, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> GatherPlan:
        max_len = int(seq_lens.max())
        width = cdiv(max_len, block_size)
        positions = torch.arange(width * block_size, device=seq_lens.device)
        valid = positions[None, :] < seq_lens[:, None]
        used = valid.view(-1, width, block_size)[:, :, 0]
        blocks = torch.where(used, block_tables[:, :width], 0).long()  # padding entries may hold anything
        return cls(blocks.view(-1), valid[:, :max_len], width, max_len, seq_lens)


#: ``decode(query, key_cache, value_cache, plan, scale, k_scale, v_scale)``: a decode attention
#: built on a plan.
DecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, GatherPlan, float, Scale, Scale], torch.Tensor]
#: ``prefill(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, seqs, scale,
#: k_scale, v_scale, out) -> bool``: the long sequences' rows written in place (see paged_prefill)
PrefillFn = Callable[..., bool]


def gather_kv_padded(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: GatherPlan,
    zero_padding: bool = True,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's keys and values padded to the longest: ``[num_seqs, max_len, kv_heads, dim]``.

    Padding *values* are set to zero, because a padded slot may hold anything (even NaN, as in the
    tests) and ``0 * NaN`` is NaN; a caller that knows its cache holds only finite numbers (the
    engine's cache starts zeroed) may skip that pass. Padding *keys* are left alone: their scores
    are masked to -inf anyway.
    """
    block_size = key_cache.shape[1]
    shape = (plan.valid.shape[0], plan.width * block_size, *key_cache.shape[2:])
    # index_select copies whole blocks and is several times faster than key_cache[blocks] on a CPU.
    keys = dequantize_blocks(key_cache.index_select(0, plan.blocks), k_scale, plan.blocks)
    values = dequantize_blocks(value_cache.index_select(0, plan.blocks), v_scale, plan.blocks)
    keys, values = keys.view(shape)[:, : plan.max_len], values.view(shape)[:, : plan.max_len]
    if zero_padding:
        values.masked_fill_(~plan.valid[:, :, None, None], 0)  # in place: `values` is a fresh copy
    return keys, values


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    compute: torch.dtype | None = None,
) -> torch.Tensor:
    """``q[b, q_len, H, D]`` over ``k/v[b, kv_len, H_kv, D]``, where ``visible[b, q_len, kv_len]`` allows.

    Returns ``[b, q_len, H, D]`` in ``compute``: by default float32 (float64 for float64 inputs);
    float64 for any input makes the result independent, but for a chance of about 2**-40 per value
    once rounded back to bfloat16 or float32, of how the rows were padded and batched (the engine's
    batch-invariant mode). Grouped-query attention: each
    KV head serves the ``group = H // H_kv`` consecutive query heads above it, so the queries are
    regrouped under their KV head and every key is used by ``group * q_len`` query rows in one
    matrix product (no copies of K or V per query head).
    """
    b, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    rows = group * q_len  # query rows per KV head, ordered (head in group, token)
    compute = compute or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    q = q.to(compute).view(b, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    scores = q.reshape(b, num_kv_heads, rows, head_dim) @ k.to(compute).permute(0, 2, 3, 1) * scale
    mask = visible[:, None, None].expand(b, 1, group, q_len, visible.shape[-1]).reshape(b, 1, rows, -1)
    scores = scores.masked_fill(~mask, float("-inf"))  # [b, kv_heads, rows, kv_len]
    out = torch.softmax(scores, dim=-1) @ v.to(compute).permute(0, 2, 1, 3)  # [b, kv_heads, rows, D]
    return (
        out.view(b, num_kv_heads, group, q_len, head_dim)
        .permute(0, 3, 1, 2, 4)
        .reshape(b, q_len, num_heads, head_dim)
    )


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """One new query token per sequence attends to all ``seq_lens[i]`` cached tokens of sequence ``i``
    (an 8-bit cache read with its ``k_scale``/``v_scale``, :mod:`.quantization`)."""
    check_cache(query, key_cache, value_cache, allow_float64=True)
    k_scale, v_scale = check_scales(key_cache, k_scale, v_scale)
    check_tables(block_tables, seq_lens, key_cache, query.device)
    if query.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"decode has one query per sequence: {query.shape[0]} queries, {seq_lens.shape[0]} seq_lens"
        )
    if query.shape[0] == 0:
        return torch.empty_like(query)
    plan = GatherPlan.build(block_tables, seq_lens, key_cache.shape[1])
    scale = default_scale(query.shape[2], scale)
    return decode_with_plan(query, key_cache, value_cache, plan, scale, k_scale=k_scale, v_scale=v_scale)


def decode_with_plan(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: GatherPlan,
    scale: float,
    zero_padding: bool = True,
    fused: bool = False,
    compute: torch.dtype | None = None,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> torch.Tensor:
    """Decode attention from a prebuilt :class:`GatherPlan` (no checks: the caller validated once).

    ``fused=True`` (the engine's CPU path) hands the gathered keys and values to torch's fused
    ``scaled_dot_product_attention`` instead of :func:`attend`'s explicit matmul-softmax-matmul:
    1.5-2x faster on a CPU, same math. It runs in the cache's own dtype: in bfloat16 or float16 its
    CPU kernel accumulates in float32, as :func:`attend` does, without converting the cache first
    (3x faster than converting). The explicit version stays the oracle; a test compares them.
    ``compute`` (unfused only): :func:`attend`'s.
    """
    keys, values = gather_kv_padded(key_cache, value_cache, plan, zero_padding, k_scale, v_scale)
    if fused and query.dtype != torch.float64 and compute is None:
        if k_scale is not None:  # dequantized to float32: SDPA wants the query's dtype
            keys, values = keys.to(query.dtype), values.to(query.dtype)
        out = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, None],  # [seqs, heads, 1, dim]
            keys.transpose(1, 2),  # [seqs, kv_heads, max_len, dim]
            values.transpose(1, 2),
            attn_mask=plan.valid[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        return out[:, :, 0]
    return attend(query[:, None], keys, values, plan.valid[:, None, :], scale, compute)[:, 0].to(query.dtype)


#: With a ``decode`` function, sequences bringing at most this many tokens take it, a row per token
#: (verifying speculative drafts: each row then computes exactly what decoding its token alone
#: would, the same kernel and order of sums); longer ones (prompts) the ``prefill`` function, or the
#: gathered pages and SDPA. Measured on the CPU (SmolLM2's heads, bf16, 16 sequences with contexts
#: of 100-300, one thread): decode rows against SDPA 3.7x faster at 2 tokens, 1.5x at 4, even at 8;
#: against the in-place prefill loop 1.35x faster at 2, even at 4, 0.9x at 6. (The count rule, for
#: callers without the engine's ``decoding`` flags, which choose by what the tokens are instead.)
DECODE_ROWS_MAX = 6


def paged_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
    fused: bool = False,
    decode: DecodeFn | None = None,
    compute: torch.dtype | None = None,
    *,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    prefill: PrefillFn | None = None,
    decoding: Sequence[bool] | None = None,
) -> torch.Tensor:
    """Packed new tokens attend causally: the ``j``-th of ``q_len`` new tokens of a sequence with
    ``seq_len`` cached tokens (new ones included) sits at position ``seq_len - q_len + j``.

    ``fused=True`` (the engine's CPU path): torch's ``scaled_dot_product_attention`` in the cache's
    dtype, as :func:`decode_with_plan` does; else :func:`attend`, the oracle. ``decode(query, key_cache,
    value_cache, plan, scale)`` replaces :func:`decode_with_plan` for the sequences that bring one
    token, and for those that bring up to :data:`DECODE_ROWS_MAX` (a few speculative drafts to
    verify), one decode row per token (the compiled backend passes its in-place kernel).
    ``compute=torch.float64`` (with ``fused=False``): every row in float64, the batch-invariant
    mode's attention (see :func:`attend`). An 8-bit cache is read with its ``k_scale``/``v_scale``.
    ``prefill(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, seqs, scale,
    k_scale, v_scale, out)`` writes the rows of the sequences ``seqs`` that bring more tokens than
    that, reading the pages in place, or returns ``False`` to leave them to this function (the
    compiled backend passes its loop nest).

    ``decoding`` (a flag per sequence; the engine's): which sequences bring tokens past their
    prompt (a decode step's one, and any drafts to verify). Given, it chooses the path instead of
    the count: those sequences one decode row per token, however many; every other the prefill path,
    however few. The compiled backend's two loop nests sum in different orders, and each is the
    same for a row whatever rows share its call: so a prompt's rows get the same bits whether it is
    prefilled whole, in chunks, or after a prefix-cache hit that leaves one token, and a generated
    token the same bits whether it is decoded alone or verified as a draft."""
    check_cache(query, key_cache, value_cache, allow_float64=True)
    k_scale, v_scale = check_scales(key_cache, k_scale, v_scale)
    check_tables(block_tables, seq_lens, key_cache, query.device)
    check_query_start_loc(query_start_loc, seq_lens, query.shape[0])
    scale = default_scale(query.shape[2], scale)
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    q_lens = [b - a for a, b in itertools.pairwise(starts)]
    # Sequences that bring few tokens (decode; verifying a few speculative drafts) go through the
    # decode path, one row per token: token j of q_len sees the first seq_len - q_len + j + 1
    # positions, its own included (its K/V are stored before attention runs).
    longest = DECODE_ROWS_MAX if decode is not None else 1
    lens = seq_lens.tolist()
    if decoding is None:
        short = [i for i, n in enumerate(q_lens) if n <= longest]
    else:
        if len(decoding) != len(q_lens):
            raise ValueError(f"decoding must hold a flag per sequence ({len(q_lens)}), got {len(decoding)}")
        short = [i for i, flag in enumerate(decoding) if flag and q_lens[i]]
    if short:
        rows = [starts[i] + j for i in short for j in range(q_lens[i])]
        owners = [i for i in short for _ in range(q_lens[i])]
        visible = [lens[i] - q_lens[i] + j + 1 for i in short for j in range(q_lens[i])]
        index = torch.tensor(owners, device=query.device)
        row_index = torch.tensor(rows, device=query.device)
        plan = GatherPlan.build(
            block_tables[index], torch.tensor(visible, dtype=seq_lens.dtype, device=query.device),
            key_cache.shape[1],
        )  # fmt: skip
        if decode is not None:
            out[row_index] = decode(query[row_index], key_cache, value_cache, plan, scale, k_scale, v_scale)
        else:
            out[row_index] = decode_with_plan(
                query[row_index], key_cache, value_cache, plan, scale, fused=fused, compute=compute,
                k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
    taken = set(short)
    long = [i for i, n in enumerate(q_lens) if n and i not in taken]
    if long and prefill is not None and compute is None:
        args = (block_tables, seq_lens, query_start_loc, long, scale, k_scale, v_scale, out)
        if prefill(query, key_cache, value_cache, *args):
            long = []
    for i in long:
        seq_len = lens[i]
        start, end = starts[i], starts[i + 1]
        k, v = gather_kv(key_cache, value_cache, block_tables[i], seq_len, k_scale, v_scale)
        q_pos = seq_len - q_lens[i] + torch.arange(q_lens[i], device=query.device)
        visible = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        if fused and query.dtype != torch.float64 and compute is None:
            # [1, heads, tokens, dim]: with a batch dimension torch takes its fused (flash) CPU
            # kernel, as transformers' own SDPA layers do; 3-D inputs take the math path, 2x slower
            if k_scale is not None:  # dequantized to float32: SDPA wants the query's dtype
                k, v = k.to(query.dtype), v.to(query.dtype)
            heads_first = [t.transpose(0, 1)[None] for t in (query[start:end], k, v)]
            out[start:end] = torch.nn.functional.scaled_dot_product_attention(
                *heads_first, attn_mask=visible, scale=scale, enable_gqa=True
            )[0].transpose(0, 1)
        else:
            out[start:end] = attend(query[None, start:end], k[None], v[None], visible[None], scale, compute)[
                0
            ].to(query.dtype)
    return out


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
    """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their cache slots.

    Pure PyTorch, in place. ``slot_mapping`` is int64 ``[num_tokens]``; a slot of ``-1`` means
    "do not store this token" (vLLM uses it for padding). The cache is viewed as
    ``[num_blocks * block_size, num_kv_heads, head_dim]``, one row per slot. An 8-bit cache is
    written quantized (:func:`.quantization.store_quantized`; int8 updates ``k_scale``/``v_scale``).
    """
    check_store_args(key, value, key_cache, value_cache, slot_mapping)
    k_scale, v_scale = check_scales(key_cache, k_scale, v_scale)
    if k_scale is not None and v_scale is not None:
        store_quantized(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, plan)
        return
    store_rows(key, value, key_cache, value_cache, slot_mapping)


def store_rows(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """:func:`store_kv` without its checks."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    flat_k = key_cache.view(num_slots, *key_cache.shape[2:])
    flat_v = value_cache.view(num_slots, *value_cache.shape[2:])
    flat_k[slots] = key[keep].to(key_cache.dtype)
    flat_v[slots] = value[keep].to(value_cache.dtype)
