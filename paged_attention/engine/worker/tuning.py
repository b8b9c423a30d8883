"""Which CPU kernel is faster on this machine, measured once: a few rows' products, and prompts' attention.

Two of the compiled backend's choices have no answer that holds on every CPU, so the engine measures
them on the model it serves, the first time it meets a machine:

* **a few rows' products**: oneDNN's packed product, or the engine's row kernel (bfloat16 weights
  streamed by :func:`..kernels.rows.linear_rows`, float32 ones from tiles summed in oneDNN's order,
  :mod:`..kernels.tiled`). On this project's 2-core AMD EPYC the row kernels read SmolLM2's weights
  at 1.3-1.7x oneDNN's pace at one row; on a 2-core Xeon with AMX, oneDNN was 1.2x (one row) to 1.9x
  (four rows) faster. The row kernel keeps the row counts, from one up, where a pass over every
  product of the model is at least :data:`MARGIN` times faster with it (``rows``; 0: none, and its
  prepared copies are dropped);
* **prompts' attention**: the in-place loop nest (:func:`..kernels.compiled.paged_prefill`), or the
  gathered pages and torch's SDPA: on the AMD EPYC the loop was 1.1x faster, on the Xeon SDPA was 2.9x
  faster in bfloat16 (its CPU flash kernel multiplies on AMX) and 1.5x in float32. Probed on
  :data:`PROMPTS` at the model's heads and the engine's block size (an 8-bit cache keeps the loop).

What was measured is kept on disk (:mod:`...models.machine_cache`, file ``tuning``) under this
machine, torch, the thread count, the dtype, the shapes and :data:`VERSION`; a close call (within
:data:`CLOSE` either way, among the row counts measured: up to the first the kernel loses) is not
stored, so the next engine measures again. Measuring costs about a second for SmolLM2, once per
machine; a model of at most :data:`SMALL_MODEL_BYTES` (the embedded one) is not measured and keeps
the loops, so that tests and notebooks do not depend on the machine's speed. Either way a float32
engine's greedy tokens are transformers' (the tests compare every path); where the tiles are
dropped, a float32 row decoded alone is oneDNN's one-row product again, which may round differently
from the same row in a batch (:mod:`..kernels.tiled`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ... import kernels
from ...models import machine_cache
from ...models.merged_projections import MergedProduct, product_owners
from ...models.packed_linear import PACKED_DTYPES, PackedLinear, RowKernel

MARGIN = 1.05  #: a row kernel is kept for a row count where it is at least this many times faster
CLOSE = 1.15  #: a ratio within this factor of the margin (or of 1 for prompts) is measured again
VERSION = 1  #: part of the cache key: a change to the probes measures again
CACHE_NAME = "tuning"
PROMPTS = (32, 96, 160, 300)  #: prompt lengths of the attention probe (one sequence each)
SMALL_MODEL_BYTES = 64 << 20  #: weights up to this size are not measured (as in ``models.cpu_dtype``)


@dataclass(frozen=True)
class Tuning:
    """The choices (``rows``: the most rows the row kernel takes, 0 none; ``prefill_in_place``) and
    what they rest on: ``rows_seconds[r] = (row kernel, oneDNN)`` and ``prefill_seconds = (in place,
    SDPA)``, seconds of one probe (empty where nothing was measured)."""

    rows: int
    prefill_in_place: bool
    rows_seconds: dict[int, tuple[float, float]]
    prefill_seconds: tuple[float, float] | None


def tune(
    model: torch.nn.Module, kernel: RowKernel | None, block_size: int, cache_dtype: torch.dtype
) -> Tuning:
    """Measure (or read back) this machine's choices for ``model`` (packed and merged, its layers
    given a row kernel, whose ``rows`` is the most it takes), then apply the row choice: the kernel's
    ``rows`` lowered, or, where it wins at no row count, taken from every layer with what it kept.
    A model of at most :data:`SMALL_MODEL_BYTES` is not measured (too quick to time against noise):
    it keeps the kernels, so that its results do not depend on the machine's speed."""
    dtype = next(model.parameters()).dtype
    if dtype not in PACKED_DTYPES:
        return decide({}, None)
    everyone = product_owners(model)
    with torch.inference_mode():  # bring every layer up to date (a weight changed since: rebuilt)
        for owner in everyone:
            owner.product(torch.zeros(1, owner.weight.shape[1], dtype=dtype))
    used = {id(o.rows): o.rows for o in everyone if o.rows is not None}
    kernel = next(iter(used.values())) if len(used) == 1 else kernel  # (an earlier engine's, shared)
    owners = [o for o in everyone if o.prepared is not None]
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    if sum(p.numel() * p.element_size() for p in model.parameters()) <= SMALL_MODEL_BYTES:
        return Tuning(int(getattr(kernel, "rows", 0)) if owners else 0, True, {}, None)
    measurable = kernels.compiled.available()
    probe_prefill = measurable and cache_dtype == dtype and dtype in kernels.compiled.DTYPES
    most = int(getattr(kernel, "rows", 0)) if owners and measurable else 0
    shapes = sorted({tuple(o.weight.shape) for o in owners})
    key = machine_cache.machine_key(
        dtype, type(kernel).__name__, most, shapes, (heads, kv_heads, head_dim, block_size), probe_prefill,
        f"tuning {VERSION}",
    )  # fmt: skip
    found = _parse(machine_cache.load(CACHE_NAME, key))
    if found is None:
        rows_seconds = {}
        for r in range(1, most + 1):  # up to the first row count the kernel loses
            rows_seconds[r] = measure_rows(owners, r, dtype)
            if decide(rows_seconds, None).rows < r:
                break
        shape = (heads, kv_heads, head_dim, block_size)
        prefill_seconds = measure_prefill(*shape, dtype) if probe_prefill else None
        found = rows_seconds, prefill_seconds
        if (rows_seconds or prefill_seconds) and not _close(rows_seconds, prefill_seconds):
            machine_cache.store(CACHE_NAME, key, {"rows": rows_seconds, "prefill": prefill_seconds})
    chosen = decide(*found)
    if kernel is not None and hasattr(kernel, "rows"):
        kernel.rows = chosen.rows
    if chosen.rows == 0:
        for owner in everyone:  # oneDNN's product throughout: the kept copies go (the tiles' memory)
            if owner.rows is kernel:
                owner.rows = owner.prepared = None
    return chosen


Seconds = dict[int, tuple[float, float]]  #: by row count: (row kernel, oneDNN)


def decide(rows_seconds: Seconds, prefill_seconds: tuple[float, float] | None) -> Tuning:
    """The choices the measurements make (see the module docstring)."""
    rows = 0
    for r in sorted(rows_seconds):
        kernel_s, onednn_s = rows_seconds[r]
        if kernel_s * MARGIN > onednn_s:
            break
        rows = r
    in_place = prefill_seconds is None or prefill_seconds[0] <= prefill_seconds[1]
    return Tuning(rows, in_place, rows_seconds, prefill_seconds)


def measure_rows(
    owners: list[PackedLinear | MergedProduct], rows: int, dtype: torch.dtype, repeats: int = 3
) -> tuple[float, float]:
    """Seconds of one pass over every product of ``owners`` at ``rows`` rows of ``dtype``: (with their
    row kernel, with oneDNN's packed product), best of ``repeats`` each, the two alternating."""
    generator = torch.Generator().manual_seed(rows)
    inputs = [torch.randn(rows, o.weight.shape[1], generator=generator).to(dtype) for o in owners]
    prepared = [o.prepared for o in owners]

    def run() -> None:
        for owner, x in zip(owners, inputs, strict=True):
            owner.product(x)

    def without() -> None:
        for owner in owners:
            owner.prepared = None
        try:
            run()
        finally:
            for owner, kept in zip(owners, prepared, strict=True):
                owner.prepared = kept

    with torch.inference_mode():
        return _alternating(run, without, repeats)


def measure_prefill(
    heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, repeats: int = 3
) -> tuple[float, float]:
    """Seconds of the prompts' attention over :data:`PROMPTS` (random pages): (in place, SDPA)."""
    generator = torch.Generator().manual_seed(0)
    counts = [-(-n // block_size) for n in PROMPTS]
    total = sum(counts)
    shape = (total, block_size, kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    tables = torch.zeros(len(PROMPTS), max(counts), dtype=torch.int32)
    order = torch.randperm(total, generator=generator).to(torch.int32)
    start = 0
    for i, count in enumerate(counts):
        tables[i, :count] = order[start : start + count]
        start += count
    seq_lens = torch.tensor(PROMPTS, dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(PROMPTS).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(PROMPTS), heads, head_dim, generator=generator).to(dtype)
    args = (query, key_cache, value_cache, tables, seq_lens, starts)

    def attend(in_place: bool) -> Callable[[], object]:
        return lambda: kernels.paged_prefill(*args, backend="compiled", in_place=in_place)

    with torch.inference_mode():
        return _alternating(attend(True), attend(False), repeats)


def _alternating(
    first: Callable[[], object], second: Callable[[], object], repeats: int
) -> tuple[float, float]:
    first(), second()  # warm-up: kernels compiled or loaded, oneDNN's primitives built
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, run in enumerate((first, second)):
            start = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def _close(rows_seconds: Seconds, prefill_seconds: tuple[float, float] | None) -> bool:
    ratios = [(o / k) / MARGIN for k, o in rows_seconds.values()]
    if prefill_seconds is not None:
        ratios.append(prefill_seconds[1] / prefill_seconds[0])
    return any(1 / CLOSE < r < CLOSE for r in ratios)


def _parse(entry: object) -> tuple[dict[int, tuple[float, float]], tuple[float, float] | None] | None:
    """A stored entry as measurements, or ``None`` where it is missing or not one."""
    try:
        rows = {int(r): (float(k), float(o)) for r, (k, o) in entry["rows"].items()}  # type: ignore[index]
        prefill = entry["prefill"]  # type: ignore[index]
        return rows, None if prefill is None else (float(prefill[0]), float(prefill[1]))
    except (TypeError, KeyError, ValueError, AttributeError, IndexError):
        return None
