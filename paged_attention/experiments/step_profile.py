"""Where a decode step's time goes, measured with torch's profiler: products, attention, the rest.

A decode step of ``batch`` sequences is profiled for ``steps`` steps (after their prefills and a
warm-up) and its time split four ways:

* **matrix products**: the linear layers and the output layer (oneDNN's ``_linear_pointwise`` for
  packed bfloat16 weights, ``addmm``/``mm``/``linear`` otherwise, and the packed layers' profiler
  range, whose own time is their row kernels' loops and the Python around them): the weight reads
  of notebook 07;
* **attention**: everything inside the engine's attention function, which it marks as one
  profiler range named ``paged_attention`` (storing the new K/V, then attention over the cache: the
  in-place compiled kernel, or the gather and SDPA of the ``torch`` backend);
* **other operations**: every other PyTorch operation (norms, rotary embedding, activations,
  residual adds, the sampler's argmax, ...);
* **Python and the rest**: the step's time not inside any operation (transformers' module code,
  the scheduler, detokenization, the profiler's own cost).

The shares come from the profiled steps; the step time beside them is the median of as many
unprofiled steps just before (the profiler slows each operation a little).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence

import torch

from ..engine.llm_engine import LLMEngine
from ..models.packed_linear import PRODUCT_RANGE
from .dtypes import decoding_together

#: Operations counted as matrix products (self time).
PRODUCTS = frozenset(
    {"mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::linear", "aten::matmul", "aten::bmm",
     PRODUCT_RANGE}  # (the packed layers' range: their row kernels' loops are no PyTorch operation)
)  # fmt: skip
RANGE = "paged_attention"  # the engine's profiler range around attention (model_runner)
PARTS = ("matrix products", "attention", "other operations", "Python and the rest")


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (the profiler's C++ layer prints two status lines there per use)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _inside_attention(event: object) -> bool:
    parent = getattr(event, "cpu_parent", None)
    while parent is not None:
        if parent.name == RANGE:
            return True
        parent = parent.cpu_parent
    return False


def split(profile: torch.profiler.profile, wall_s: float) -> dict[str, float]:
    """Seconds of :data:`PARTS` in a profile that covered ``wall_s`` seconds of steps. A product
    inside attention (the math fallback of SDPA) counts as attention; the last part is what is
    left of ``wall_s`` (negative only if the profile's events overlapped, which they must not)."""
    products = attention = inside_attention = operations = 0.0
    for event in profile.events():
        if event.name == RANGE:
            attention += event.cpu_time_total / 1e6
        elif "::" in event.name:  # an operation (not a Python range of torch's own)
            seconds = event.self_cpu_time_total / 1e6
            operations += seconds
            if _inside_attention(event):
                inside_attention += seconds
            elif event.name in PRODUCTS:
                products += seconds
    other = operations - products - inside_attention
    return {
        "matrix products": products,
        "attention": attention,
        "other operations": other,
        "Python and the rest": wall_s - products - attention - other,
    }


def profile_decode(engine: LLMEngine, prompts: Sequence[dict], steps: int = 4, warmup: int = 2) -> dict:
    """Median step time of ``len(prompts)`` sequences decoding together (unprofiled), and the
    shares of :data:`PARTS` over ``steps`` profiled steps; the requests are aborted afterwards."""
    with decoding_together(engine, prompts, 2 * (warmup + steps) + 4, "profile"):
        times = []
        for step in range(warmup + steps):
            start = time.perf_counter()
            engine.step()
            if step >= warmup:
                times.append(time.perf_counter() - start)
        cpu = [torch.profiler.ProfilerActivity.CPU]
        with _quiet_stderr(), torch.profiler.profile(activities=cpu) as profile:
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            wall = time.perf_counter() - start
    seconds = split(profile, wall)
    return {
        "batch": len(prompts),
        "step_s": statistics.median(times),
        "share": {part: seconds[part] / wall for part in PARTS},
    }
