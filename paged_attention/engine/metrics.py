"""Engine metrics under vLLM's names and types: what ``LLM.get_metrics()`` returns.

vLLM v1 keeps Prometheus metrics and reads them back for ``LLM.get_metrics()`` as
``Counter``/``Gauge``/``Histogram``/``Vector`` records (``vllm.v1.metrics.reader``); these classes
have the same names and fields, so vLLM's ``examples/offline_inference/metrics.py`` runs unchanged.
The :class:`EngineMetrics` collector is a part of the step's transaction (a rolled-back step counts
nothing). What is counted:

* counters: ``vllm:prompt_tokens`` (prompt tokens computed, prefix-cache hits excluded),
  ``vllm:generation_tokens``, ``vllm:request_success`` (one per finish reason),
  ``vllm:num_preemptions``, ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (tokens);
* gauges, read when asked: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (a fraction, as vLLM's despite the name);
* histograms, one observation per finished request (seconds, or tokens):
  ``vllm:time_to_first_token_seconds``, ``vllm:e2e_request_latency_seconds``,
  ``vllm:request_queue_time_seconds`` (arrival to first scheduled), ``vllm:request_prompt_tokens``,
  ``vllm:request_generation_tokens``, ``vllm:request_time_per_output_token_seconds`` (a request's
  mean gap between output tokens, TPOT), and per step ``vllm:iteration_tokens_total``;
  ``vllm:inter_token_latency_seconds`` also observes each request's mean gap, where vLLM observes
  every gap (the engine keeps no per-token times).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .outputs import RequestOutput

if TYPE_CHECKING:
    from ..memory.manager import KVCacheManager
    from .core.scheduler import Scheduler
    from .core.step import SchedulerOutput, StepUpdate
    from .spec_decode.speculation import SpecDecodingStats


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]  # cumulative counts by upper bound ("le"), "+Inf" last


#: Bucket upper bounds (vLLM's, shortened where its buckets pass what a laptop reaches).
SECONDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
           20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


@dataclass
class _Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; the last is +Inf
    total: float = 0.0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def record(self, name: str) -> Histogram:
        counts = self.counts or [0] * (len(self.bounds) + 1)
        cumulative, running = {}, 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], counts, strict=True):
            running += count
            cumulative[bound] = running
        return Histogram(name, {}, running, self.total, cumulative)


class EngineMetrics:
    """Counts what the engine did (see the module docstring); :meth:`read` turns it into records."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: dict[str, int] = {}
        self.histograms = {
            "vllm:time_to_first_token_seconds": _Histogram(SECONDS),
            "vllm:inter_token_latency_seconds": _Histogram(SECONDS),
            "vllm:e2e_request_latency_seconds": _Histogram(SECONDS),
            "vllm:request_queue_time_seconds": _Histogram(SECONDS),
            "vllm:request_time_per_output_token_seconds": _Histogram(SECONDS),
            "vllm:request_prompt_tokens": _Histogram(TOKENS),
            "vllm:request_generation_tokens": _Histogram(TOKENS),
            "vllm:iteration_tokens_total": _Histogram(TOKENS),
        }
        self._saved: tuple | None = None

    def record_step(self, out: SchedulerOutput, update: StepUpdate) -> None:
        """A step's tokens: prompt tokens it computed (a chunk's part inside the prompt), and the
        tokens it appended (every token of ``update``: one per sampled sequence)."""
        num_prompt_tokens = sum(
            max(0, min(s.start + s.num_new_tokens, len(s.seq.prompt_token_ids)) - s.start)
            for s in out.scheduled
        )
        num_generation_tokens = sum(len(tokens) for _, tokens in update.tokens)
        self.prompt_tokens += num_prompt_tokens
        self.generation_tokens += num_generation_tokens
        if num_prompt_tokens + num_generation_tokens:
            self.histograms["vllm:iteration_tokens_total"].observe(num_prompt_tokens + num_generation_tokens)

    def record_abort(self) -> None:
        self.success["abort"] = self.success.get("abort", 0) + 1

    def record_finished(self, output: RequestOutput) -> None:
        reasons = [o.finish_reason for o in output.outputs if o.finish_reason]
        reason = reasons[0] if reasons else "abort"
        self.success[reason] = self.success.get(reason, 0) + 1
        m, h = output.metrics, self.histograms
        h["vllm:request_prompt_tokens"].observe(len(output.prompt_token_ids))
        h["vllm:request_generation_tokens"].observe(m.num_output_tokens)
        if m.time_to_first_token is not None:
            h["vllm:time_to_first_token_seconds"].observe(m.time_to_first_token)
        if m.finished_time is not None:
            h["vllm:e2e_request_latency_seconds"].observe(m.finished_time - m.arrival_time)
        if m.queue_time is not None:
            h["vllm:request_queue_time_seconds"].observe(m.queue_time)
        tpot = m.time_per_output_token(m.num_output_tokens)
        if tpot is not None:
            h["vllm:inter_token_latency_seconds"].observe(tpot)
            h["vllm:request_time_per_output_token_seconds"].observe(tpot)

    def read(self, scheduler: Scheduler, cache_manager: KVCacheManager) -> list[Metric]:
        """The records: the gauges read now from the scheduler and the cache manager (as are the
        preemption and prefix-cache counters, kept there), the rest counted here."""
        num_running, num_preemptions = len(scheduler.running), scheduler.num_preemptions
        num_waiting = len(scheduler.waiting) + len(scheduler.swapped)
        kv_usage = cache_manager.usage
        stats = getattr(cache_manager, "prefix_cache_stats", None)
        prefix_queries, prefix_hits = (stats.queries, stats.hits) if stats else (0, 0)
        records: list[Metric] = [
            Gauge("vllm:num_requests_running", {}, float(num_running)),
            Gauge("vllm:num_requests_waiting", {}, float(num_waiting)),
            Gauge("vllm:kv_cache_usage_perc", {}, float(kv_usage)),
            Counter("vllm:prompt_tokens", {}, self.prompt_tokens),
            Counter("vllm:generation_tokens", {}, self.generation_tokens),
            Counter("vllm:num_preemptions", {}, num_preemptions),
            Counter("vllm:prefix_cache_queries", {}, prefix_queries),
            Counter("vllm:prefix_cache_hits", {}, prefix_hits),
        ]
        for reason in ("stop", "length", "abort"):
            records.append(
                Counter("vllm:request_success", {"finished_reason": reason}, self.success.get(reason, 0))
            )
        records += [h.record(name) for name, h in self.histograms.items()]
        return records

    @staticmethod
    def speculative(stats: SpecDecodingStats) -> list[Metric]:
        """vLLM v1's speculative-decoding counters (``vllm:spec_decode_*``), acceptances per draft
        position labelled ``position``."""
        records: list[Metric] = [
            Counter("vllm:spec_decode_num_drafts", {}, stats.num_drafts),
            Counter("vllm:spec_decode_num_draft_tokens", {}, stats.num_draft_tokens),
            Counter("vllm:spec_decode_num_accepted_tokens", {}, stats.num_accepted_tokens),
        ]
        for position, count in enumerate(stats.accepted_per_position):
            records.append(
                Counter("vllm:spec_decode_num_accepted_tokens_per_pos", {"position": str(position)}, count)
            )
        return records

    # -- a step is a transaction (:mod:`.transaction`): a few dozen numbers ----------------------
    def begin(self) -> None:
        histograms = {name: (list(h.counts), h.total) for name, h in self.histograms.items()}
        self._saved = (self.prompt_tokens, self.generation_tokens, dict(self.success), histograms)

    def commit(self) -> None:
        self._saved = None

    def rollback(self) -> None:
        if self._saved is not None:
            self.prompt_tokens, self.generation_tokens, self.success, histograms = self._saved
            for name, (counts, total) in histograms.items():
                self.histograms[name].counts, self.histograms[name].total = counts, total
        self._saved = None
