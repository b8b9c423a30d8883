"""Which kernel multiplies a few rows faster on this machine, measured once per machine and model.

The compiled backend's products of a few rows (a step of one to four sequences) can go to oneDNN's
packed product or to the engine's row kernel (bfloat16 weights streamed from a copy laid out as
read, :class:`..kernels.rows.Streamed`, float32 ones from tiles summed in oneDNN's order,
:mod:`..kernels.tiled`). Neither wins everywhere: on this project's 2-core AMD EPYC (AVX512-BF16),
before the column loop took the bfloat16 products of such CPUs (tuning version 8, below), a pass of
the row loop over SmolLM2's products took 13.2 ms at one row against oneDNN's 23.6, 14.6 against
25.3 at two, 16.4 against 21.5 at three, 17.8 against 20.5 at four (since tuning version 6, the loop
reading a copy of each weight laid out as it reads it, on 64-byte lines: 21.6 against 21.8 at one
row before, a tie); on a 2-core Xeon with AMX the bfloat16 row loop (in vector lanes since tuning
version 3) took 30.3 ms a pass at one row against oneDNN's 34.2, and 35.4 against 33.7 at two rows
(so: one row; that Xeon, which has AVX512-BF16 too, now takes the column loop, not measured there;
these passes call each layer as the engine does, Python included, where
:func:`..kernels.rows.linear_rows` quotes the loops alone). So the engine measures, on the model it
serves: for each row count from one up (:data:`COUNTS`, up to the kernel's ``most``: 64 where the
CPU multiplies bfloat16 pairs, :mod:`..kernels.loop_columns`; there, since version 8, the AMD EPYC:
22.6 against 34.5 ms at 8 rows, 39.2 against 42.6 at 16, 95.0 against 102.6 at 64, so all 64; a CPU
where the kernel already loses at two or three rows never tries more), a pass over every product of
the model with the row kernel and with oneDNN; the row kernel keeps the counts where it is at least
:data:`MARGIN` times faster (``rows``; 0: none, and its prepared copies are dropped, unless the
kernel also widens products of many rows, :mod:`..kernels.widened`: then it keeps them for that, and
takes every product of more than :data:`..kernels.rows.LINEAR_ROWS` rows whatever was chosen). A
float32 model is also timed at one row through torch's own ``F.linear`` (MKL's matrix-vector
product, :func:`...models.packed_linear.one_row`), against oneDNN in alternation: where it is at
least :data:`MARGIN` times faster than both others, every layer takes it for one row (``gemv``). On
an Ice Lake Xeon it read SmolLM2's weights at 12.3-13.1 GB/s, oneDNN at 9.7-10.5 and the tiles at
8.4-9.2 (one thread; a compiled decode step of one sequence went from 67.9 to 56.5 ms).

Prompts are not a measured choice. torch's SDPA over the gathered pages was once 2.9x faster than
the in-place loop on that Xeon in bfloat16 (today's AMX loop takes 0.67-0.77x of SDPA's time,
:mod:`..kernels.loop_amx`), but SDPA computes a row differently depending on the rows beside it, so
a prompt whose prefix came from the prefix cache got other bits than the same prompt computed whole,
and other greedy text (vLLM's own ``prefix_caching.py`` example then prints ``Generated answers are
the same: False``; vLLM prints True). The loop computes each row alone, the same either way.

What was measured is kept on disk (:mod:`...models.machine_cache`, file ``tuning``) under this
machine, torch, the thread count, the dtype, the shapes and :data:`VERSION`; a close call (within
:data:`CLOSE` either way, among the row counts measured up to :data:`..kernels.rows.LINEAR_ROWS`)
is not stored, so the next engine measures again. Measuring costs about a second for SmolLM2 (a
few where it measures up to 64 rows), once per machine; a model of at most
:data:`SMALL_MODEL_BYTES` (the embedded one) is not measured and keeps
the row kernels, so that tests and notebooks do not depend on the machine's speed. Either way a
float32 engine's greedy tokens are transformers' (the tests compare every path); where the tiles are
dropped, a float32 row decoded alone is oneDNN's one-row product again, which may round differently
from the same row in a batch (:mod:`..kernels.tiled`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ... import kernels
from ...kernels import widened
from ...kernels.rows import LINEAR_ROWS, Streamed
from ...models import cpu_dtype, machine_cache
from ...models.merged_projections import MergedProduct, product_owners
from ...models.packed_linear import PACKED_DTYPES, PackedLinear, RowKernel
from ...models.resolve import explain_dtype  # noqa: F401  (re-exported as paged_attention.explain_dtype)

MARGIN = 1.05  #: a row kernel is kept for a row count where it is at least this many times faster
CLOSE = 1.15  #: a ratio within this factor of the margin is measured again
VERSION = 8  #: part of the cache key: a change to the probes or the kernels measures again
#: The row counts measured, from one up to the kernel's ``most`` (a count between two measured
#: ones goes as the larger does: the kernel's time grows with the rows as oneDNN's does).
COUNTS = (1, 2, 3, 4, 8, 12, 16, 24, 32, 48, 64)
CACHE_NAME = "tuning"
SMALL_MODEL_BYTES = 64 << 20  #: weights up to this size are not measured (as in ``models.cpu_dtype``)


def bfloat16_row_kernel(invariant: bool = False) -> Streamed | None:
    """The loops every bfloat16 product takes on a CPU without bfloat16 arithmetic, whatever the
    attention backend (oneDNN emulates it there: on an Ice Lake Xeon SmolLM2's MLP product ran 0.6x
    float32's speed at 16 rows, the loops 1.56x); ``None`` elsewhere, or without Numba. Registered
    with ``dtype="auto"``'s probe (:func:`...models.cpu_dtype.multiply_bfloat16_with`), which then
    times them. With ``invariant`` (an engine in batch-invariant mode) also where the CPU multiplies
    bfloat16 pairs but has no AMX tiles for oneDNN, taking no rows of its own (``rows`` 0): there
    the mode's products go whole through its loops (:meth:`..kernels.rows.Streamed.invariant`),
    each row alone, instead of oneDNN's chunks of 16 rows, padded (a decode step of one sequence
    computed 16; on the AMD EPYC, SmolLM2, one thread: 16.5 -> 30.4 tokens/s for one prompt). With
    AMX oneDNN's chunks stay (their tile products were not measured against the loops)."""
    if not kernels.compiled.available():
        return None
    if widened.needed():
        return Streamed()
    paired = Streamed(rows=0, wide=False)
    return paired if invariant and paired.paired and not _tiles() else None


def _tiles() -> bool:
    """Whether the CPU has AMX-BF16 (as LLVM reads the host), which oneDNN multiplies on."""
    from llvmlite import binding  # (Numba's: present where kernels.compiled.available())

    return bool(binding.get_host_cpu_features().get("amx-bf16", False))


cpu_dtype.multiply_bfloat16_with(bfloat16_row_kernel)


@dataclass(frozen=True)
class Tuning:
    """The choice (``rows``: the most rows the row kernel takes, 0 none; ``gemv``: one float32 row
    through ``F.linear``) and what it rests on: ``rows_seconds[r] = (row kernel, oneDNN)`` and
    ``gemv_seconds = (F.linear, oneDNN)``, seconds of one pass (empty, ``None``: not measured)."""

    rows: int
    rows_seconds: dict[int, tuple[float, float]]
    gemv: bool = False
    gemv_seconds: tuple[float, float] | None = None


def tune(model: torch.nn.Module, kernel: RowKernel | None) -> Tuning:
    """Measure (or read back) this machine's choices for ``model`` (packed and merged, its layers
    given a row kernel, whose ``rows`` is the most it takes), then apply the row choice: the kernel's
    ``rows`` lowered, or, where it wins at no row count, taken from every layer with what it kept
    (kept where the kernel widens products of many rows: its ``wide``).
    A model of at most :data:`SMALL_MODEL_BYTES` is not measured (too quick to time against noise):
    it keeps the kernels, so that its results do not depend on the machine's speed."""
    dtype = next(model.parameters()).dtype
    if dtype not in PACKED_DTYPES:
        return decide({})
    everyone = product_owners(model)
    with torch.inference_mode():  # bring every layer up to date (a weight changed since: rebuilt)
        for owner in everyone:
            owner.product(torch.zeros(1, owner.weight.shape[1], dtype=dtype))
    used = {id(o.rows): o.rows for o in everyone if o.rows is not None}
    kernel = next(iter(used.values())) if len(used) == 1 else kernel  # (an earlier engine's, shared)
    owners = [o for o in everyone if o.prepared is not None]
    if sum(p.numel() * p.element_size() for p in model.parameters()) <= SMALL_MODEL_BYTES:
        return Tuning(int(getattr(kernel, "rows", 0)) if owners else 0, {})
    most = int(getattr(kernel, "most", getattr(kernel, "rows", 0)))  # (a Streamed: more where paired)
    most = most if owners and kernels.compiled.available() else 0
    shapes = sorted({tuple(o.weight.shape) for o in owners})
    key = machine_cache.machine_key(dtype, type(kernel).__name__, most, shapes, f"tuning {VERSION}")
    stored = _parse(machine_cache.load(CACHE_NAME, key))
    if stored is None:
        found: Seconds = {}
        if most and hasattr(kernel, "rows"):
            kernel.rows = most  # (while measuring it takes every count measured)
        for r in [c for c in COUNTS if c <= most]:  # up to the first row count the kernel loses
            found[r] = measure_rows(owners, r, dtype)
            if decide(found).rows < r:
                break
        gemv = measure_gemv(everyone) if dtype == torch.float32 else None
        if (found or gemv) and not _close(found, gemv):
            machine_cache.store(CACHE_NAME, key, {"rows": found, "gemv": gemv})
        stored = found, gemv
    chosen = decide(*stored)
    for owner in everyone:
        owner.gemv = chosen.gemv
    if kernel is not None and hasattr(kernel, "rows"):
        kernel.rows = chosen.rows
    if chosen.rows == 0 and not getattr(kernel, "wide", False):  # (a kernel that widens keeps them)
        for owner in everyone:  # oneDNN's product throughout: the kept copies go (the tiles' memory)
            if owner.rows is kernel:
                owner.rows = owner.prepared = None
    return chosen


Seconds = dict[int, tuple[float, float]]  #: by row count: (row kernel, oneDNN)


def decide(rows_seconds: Seconds, gemv_seconds: tuple[float, float] | None = None) -> Tuning:
    """The choice the measurements make (see the module docstring)."""
    rows = 0
    for r in sorted(rows_seconds):
        kernel_s, onednn_s = rows_seconds[r]
        if kernel_s * MARGIN > onednn_s:
            break
        rows = r
    gemv = False
    if gemv_seconds is not None:
        gemv_s, onednn_s = gemv_seconds
        kernel_s = rows_seconds[1][0] if rows else float("inf")
        gemv = gemv_s * MARGIN <= min(onednn_s, kernel_s)
    return Tuning(rows, rows_seconds, gemv, gemv_seconds)


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


def measure_gemv(owners: list[PackedLinear | MergedProduct], repeats: int = 3) -> tuple[float, float]:
    """Seconds of one pass over every product of ``owners`` (float32) at one row: (through
    ``F.linear``, through oneDNN's packed product), best of ``repeats`` each, the two alternating."""
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, o.weight.shape[1], generator=generator) for o in owners]
    kept = [(o.gemv, o.prepared) for o in owners]

    def run(gemv: bool) -> None:
        for owner in owners:
            owner.gemv, owner.prepared = gemv, None
        try:
            for owner, x in zip(owners, inputs, strict=True):
                owner.product(x)
        finally:
            for owner, (was, prepared) in zip(owners, kept, strict=True):
                owner.gemv, owner.prepared = was, prepared

    with torch.inference_mode():
        return _alternating(lambda: run(True), lambda: run(False), repeats)


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


def _close(rows_seconds: Seconds, gemv_seconds: tuple[float, float] | None = None) -> bool:
    """Whether a measurement of a few rows (at most :data:`..kernels.rows.LINEAR_ROWS`, a decode
    step's usual product) or of the one-row float32 probe came within :data:`CLOSE` of the margin:
    past a few rows the kernel meets oneDNN somewhere, by definition close, and what is chosen
    there matters less."""
    few = [t for r, t in rows_seconds.items() if r <= LINEAR_ROWS]
    pairs = [*few, *([gemv_seconds] if gemv_seconds else [])]
    return any(1 / CLOSE < (o / k) / MARGIN < CLOSE for k, o in pairs)


def _parse(entry: object) -> tuple[Seconds, tuple[float, float] | None] | None:
    """A stored entry as measurements (by row count; at one row through ``F.linear``, or ``None``),
    or ``None`` where it is missing or not one."""
    try:
        rows = {int(r): (float(k), float(o)) for r, (k, o) in entry["rows"].items()}  # type: ignore[index]
        gemv = entry["gemv"]  # type: ignore[index]
        return rows, None if gemv is None else (float(gemv[0]), float(gemv[1]))
    except (TypeError, KeyError, ValueError, AttributeError, IndexError):
        return None
