"""The paper's memory experiments, replayed: serve a trace with one cache manager, summarize the run.

Every experiment of notebooks 06-07 and of ``python -m paged_attention bench
fragmentation|capacity|latency|block-size`` is a set of calls to :func:`serve`: the real scheduler
and a real cache manager (paged, or a contiguous baseline) replay a synthetic trace through the
trace executor (:mod:`paged_attention.experiments.replay`), with each step timed by the roofline cost model of
OPT-13B on an A100-40GB (:mod:`paged_attention.experiments.paper`). No model runs, so an hour of GPU traffic
takes seconds on a laptop; what is measured is the memory managers, nothing else.

Two averages, as in the paper:

* **memory shares** (Figure 2) are time averages over the steps in which some request was waiting,
  i.e. while memory was the bottleneck (an empty cache ramping up, or draining after the last
  arrival, says nothing about a memory manager). Each manager is averaged over *its own* such
  steps (``ServeRun.saturated_share`` says how much of its run that was), and over the whole run
  if no request ever waited for it: then its free memory is room it did not need, not waste. The
  paper's caption says only "during the experiment in §6.2"; this window is our reading;
* **batched requests** (Figure 13) are time averages over the whole run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from . import paper
from .replay import cost_model_step_time, run_trace
from .traces import TraceRequest


@dataclass(frozen=True)
class ServeRun:
    """What one manager did with one trace."""

    manager: str
    placement: str
    memory: dict[str, float]  # category -> time-averaged share of the cache, while saturated (if ever)
    mean_batch: float  # running sequences, time-averaged over the run
    peak_batch: int
    preemptions: int
    duration: float  # seconds of (modelled) GPU time
    normalized_latency: float  # mean over requests of (finish - arrival) / output tokens, s/token
    saturated_share: float  # share of the run during which some request was waiting

    @property
    def memory_window(self) -> str:
        """What ``memory`` averages over: the steps with a request waiting, or the whole run."""
        return "steps with a request waiting" if self.saturated_share > 0 else "the whole run (none waited)"

    def as_dict(self) -> dict:
        return asdict(self)


def serve(
    trace: Sequence[TraceRequest],
    manager: str,
    *,
    placement: str = "buddy",
    num_slots: int = paper.KV_SLOTS,
    block_size: int = paper.BLOCK_SIZE,
    max_model_len: int = paper.MAX_MODEL_LEN,
    step_overhead: float = paper.STEP_OVERHEAD,
    report_every: int = 5,
    max_num_batched_tokens: int = 2560,
    progress: bool = False,
) -> ServeRun:
    """Serve ``trace`` (arrival times in seconds) with ``manager`` (``"paged"``, ``"max"``, ...).

    ``max_num_batched_tokens`` is vLLM's 2023 default (2560) and applies to every manager alike.
    ``report_every=0`` skips memory reports (faster, for latency sweeps).
    """
    cache = paper.make_manager(manager, num_slots, max_model_len, block_size, placement)
    paged = manager == "paged"
    step_time = cost_model_step_time(paper.cost_model(step_overhead), block_size if paged else None)
    result = run_trace(
        trace, cache, max_num_batched_tokens=max_num_batched_tokens, step_time=step_time,
        report_every=report_every, progress=progress,
    )  # fmt: skip
    saturated = sum(s.duration for s in result.steps if s.num_waiting)
    latency = sum((result.finish_time[i] - r.arrival_time) / r.output_len for i, r in enumerate(trace)) / len(
        trace
    )
    return ServeRun(
        manager=manager,
        placement=f"blocks of {block_size}" if paged else placement,
        memory=result.mean_memory(saturated_only=saturated > 0) if report_every else {},
        mean_batch=result.time_mean_running,
        peak_batch=result.peak_running,
        preemptions=result.num_preemptions,
        duration=result.duration,
        normalized_latency=latency,
        saturated_share=saturated / result.duration if result.duration else 0.0,
    )


def figure2_stack(memory: dict[str, float]) -> tuple[float, float, float, float]:
    """A run's memory shares as the paper's four Figure 2 segments, in percent.

    The segments are ``paper.FIG2_CATEGORIES``: token states, reservation, internal fragmentation,
    and "external frag. & others" (external fragmentation plus free memory).
    """
    return (
        100 * memory["token_states"],
        100 * memory["reserved"],
        100 * memory["internal_fragmentation"],
        100 * (memory["external_fragmentation"] + memory["free"]),
    )


def sustainable_rate(rates: Sequence[float], latencies: Sequence[float], threshold: float) -> float:
    """The request rate at which normalized latency first crosses ``threshold`` (linear interpolation).

    Returns the last rate if it never does and 0.0 if even the first is above it.
    """
    if latencies[0] > threshold:
        return 0.0
    for i in range(1, len(rates)):
        if latencies[i] > threshold:
            r0, r1, l0, l1 = rates[i - 1], rates[i], latencies[i - 1], latencies[i]
            return r0 + (r1 - r0) * (threshold - l0) / (l1 - l0)
    return rates[-1]
