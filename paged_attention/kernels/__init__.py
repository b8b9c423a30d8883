"""Attention backends: the Triton kernels, the compiled in-place CPU kernel, or the pure-PyTorch reference.

``backend="auto"`` compiles the Triton kernels on CUDA tensors; on the CPU it takes ``"compiled"``:
decode and prefill attention read through the block tables in place by loop nests that Numba
compiles (:mod:`.compiled`, :mod:`.loop_nest`). ``"torch"`` is the eager reference recipe (a
padded gather, then attention), the oracle every kernel is tested against. ``backend="triton"`` on
the CPU runs the very same kernel code through **Triton's interpreter**, which executes each
program with NumPy: slow (milliseconds per loop iteration), but it lets a laptop run, test and step
through GPU code.

Why importing ``paged_attention`` sets an environment variable: Triton decides whether a
``@triton.jit`` function is compiled or interpreted when the decorator runs, by reading
``TRITON_INTERPRET``, not when the kernel is launched, and ``import triton`` already decorates
Triton's own helpers. So without a GPU, ``TRITON_INTERPRET=1`` must be set before Triton is first
imported: :mod:`paged_attention._triton_env` does that when ``paged_attention`` is imported first,
and the kernel modules are imported only later, on first use. To force the interpreter on a machine
with a GPU, set ``TRITON_INTERPRET=1`` yourself before importing anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Literal

import torch

from .._triton_env import triton_interpreted
from . import compiled, per_layer, quantization, reference
from .quantization import StoreMap
from .reference import GatherPlan
from .validation import check_cache, check_scales, check_store_args, check_tables, default_scale

Scale = torch.Tensor | float | None  # an 8-bit cache's k_scale / v_scale (:mod:`.quantization`)

Backend = Literal["auto", "triton", "torch", "compiled"]
BACKENDS = ("auto", "triton", "torch", "compiled")


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"auto"`` -> ``"triton"`` on CUDA, ``"compiled"`` on a CPU (``"torch"`` once compiling has
    failed in this process); checks that the choice can run."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type == "cuda":
            return "triton"
        return "compiled" if device.type == "cpu" and compiled.available() else "torch"
    if backend == "compiled" and device.type != "cpu":
        raise ValueError(f"the compiled backend is the CPU's; got {device} tensors (use 'triton' or 'auto')")
    if backend == "triton" and device.type != "cuda" and not triton_interpreted():
        raise ValueError(
            f"the triton backend needs CUDA tensors, got {device}; to use Triton's interpreter on a CPU, "
            "import paged_attention before triton, or set TRITON_INTERPRET=1 before importing either"
        )
    return backend


def _triton() -> tuple[ModuleType, ModuleType, ModuleType]:
    from . import (
        decode,  # imported late: after TRITON_INTERPRET is settled
        prefill,  # imported late: after TRITON_INTERPRET is settled
        store,  # imported late: after TRITON_INTERPRET is settled
    )

    return decode, prefill, store


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    backend: Backend = "auto",
    plan: GatherPlan | None = None,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> torch.Tensor:
    """Decode attention: ``query[num_seqs, num_heads, head_dim]``, one token per sequence.

    An 8-bit cache (:mod:`.quantization`) is read with its ``k_scale``/``v_scale``: one number each
    for fp8, ``[num_blocks, num_kv_heads]`` float32 for int8.

    ``plan`` (the torch and compiled backends, from :func:`plan_decode`): the batch's tables,
    checked and turned into block indices once per step, for every layer to reuse; with the torch
    backend masked positions are then not zeroed, so the cache must hold finite numbers only (the
    engine's does: it starts zeroed).
    """
    chosen = resolve_backend(backend, query.device)
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    if chosen == "compiled" and query.dtype != torch.float64:  # float64 (tests) stays on the reference
        if plan is None:
            check_cache(query, key_cache, value_cache)
            plan = plan_decode(block_tables, seq_lens, key_cache)
            if query.shape[0] != plan.seq_lens.shape[0]:
                raise ValueError(
                    f"decode has one query per sequence: {query.shape[0]} queries, "
                    f"{plan.seq_lens.shape[0]} seq_lens"
                )
        k, v = check_scales(key_cache, k_scale, v_scale)
        return _compiled_decode(
            query, key_cache, value_cache, plan, default_scale(query.shape[-1], scale), k, v
        )
    if chosen in ("torch", "compiled"):
        if plan is not None:
            scale = default_scale(query.shape[-1], scale)
            k, v = check_scales(key_cache, k_scale, v_scale)
            return reference.decode_with_plan(
                query,
                key_cache,
                value_cache,
                plan,
                scale,
                zero_padding=False,
                fused=True,
                k_scale=k,
                v_scale=v,
            )
        return reference.paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, **scales)
    return _triton()[0].paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, **scales)


def _compiled_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: GatherPlan,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    if query.shape[0] == 0:
        return torch.empty_like(query)
    blocks = plan.blocks.view(-1, plan.width)
    return compiled.paged_decode(
        query, key_cache, value_cache, blocks, plan.seq_lens, scale, k_scale, v_scale
    )


def plan_decode(block_tables: torch.Tensor, seq_lens: torch.Tensor, key_cache: torch.Tensor) -> GatherPlan:
    """Check a decode batch's ``block_tables`` and ``seq_lens`` once and build the torch backend's
    gather plan, which every layer of the step then reuses (vLLM's per-step attention metadata)."""
    block_tables, seq_lens, _ = check_tables(block_tables, seq_lens, key_cache, key_cache.device)
    return GatherPlan.build(block_tables, seq_lens, key_cache.shape[1])


def decode_step(
    caches: torch.Tensor,
    slot_mapping: torch.Tensor,
    plan: GatherPlan,
    scales: torch.Tensor | None = None,
    store_map: StoreMap | None = None,
) -> per_layer.DecodeStep | None:
    """A CPU decode step for :func:`decode_layer`, made once per step: ``caches`` every layer's keys
    and values, ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (as the engine's
    ``KVCache.data`` holds them), the step's ``slot_mapping`` and its checked ``plan``
    (:func:`plan_decode`); an int8 cache's ``scales``, ``[num_layers, 2, num_blocks, num_kv_heads]``,
    and the step's ``store_map`` (built here if not given).
    ``None`` where the compiled kernel cannot read these caches."""
    blocks = plan.blocks.view(-1, plan.width)
    return per_layer.DecodeStep.build(caches, slot_mapping, blocks, plan.seq_lens, scales, store_map)


def decode_layer(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    step: per_layer.DecodeStep,
    scale: float | None = None,
) -> torch.Tensor | None:
    """One layer of a CPU decode step in one compiled call: :func:`store_kv` of ``key``/``value``
    ``[num_seqs, num_kv_heads, head_dim]`` into layer ``layer``'s caches, then :func:`paged_decode`
    of ``query[num_seqs, num_heads, head_dim]`` (views with a contiguous last dimension are fine).
    For the engine, whose first layer of a step has checked these shapes and tables through the two
    separate calls; ``None`` where the compiled kernel cannot run (the caller then makes those two
    calls)."""
    return per_layer.decode_layer(query, key, value, layer, step, default_scale(query.shape[-1], scale))


def paged_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
    *,
    backend: Backend = "auto",
    k_scale: Scale = None,
    v_scale: Scale = None,
    decoding: Sequence[bool] | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens ``query[num_tokens, num_heads, head_dim]`` (an 8-bit
    cache read with its ``k_scale``/``v_scale``, as in :func:`paged_decode`).

    The torch backend runs torch's fused ``scaled_dot_product_attention`` in the cache's dtype
    over each sequence's gathered pages (:func:`.reference.paged_prefill` with ``fused=True``); the
    compiled backend reads the pages in place: its decode kernel for sequences that bring a few
    tokens (a row per token), its prefill loop nest for longer ones. Each computes a row alone,
    whatever shares its call, but the two sum in different orders, so the path decides a row's
    bits: by default the count of new tokens chooses; the engine passes ``decoding`` (a flag per
    sequence: it brings tokens past its prompt) to choose instead, so that every prompt row takes
    the prefill nest (a prompt gets the same bits whole, in chunks or after a prefix-cache hit) and
    every generated token the decode kernel (decoded alone or verified as a draft). The Triton
    backend has one kernel for every row and ignores it."""
    chosen = resolve_backend(backend, query.device)
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    if chosen in ("torch", "compiled"):
        fast = chosen == "compiled" and query.dtype != torch.float64
        return reference.paged_prefill(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, fused=True,
            decode=_compiled_decode if fast else None, prefill=compiled.paged_prefill if fast else None,
            decoding=decoding, **scales,
        )  # fmt: skip
    return _triton()[1].paged_prefill(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, **scales
    )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: Backend = "auto",
    checked: bool = False,
    k_scale: Scale = None,
    v_scale: Scale = None,
    plan: StoreMap | None = None,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their slots (``-1``: skip).

    ``checked=True`` (compiled backend): the caller has already checked arguments of these shapes
    and this slot mapping against a cache of this size (the engine checks a step's once, in its
    first layer, and every layer's cache has the same shape). An 8-bit cache is written quantized
    (:mod:`.quantization`): fp8 divided by its ``k_scale``/``v_scale``; int8 with a scale per block
    and KV head, which the store updates in place (``plan``: the step's
    :class:`~.quantization.StoreMap`, built if not given)."""
    chosen = resolve_backend(backend, key.device)
    if chosen == "compiled":
        if not checked:
            check_store_args(key, value, key_cache, value_cache, slot_mapping)
        k, v = check_scales(key_cache, k_scale, v_scale)
        compiled.store_kv(key, value, key_cache, value_cache, slot_mapping, k, v, plan)
    elif chosen == "torch":
        reference.store_kv(
            key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale, plan=plan
        )
    else:
        _triton()[2].store_kv(
            key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale, plan=plan
        )


__all__ = [
    "BACKENDS",
    "GatherPlan",
    "StoreMap",
    "decode_layer",
    "decode_step",
    "paged_decode",
    "paged_prefill",
    "plan_decode",
    "quantization",
    "resolve_backend",
    "store_kv",
    "triton_interpreted",
]
