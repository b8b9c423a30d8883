"""The CPU fast path: attention that reads K and V through the block table, in place, compiled.

The eager recipe (:mod:`.reference`) copies every page of every sequence into a padded
``[num_seqs, max_len, kv_heads, dim]`` tensor and then runs attention over the copy: the very copy
PagedAttention exists to avoid. Here attention is a loop nest, written in Python and compiled to
vector machine code by Numba (LLVM) (:mod:`.loop_nest`): for each sequence it walks the sequence's
blocks through the block table, and sweeps each block front to back twice:

1. its keys, row by row: every key row (all KV heads of one token) is scored against the ``group``
   query heads that share its KV head (GQA: one load serves the whole group), widening bfloat16
   to float32 as it loads;
2. a running maximum and sum per query head, the online softmax of FlashAttention
   (:mod:`.online_softmax` tells that story): earlier partial results are rescaled by
   ``exp(old_max - new_max)``;
3. its values, row by row, weighted, into a ``[heads, head_dim]`` float32 accumulator.

Memory, not arithmetic, sets the pace: a model's cache is far larger than the processor's caches,
and the block table sends the sweep to a new place at every block, where the hardware prefetcher
loses the trail. So while the keys are swept the same rows of values are prefetched, and while the
values are swept, the next block's keys. :func:`.per_layer.decode_layer` runs the K/V store and this
kernel in one call, on NumPy views of every layer's caches made once per step
(:class:`.per_layer.DecodeStep`): a decode step of one sequence then costs ~40 us a layer instead of ~60.

No gathered copy is ever made; decode's only scratch is one block's scores (prefill's: one tile of
keys, values and scores). Positions at or past ``seq_lens[s]`` are never read (the AMX loops below
load tiles of 16 positions within one block and drop those past the sequence before the softmax), so
a cache holding NaN or garbage outside the sequences cannot leak into the result. The contract is
:func:`.reference.paged_decode`'s: float32 arithmetic whatever the cache dtype, the result cast back
to the query's dtype (on AMX, below, the softmax weights are rounded to bfloat16 for the values'
product, the tiles' input).

On a processor with AMX, bfloat16 caches take :mod:`.loop_amx` (decode and prompts) instead, where
:mod:`.tiles` says it applies:
the same walk through the block table, the scores and the weighted values multiplied on the matrix
tiles; each row still computed alone, the same bits from either. Elsewhere a bfloat16 cache whose
head size is a multiple of 32 takes :mod:`.loop_bf16`, the decode walk written in vector lanes
(pairs multiplied as bits, accumulators in registers, the next block asked for into the L2 cache):
on a 2-core AMD EPYC 28 ms a step where the nest takes 42 (64 sequences of 210, 30 layers in DRAM).

Why Numba, measured (SmolLM2's shapes: 9 query heads over 3 KV heads of 64, block size 16;
64 sequences of 100-430 tokens, bfloat16, one thread, this project's 2-core machine; the kernel is
single-threaded): this loop nest 2.0-2.4 ms when it swept each KV head's rows of a block apart,
without prefetching; 1.2 ms swept and prefetched as above with the cache in the processor's L3,
1.4-1.6 ms with 30 layers' caches in DRAM (2.5 ms before), 1.3 ms a layer inside the engine (2.1
ms before); the same arithmetic as a tensor program that torch.compile (inductor) turns into C++
with indirect loads 5.2 ms (its generated loops recompute the block-table lookup for every vector
they load, read each value row once per 32-lane half and per query head, and make three more passes
over the scores); FlexAttention with a paged block mask 7-8 ms; the eager gather and torch's fused
SDPA 17 ms. Inductor writes the loops it chooses; here we choose them, and where memory is read.

Quantized pages (:mod:`.quantization`): an 8-bit cache is read in place too. Each row's scale (per
block and KV head for int8; one per tensor for fp8, passed as strides of 0) is folded into the row's
score and weight, one multiplication per row; an int8 value widens like any integer, an fp8 byte is
decoded with integer steps (:func:`.loop_nest.fp8_bits`) once per row and KV head, not once per query
head of its group. Measured as above (16 sequences of 300 tokens, one thread, the cache in L3):
bfloat16 0.50 ms, int8 0.55 ms, fp8 e4m3 0.97 ms (a 256-entry lookup table was 2.4 ms: its gathers do
not vectorize). The int8 store runs block by block here too; fp8's store is the reference's.

Prompts (and chunks of them after a cached prefix) are read in place too (:func:`paged_prefill`,
:func:`.loop_nest.prefill`): per KV head, a tile of 16 query rows against 64 positions at a time,
gathered through the block table into a transposed scratch tile, a GQA group sharing each load, the
positions past the tile's last row never read. Measured (SmolLM2's heads, 16 prompts of 27-300
tokens, block size 16, one thread): 23-24 ms in bfloat16 or float32, where torch's fused SDPA over
the gathered pages (it computes the masked half as well) took 26-28 ms; 291 against 287 output
tokens/s on the 64-request peer workload, eager, bfloat16 (two alternating runs each). Where SDPA is
faster (an AMX Xeon, ``engine.worker.tuning``) the loop stays: it computes each row alone, so a
prompt gets the same bits whether its prefix came from the prefix cache or not, provided its rows
take this nest however few are left to compute: the decode kernel sums in another order (the
engine's ``decoding`` flags, :func:`.reference.paged_prefill`).

Compilation: Numba compiles each loop once per signature it meets (the cache's dtype; for the
per-layer call also the memory layout of its query, keys and values: contiguous or strided) on
first use (about a second a signature) and caches the machine code on disk (next to this file, or
in Numba's user cache when that is not writable), so later processes load it in milliseconds (a
cache left inconsistent by two processes compiling at once is rebuilt: :mod:`.numba_cache`).
Where Numba is missing or compiling fails, the first call says so once with a warning and every
call falls back to the eager recipe, which gives the same numbers up to rounding. float16 caches
and float64 (the tests' oracle dtype) take the eager recipe.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import numpy as np
import torch

from . import numba_cache, reference, tiles
from .arrays import as_numpy, fp8_format, scales
from .quantization import QUANTIZED_DTYPES, StoreMap, per_block, store_quantized

_lock = threading.Lock()
_kernel: Callable[..., None] | None = None
_failed: str | None = None  # why compilation is unavailable in this process, once it has failed

#: Query (and float cache) dtypes the compiled kernel reads (others take the eager recipe).
DTYPES = (torch.float32, torch.bfloat16)


def _compile() -> Callable[..., None] | None:
    global _kernel
    with _lock:
        if _kernel is None and _failed is None:
            from .loop_nest import decode  # imported late: importing Numba costs half a second

            _kernel = decode
        return _kernel


def available() -> bool:
    """Whether this process can still use the compiled kernel (``False`` once compiling failed)."""
    return _failed is None


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    blocks: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`.reference.paged_decode`'s contract, compiled (no checks: the caller validated the
    tables and scales once). ``blocks[S, W]`` int64, the first ``cdiv(seq_lens[s], block_size)``
    entries of row ``s`` real block ids; ``seq_lens[S]`` int64, each at least 1."""
    if (
        _failed is not None
        or key_cache.dtype not in (*DTYPES, *QUANTIZED_DTYPES)  # 8-bit caches: read with their scales
        or query.dtype not in DTYPES
        or not key_cache.is_contiguous()
        or not value_cache.is_contiguous()  # (the kernel's prefetch addresses assume contiguous caches)
    ):
        return _eager(query, key_cache, value_cache, blocks, seq_lens, scale, k_scale, v_scale)
    query = query.detach().contiguous()
    out = torch.empty_like(query)  # the kernel scales the query and rounds the result itself
    if tiles.rows(query.dtype, key_cache.dtype, query.shape[1], key_cache.shape, k_scale is not None):
        starts = torch.arange(query.shape[0] + 1)  # one new token a sequence: a prompt of one row each
        if paged_prefill(query, key_cache, value_cache, blocks, seq_lens, starts, None, scale, None, None,
                         out):  # fmt: skip
            return out
    scaled = k_scale is not None or v_scale is not None
    try:
        if tiles.pairs(query.dtype, key_cache.dtype, query.shape[-1], scaled):
            from .loop_bf16 import decode  # imported late: importing Numba costs half a second

            decode(as_numpy(query), as_numpy(key_cache.detach()), as_numpy(value_cache.detach()),
                   blocks.contiguous().numpy(), seq_lens.to(torch.int64).contiguous().numpy(), float(scale),
                   as_numpy(out))  # fmt: skip
            return out
        kernel = _compile()
        assert kernel is not None
        kernel(
            as_numpy(query),
            as_numpy(key_cache.detach()),
            as_numpy(value_cache.detach()),
            scales(key_cache, k_scale),
            scales(value_cache, v_scale),
            fp8_format(key_cache.dtype),
            blocks.contiguous().numpy(),
            seq_lens.to(torch.int64).contiguous().numpy(),
            float(scale),
            as_numpy(out),
        )
    except Exception as error:
        give_up(error)  # re-raises anything that is not Numba missing or failing to compile
        return _eager(query, key_cache, value_cache, blocks, seq_lens, scale, k_scale, v_scale)
    return out


def paged_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    seqs: list[int] | None,
    scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    out: torch.Tensor,
) -> bool:
    """Write the rows of ``out`` of the sequences ``seqs`` (``None``: all) (:func:`.reference.paged_prefill`'s
    contract: causal, the new tokens last; no checks: the caller validated), reading their blocks
    in place (:func:`.loop_amx.attend` where :mod:`.tiles` says so, else :func:`.loop_nest.prefill`);
    ``False`` (nothing written) where the loops do not apply: another dtype, a strided cache, Numba
    unavailable."""
    if (
        _failed is not None
        or key_cache.dtype not in (*DTYPES, *QUANTIZED_DTYPES)
        or query.dtype not in DTYPES
        or not (key_cache.is_contiguous() and value_cache.is_contiguous() and out.is_contiguous())
    ):
        return False
    order = np.arange(len(seq_lens)) if seqs is None else np.array(seqs, np.int64)
    rows = tiles.rows(query.dtype, key_cache.dtype, query.shape[1], key_cache.shape, k_scale is not None)
    q, keys, values = (as_numpy(t.detach()) for t in (query.contiguous(), key_cache, value_cache))
    tables, lens, starts = (
        t.to(torch.int64).contiguous().numpy() for t in (block_tables, seq_lens, query_start_loc)
    )
    try:
        from .loop_nest import prefill  # imported late: importing Numba costs half a second

        if rows:
            tiles.attend(q, keys, values, tables, lens, starts, order, float(scale), rows, as_numpy(out))
        else:
            prefill(q, keys, values, scales(key_cache, k_scale), scales(value_cache, v_scale),
                    fp8_format(key_cache.dtype), tables, lens, starts, order, float(scale),
                    as_numpy(out))  # fmt: skip
    except Exception as error:
        give_up(error)  # re-raises anything that is not Numba missing or failing to compile
        return False
    return True


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    plan: StoreMap | None = None,
) -> None:
    """:func:`.reference.store_kv`'s contract (no checks: the caller validated), one compiled loop
    instead of a mask, two gathers and two scatters; an int8 cache block by block with its scales
    (``plan``: the step's :class:`~.quantization.StoreMap`); fp8 by the reference."""
    if per_block(key_cache.dtype) and k_scale is not None and v_scale is not None:
        plan = plan or StoreMap.build(slot_mapping, key_cache.shape[1])
        try:
            if _failed is None and key.dtype in DTYPES and value.dtype == key.dtype:
                from .loop_int8 import store_int8  # imported late: importing Numba costs half a second

                for x, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
                    rows = as_numpy(x.detach().contiguous())
                    store_int8(rows, as_numpy(cache), scale.numpy(), plan.blocks.numpy(), plan.tokens.numpy())
                return
        except Exception as error:
            give_up(error)
    if k_scale is not None and v_scale is not None:
        store_quantized(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, plan)
        return
    same = key.dtype == value.dtype == key_cache.dtype == value_cache.dtype  # (the caches: contiguous)
    if _failed is not None or not same or key_cache.dtype not in DTYPES:
        reference.store_rows(key, value, key_cache, value_cache, slot_mapping)
        return
    try:
        from .loop_nest import store  # imported late: importing Numba costs half a second

        rows = [as_numpy(t.detach().contiguous()) for t in (key, value)]
        slots = slot_mapping.to(torch.int64).contiguous().numpy()
        store(*rows, as_numpy(key_cache), as_numpy(value_cache), slots)
    except Exception as error:
        give_up(error)
        reference.store_rows(key, value, key_cache, value_cache, slot_mapping)


def give_up(error: Exception) -> None:
    """Numba missing or failing to compile: stop trying in this process and say so once; its cache
    inconsistent: recompile (:mod:`.numba_cache`) and go on (any other error is re-raised: it is a
    bug or bad input, not a reason to switch the kernel off). Either way this call falls back."""
    global _failed
    if numba_cache.inconsistent(error):
        try:
            numba_cache.repair(error)
            return
        except Exception as failed:  # (recompiling failed too: give the loops up, as below)
            error = failed
    if not isinstance(error, ImportError) and not type(error).__module__.startswith("numba"):
        raise error
    with _lock:
        first = _failed is None
        if first:
            _failed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if first:
        warnings.warn(
            f"compiling the in-place CPU attention failed ({_failed[:300]}); attention falls back to "
            "the eager gather (the same numbers up to rounding, slower), and RMSNorm and the greedy "
            "argmax to their eager operations. Pass attention_backend='torch' to choose it.",
            RuntimeWarning,
            stacklevel=3,
        )


def _eager(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, blocks: torch.Tensor,
           seq_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None,
           v_scale: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    plan = reference.GatherPlan.build(blocks, seq_lens, key_cache.shape[1])
    return reference.decode_with_plan(query, key_cache, value_cache, plan, scale, k_scale=k_scale,
                                      v_scale=v_scale)  # fmt: skip
