"""What a streaming client measures, and the summary ``bench serve`` prints (``vllm bench serve``'s).

Per request, from the time it was sent and the times its chunks arrived (:func:`stream_metrics`):

* **TTFT**, time to first token: first chunk - send;
* **ITL**, inter-token latencies: the gaps between consecutive chunks (a chunk may carry several
  tokens: a gap is per chunk, as vLLM's benchmark counts it; every chunk with a choice counts, the
  last one too, whose end-of-sequence token has no text);
* **TPOT**, time per output token after the first: (last chunk - first chunk) / (tokens - 1);
* **E2EL**, end-to-end latency: last chunk - send; and the paper's **normalized latency**,
  E2EL / output tokens (s/token, Figure 12's y axis).

Over a run (:func:`summarize`): mean, median and p99 of each; request and token throughput over
the run's duration; and **goodput**: requests per second that met every SLO given (e.g. TTFT <= 2 s
and TPOT <= 0.2 s), the rate a service can promise, not just the rate it survives.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

#: The SLO names ``--goodput`` accepts (milliseconds on the command line, seconds here).
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class StreamMetrics:
    """One request's latencies (seconds); ``tpot`` is ``None`` for a single-token output."""

    ttft: float
    itl: list[float]
    tpot: float | None
    e2el: float


def stream_metrics(send_time: float, chunk_times: Sequence[float], num_tokens: int) -> StreamMetrics:
    """The latencies of one streamed request (see the module docstring). ``chunk_times``: when each
    chunk that carried output tokens arrived (text or not), in order; ``num_tokens``: output tokens
    in all."""
    if not chunk_times:
        raise ValueError("chunk_times is empty: a request that produced no output has no latencies")
    if num_tokens < len(chunk_times):
        raise ValueError(
            f"num_tokens={num_tokens} is fewer than the {len(chunk_times)} chunks that carried output"
        )
    if any(b < a for a, b in zip([send_time, *chunk_times], chunk_times, strict=False)):
        raise ValueError("chunk_times must be in order, none before send_time")
    first, last = chunk_times[0], chunk_times[-1]
    itl = [b - a for a, b in itertools.pairwise(chunk_times)]
    tpot = (last - first) / (num_tokens - 1) if num_tokens > 1 else None
    return StreamMetrics(first - send_time, itl, tpot, last - send_time)


@dataclass
class RequestResult:
    """What the client saw of one request."""

    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    metrics: StreamMetrics | None = None
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None
    status: int | None = None
    send_time: float = 0.0  # seconds since the run started
    chunk_times: list[float] = field(default_factory=list, repr=False)


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """Mean, median and p99 (linear interpolation, as numpy's default); NaN for no values."""
    if not values:
        return {"mean": math.nan, "median": math.nan, "p99": math.nan}
    ordered = sorted(values)
    rank = 0.99 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    p99 = ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
    return {"mean": statistics.fmean(ordered), "median": statistics.median(ordered), "p99": p99}


def meets(metrics: StreamMetrics, slos: dict[str, float]) -> bool:
    """Whether a request met every SLO (seconds; a TPOT SLO is met by a one-token output)."""
    for name, limit in slos.items():
        if name not in SLO_METRICS:
            raise ValueError(f"SLO names must be among {SLO_METRICS}, got {name!r}")
        value = getattr(metrics, name)
        if value is not None and value > limit:
            return False
    return True


def summarize(
    results: Sequence[RequestResult], duration: float, slos: dict[str, float] | None = None
) -> dict:
    """The run's summary (see the module docstring); ``duration`` in seconds, ``slos`` in seconds."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0 s, got {duration}")
    done = [r for r in results if r.ok and r.metrics is not None]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    summary = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "ttft_s": percentiles([r.metrics.ttft for r in done]),  # type: ignore[union-attr]
        "tpot_s": percentiles([r.metrics.tpot for r in done if r.metrics.tpot is not None]),  # type: ignore[union-attr]
        "itl_s": percentiles([gap for r in done for gap in r.metrics.itl]),  # type: ignore[union-attr]
        "e2el_s": percentiles([r.metrics.e2el for r in done]),  # type: ignore[union-attr]
        "normalized_latency_s_per_token": percentiles(
            [r.metrics.e2el / r.output_tokens for r in done if r.output_tokens]  # type: ignore[union-attr]
        ),
    }
    if slos:
        good = sum(meets(r.metrics, slos) for r in done)  # type: ignore[arg-type]
        summary["slos_s"] = dict(slos)
        summary["good_requests"] = good
        summary["goodput"] = good / duration
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = f"{r.status}: {(r.error or '')[:60]}"
            errors[key] = errors.get(key, 0) + 1
    summary["errors"] = errors
    return summary
