"""The CPU fast path: decode attention that reads K and V through the block table, in place, compiled.

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
values are swept, the next block's keys. :func:`decode_layer` runs the K/V store and this kernel in
one call, on NumPy views of every layer's caches made once per step (:class:`DecodeStep`): a decode
step of one sequence then costs ~40 us a layer instead of ~60.

No gathered copy is ever made; the only scratch is one block's scores. Positions at or past
``seq_lens[s]`` are never read, so a cache holding NaN or garbage outside the sequences cannot leak
into the result. The contract is :func:`.reference.paged_decode`'s: float32 arithmetic whatever the
cache dtype, the result cast back to the query's dtype.

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

Compilation: Numba compiles the kernel once per cache dtype (and :func:`decode_layer` once more
per memory layout of its query, keys and values: contiguous or strided) on first use (about a second) and
caches the machine code on disk (next to this file, or in Numba's user cache when that is not
writable), so later processes load it in milliseconds. Where Numba is missing or compiling fails,
the first call says so once with a warning and every call falls back to the eager recipe, which
gives the same numbers up to rounding. float16 caches and float64 (the tests' oracle dtype) take
the eager recipe.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from . import reference

_lock = threading.Lock()
_kernel: Callable[..., None] | None = None
_failed: str | None = None  # why compilation is unavailable in this process, once it has failed

#: Cache dtypes the compiled kernel reads (others take the eager recipe).
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


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor (no copy); bfloat16, which NumPy lacks, as its raw 16 bits."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    blocks: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """:func:`.reference.paged_decode`'s contract, compiled (no checks: the caller validated the
    tables once). ``blocks[S, W]`` int64, the first ``cdiv(seq_lens[s], block_size)`` entries of row
    ``s`` real block ids; ``seq_lens[S]`` int64, each at least 1."""
    if (
        _failed is not None
        or key_cache.dtype not in DTYPES
        or query.dtype not in DTYPES
        or not key_cache.is_contiguous()
        or not value_cache.is_contiguous()  # (the kernel's prefetch addresses assume contiguous caches)
    ):
        return _eager(query, key_cache, value_cache, blocks, seq_lens, scale)
    query = query.detach().contiguous()
    out = torch.empty_like(query)  # the kernel scales the query and rounds the result itself
    try:
        kernel = _compile()
        assert kernel is not None
        kernel(
            as_numpy(query),
            as_numpy(key_cache.detach()),
            as_numpy(value_cache.detach()),
            blocks.contiguous().numpy(),
            seq_lens.to(torch.int64).contiguous().numpy(),
            float(scale),
            as_numpy(out),
        )
    except Exception as error:
        give_up(error)  # re-raises anything that is not Numba missing or failing to compile
        return _eager(query, key_cache, value_cache, blocks, seq_lens, scale)
    return out


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """:func:`.reference.store_kv`'s contract (no checks: the caller validated), one compiled loop
    instead of a mask, two gathers and two scatters."""
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


@dataclass(frozen=True)
class DecodeStep:
    """A decode step as :func:`decode_layer` reads it, made once per step for every layer (the
    compiled backend's per-step metadata): every layer's caches and the step's slot mapping, block
    table and lengths as NumPy arrays."""

    caches: np.ndarray  # [layers, 2, num_blocks, block_size, H_kv, D]: keys (0) and values (1)
    dtype: torch.dtype  # the caches' (bfloat16 arrives as its raw bits)
    slots: np.ndarray  # int64 [num_seqs]: where each sequence's new token's K/V go
    blocks: np.ndarray  # int64 [num_seqs, width]: the first cdiv(seq_lens[s], block_size) entries real
    seq_lens: np.ndarray  # int64 [num_seqs], each at least 1, the new token included

    @classmethod
    def build(
        cls, caches: torch.Tensor, slot_mapping: torch.Tensor, blocks: torch.Tensor, seq_lens: torch.Tensor
    ) -> DecodeStep | None:
        """``None`` where the compiled kernel cannot read these caches (a dtype other than
        :data:`DTYPES`, not contiguous, or Numba unavailable in this process)."""
        if _failed is not None or caches.dtype not in DTYPES or not caches.is_contiguous():
            return None

        def int64(t: torch.Tensor) -> np.ndarray:
            return t.to(torch.int64).contiguous().numpy()

        return cls(as_numpy(caches), caches.dtype, int64(slot_mapping), int64(blocks), int64(seq_lens))


def decode_layer(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, step: DecodeStep, scale: float
) -> torch.Tensor | None:
    """:func:`store_kv` then :func:`paged_decode` for layer ``layer`` of ``step`` in one compiled call
    (no checks: the caller validated): ``query[S, H, D]`` and ``key``/``value`` ``[S, H_kv, D]`` may
    be strided views (their last dimension contiguous), as transformers hands them over; returns
    ``out[S, H, D]``. ``None`` when this call cannot take the compiled path (another dtype than the
    caches', Numba unavailable): the caller then makes the two calls apart."""
    if _failed is not None or not query.dtype == key.dtype == value.dtype == step.dtype:
        return None
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        return None
    out = query.new_empty(query.shape)
    try:
        from .loop_nest import decode_layer as kernel  # imported late: importing Numba costs half a second

        q, k, v = as_numpy(query.detach()), as_numpy(key.detach()), as_numpy(value.detach())
        kernel(q, k, v, step.caches, layer, step.slots, step.blocks, step.seq_lens, scale, as_numpy(out))
    except Exception as error:
        give_up(error)
        return None
    return out


def give_up(error: Exception) -> None:
    """Numba missing or failing to compile: stop trying in this process and say so once (any
    other error is re-raised: it is a bug or bad input, not a reason to switch the kernel off)."""
    global _failed
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


def _eager(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    blocks: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    plan = reference.GatherPlan.build(blocks, seq_lens, key_cache.shape[1])
    return reference.decode_with_plan(query, key_cache, value_cache, plan, scale)
