"""Which dtype ``dtype="auto"`` serves a model in on a CPU: bfloat16 where this processor multiplies
bfloat16 faster than float32, else float32.

A decode step reads every weight once and does little arithmetic per byte, so halving the bytes
(bfloat16) can nearly halve the step, but only where the processor *computes* bfloat16 natively
(x86 AVX512-BF16 or AMX, Arm's BF16 extension): elsewhere torch converts each element to float32
and the product gets slower, not faster. So ``auto`` decides by measuring: the model's own MLP
product (``[rows, hidden] @ [hidden, intermediate]``, over several distinct weights,
:data:`PROBE_BYTES` in all) at 1 and 16 rows, float32 against bfloat16 as the engine runs it
(packed, :mod:`.packed_linear`), at the current torch thread count. bfloat16 is chosen when that
product is at least :data:`MARGIN` times faster at every row count probed: a probe of the
product that dominates a decode step, not of the whole step (``bench engine --dtype float32
bfloat16`` measures whole steps). A result near the margin is measured twice more and the median
taken. Two cases stay float32 without measuring: a checkpoint stored in float32 (its weights would
lose precision the checkpoint holds: bfloat16 keeps 8 bits of mantissa; SmolLM2's checkpoint is
bfloat16 to begin with, so it loses nothing), and a model whose float32 weights fit in
:data:`SMALL_MODEL_BYTES` (halving so few bytes saves little, while exact comparisons in float32
stay easy: the embedded tiny model, 10 MB, is one). A float16 checkpoint is served in bfloat16 as
well where that is faster (3 fewer mantissa bits, a wider range; a CPU rarely computes float16
natively), as vLLM's CPU backend does.

On an AVX-512 CPU without bfloat16 arithmetic (Ice Lake, Cascade Lake) the engine does not use
oneDNN's emulated product: it multiplies bfloat16 in its own loops, which widen each weight in
registers (:mod:`..kernels.widened`; measured on an Ice Lake Xeon, one thread, SmolLM2's MLP product:
2.5-3.0x float32's speed at one row, 1.56x at 16, 0.92x at 64). The engine registers that kernel
here (:func:`multiply_bfloat16_with`); the probe then times the products through it, in a packed
layer as the engine runs them, and such a CPU is measured rather than kept in float32. vLLM 0.32
keeps a bfloat16 checkpoint in bfloat16 on any x86 CPU (``vllm/platforms/cpu.py``:
``supported_dtypes``; ``vllm/config/model.py``: ``_resolve_auto_dtype``); this package does where
it measures it faster.

The decision is cached, in this process and on disk (``cpu-dtype.json`` in the package's cache
folder, :mod:`.machine_cache`; delete it to measure again), under this processor's name and flags,
torch's version, the thread count, the shapes, the probe's version and ``ONEDNN_MAX_CPU_ISA`` (which
caps the instructions oneDNN may use, e.g. ``AVX2`` forces a slow, emulated bfloat16): the same
machine makes the same choice every run. A close call is not stored: the next process measures it again.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import machine_cache
from .machine_cache import machine_key
from .packed_linear import PackedLinear, RowKernel, pack_weight, packed_product, packing_available

MARGIN = 1.1  #: bfloat16 must be this many times faster than float32 at every probed row count
PROBE_ROWS = (1, 16)  #: one sequence decoding, and a typical continuous batch
PROBE_BYTES = 32 << 20  #: float32 weight bytes the probe multiplies by, over several weights
PROBE_VERSION = 1  #: part of the cache key: a change to the probe measures again
SMALL_MODEL_BYTES = 64 << 20  #: float32 weights up to this size stay float32 under ``auto``
CACHE_NAME = "cpu-dtype"  #: the file of :mod:`.machine_cache` the choices are kept in
Measure = Callable[[int, int], dict[int, float]]

#: What the engine registered (:func:`multiply_bfloat16_with`): makes the row kernel its linear
#: layers multiply bfloat16 products of many rows with on this CPU, or returns ``None`` (oneDNN).
_row_kernel: Callable[[], RowKernel | None] | None = None


def multiply_bfloat16_with(factory: Callable[[], RowKernel | None] | None) -> None:
    """Register what makes the row kernel the engine multiplies bfloat16 with on this CPU (``None``
    from it: oneDNN's packed product; ``None`` here: forget it). The engine does so when imported."""
    global _row_kernel
    if factory is not None and not callable(factory):
        raise TypeError(f"factory must be callable or None, got {type(factory).__name__}")
    _row_kernel = factory


def engine_row_kernel() -> RowKernel | None:
    """The registered row kernel, if it takes products of many rows on this CPU (its ``wide``), else
    ``None``: what the probe times bfloat16 through."""
    kernel = _row_kernel() if _row_kernel is not None else None
    return kernel if getattr(kernel, "wide", False) else None


@dataclass(frozen=True)
class CpuDtypeChoice:
    """What ``auto`` chose on this CPU, and why (for the model-load line); ``speedups``: float32 time
    over bfloat16 time of the probe, by rows (empty when nothing was measured)."""

    dtype: torch.dtype
    reason: str
    speedups: dict[int, float] = field(default_factory=dict)


_chosen: dict[str, CpuDtypeChoice] = {}


def native_bfloat16() -> bool:
    """Whether torch reports that this CPU computes bfloat16 natively (oneDNN's own check)."""
    check = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else platform.machine() in ("arm64", "aarch64")
    except RuntimeError:
        return False


def choose_cpu_dtype(config: object, measure: Measure | None = None) -> CpuDtypeChoice:
    """The dtype ``auto`` serves the model of ``config`` in on this CPU (see the module docstring).

    ``measure(hidden, intermediate)`` returns ``{rows: float32 seconds / bfloat16 seconds}``; by
    default :func:`measure_speedups`, cached. A test passes its own to force a slow bfloat16."""
    stored = stored_dtype(config)
    if stored is None:
        return CpuDtypeChoice(torch.float32, "the checkpoint names no dtype")
    if stored not in (torch.bfloat16, torch.float16):
        name = str(stored).removeprefix("torch.")
        return CpuDtypeChoice(torch.float32, f"the checkpoint is stored in {name}")
    size = float32_weight_bytes(config)
    if size <= SMALL_MODEL_BYTES:
        return CpuDtypeChoice(torch.float32, f"a small model ({size / 2**20:.0f} MB in float32) stays in it")
    kernel = engine_row_kernel() if measure is None else None
    if measure is None and kernel is None and not native_bfloat16():
        return CpuDtypeChoice(torch.float32, "this CPU reports no native bfloat16 arithmetic")
    hidden, intermediate = _shapes(config)
    if measure is not None:
        return _decide(measure(hidden, intermediate))
    key = _key(hidden, intermediate, type(kernel).__name__ if kernel is not None else "packed")
    if key not in _chosen:
        speedups = _load(key)
        if speedups is None:
            speedups = measure_speedups(hidden, intermediate, kernel=kernel)
            if _close(speedups):  # near the margin: the median of three measurements decides
                runs = [
                    speedups,
                    measure_speedups(hidden, intermediate, kernel=kernel),
                    measure_speedups(hidden, intermediate, kernel=kernel),
                ]
                speedups = {r: sorted(run[r] for run in runs)[1] for r in speedups}
            if not _close(speedups):
                _store(key, speedups)
        if kernel is not None:
            through = "the engine's loops"
        else:  # what measure_speedups timed without them
            through = "oneDNN's packed product" if packing_available() else "F.linear"
        _chosen[key] = _decide(speedups, through)
    return _chosen[key]


def _close(speedups: dict[int, float]) -> bool:
    return any(MARGIN / 1.25 <= s <= MARGIN * 1.25 for s in speedups.values())


def _decide(speedups: dict[int, float], through: str = "") -> CpuDtypeChoice:
    threads = torch.get_num_threads()
    shown = " and ".join(f"{s:.2f}x at {r} row{'s' * (r != 1)}" for r, s in sorted(speedups.items()))
    measured = f"{shown}, {threads} thread{'s' * (threads != 1)}"
    measured += f", through {through}" if through else ""
    if min(speedups.values()) >= MARGIN:
        return CpuDtypeChoice(torch.bfloat16, f"its bfloat16 matmul is faster here: {measured}", speedups)
    reason = f"its bfloat16 matmul is not {MARGIN}x as fast here: {measured}"
    return CpuDtypeChoice(torch.float32, reason, speedups)


def measure_speedups(
    hidden: int, intermediate: int, rows: tuple[int, ...] = PROBE_ROWS, kernel: RowKernel | None = None
) -> dict[int, float]:
    """``{rows: float32 time / bfloat16 time}`` of ``x[rows, hidden] @ W[hidden, intermediate]`` over
    enough distinct weights to stream :data:`PROBE_BYTES` (best of 3 passes each; ~0.1 s); bfloat16
    through ``kernel`` where given (packed layers that try it first, as the engine's do)."""
    count = max(1, min(16, PROBE_BYTES // (4 * hidden * intermediate)))
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(intermediate, hidden, generator=gen) * 0.02 for _ in range(count)]
    halves = [w.to(torch.bfloat16) for w in weights]
    packed = [pack_weight(w) for w in halves] if packing_available() and kernel is None else None
    layers = [_layer(w, kernel) for w in halves] if kernel is not None else None
    speedups = {}
    with torch.inference_mode():
        for n in rows:
            x = torch.randn(n, hidden, generator=gen)
            half = x.to(torch.bfloat16)
            full_time = _best_of(3, lambda: [F.linear(x, w) for w in weights])  # noqa: B023
            if layers is not None:
                half_time = _best_of(3, lambda: [layer(half) for layer in layers])  # noqa: B023
            elif packed is not None:
                half_time = _best_of(3, lambda: [packed_product(half, p, None) for p in packed])  # noqa: B023
            else:
                half_time = _best_of(3, lambda: [F.linear(half, w) for w in halves])  # noqa: B023
            speedups[n] = full_time / half_time
    return speedups


def _layer(weight: torch.Tensor, kernel: RowKernel) -> PackedLinear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    return PackedLinear(linear, rows=kernel)


def _best_of(repeats: int, run: Callable[[], object]) -> float:
    run()  # warm-up: oneDNN builds its kernels on first use
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def stored_dtype(config: object) -> torch.dtype | None:
    """The dtype a model's config says its checkpoint is stored in (``dtype``, or the older
    ``torch_dtype``), or ``None``."""
    text = getattr(config, "get_text_config", lambda: config)()
    fields = text.to_dict() if hasattr(text, "to_dict") else vars(text)
    stored = fields.get("dtype") or fields.get("torch_dtype")
    if isinstance(stored, str):
        stored = getattr(torch, stored.removeprefix("torch."), None)
    return stored if isinstance(stored, torch.dtype) else None


def float32_weight_bytes(config: object) -> int:
    """The model's weight bytes in float32, from its config (a decoder-only transformer's layout:
    attention and MLP projections per layer, the embedding, and an output layer unless tied)."""
    text = getattr(config, "get_text_config", lambda: config)()
    hidden, intermediate = _shapes(config)
    heads = int(getattr(text, "num_attention_heads", 1) or 1)
    kv_dim = int(getattr(text, "num_key_value_heads", heads) or heads) * (hidden // heads)
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * intermediate
    vocab = int(getattr(text, "vocab_size", 0) or 0) * hidden
    tied = getattr(config, "tie_word_embeddings", True)
    return 4 * (int(getattr(text, "num_hidden_layers", 1) or 1) * per_layer + vocab * (1 if tied else 2))


def _shapes(config: object) -> tuple[int, int]:
    text = getattr(config, "get_text_config", lambda: config)()
    hidden = int(getattr(text, "hidden_size", 0) or 512)
    return hidden, int(getattr(text, "intermediate_size", 0) or 4 * hidden)


def _key(hidden: int, intermediate: int, through: str = "packed") -> str:
    parts = (f"{hidden}x{intermediate}", f"probe {PROBE_VERSION}")
    return machine_key(*parts) if through == "packed" else machine_key(*parts, through)


def _load(key: str) -> dict[int, float] | None:
    entry = machine_cache.load(CACHE_NAME, key)
    try:
        return {int(r): float(s) for r, s in entry.items()} if entry else None
    except (ValueError, AttributeError, TypeError):  # damaged or foreign: measure
        return None


def _store(key: str, speedups: dict[int, float]) -> None:
    machine_cache.store(CACHE_NAME, key, speedups)
