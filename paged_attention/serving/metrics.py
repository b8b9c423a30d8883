"""``GET /metrics``: the engine's metrics in Prometheus' text format, under vLLM's names.

The engine already counts what vLLM's server exports (:mod:`paged_attention.engine.metrics`:
running and waiting requests, KV-cache usage, prefix-cache queries and hits, preemptions, prompt
and generation tokens, finished requests by reason, and histograms of time to first token, time
per output token, end-to-end latency and queue time). A scrape reads those records on the engine
loop, between two steps, and this module writes them with ``prometheus_client``: a counter
``vllm:prompt_tokens`` is exported as ``vllm:prompt_tokens_total``, a histogram as its ``_bucket``,
``_count`` and ``_sum`` series, each with a ``model_name`` label, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ..engine.metrics import Counter, Gauge, Histogram
from ..engine.metrics import Metric as Record

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: One line of help per metric (Prometheus' ``# HELP``).
HELP = {
    "vllm:num_requests_running": "Requests in the running batch.",
    "vllm:num_requests_waiting": "Requests waiting to be scheduled (swapped ones included).",
    "vllm:kv_cache_usage_perc": "Fraction of the KV cache's blocks in use (1 = full).",
    "vllm:prompt_tokens": "Prompt tokens computed (prefix-cache hits excluded).",
    "vllm:generation_tokens": "Tokens generated.",
    "vllm:num_preemptions": "Preemptions of running sequences.",
    "vllm:prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "vllm:prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "vllm:request_success": "Finished requests, by finish reason.",
    "vllm:time_to_first_token_seconds": "Time from arrival to the first output token.",
    "vllm:inter_token_latency_seconds": "Mean gap between a request's output tokens.",
    "vllm:request_time_per_output_token_seconds": "Mean time per output token after the first (TPOT).",
    "vllm:e2e_request_latency_seconds": "Time from arrival to the last output token.",
    "vllm:request_queue_time_seconds": "Time from arrival to first being scheduled.",
    "vllm:request_prompt_tokens": "Prompt tokens per finished request.",
    "vllm:request_generation_tokens": "Output tokens per finished request.",
    "vllm:iteration_tokens_total": "Tokens (prompt and output) per engine step.",
    "vllm:spec_decode_num_drafts": "Speculative decoding: verification steps with drafts.",
    "vllm:spec_decode_num_draft_tokens": "Speculative decoding: drafted tokens.",
    "vllm:spec_decode_num_accepted_tokens": "Speculative decoding: drafted tokens the target accepted.",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "Speculative decoding: accepted drafts, by position.",
}


class _Records(Collector):
    """A one-shot collector over records already read from the engine."""

    def __init__(self, records: Iterable[Record], labels: dict[str, str]) -> None:
        self.records, self.labels = list(records), labels

    def collect(self) -> Iterator[Metric]:
        names = list(self.labels)
        counters: dict[str, CounterMetricFamily] = {}
        for record in self.records:
            help_text = HELP.get(record.name, record.name)
            values = [*self.labels.values(), *record.labels.values()]
            label_names = [*names, *record.labels]
            if isinstance(record, Counter):  # one family per name, a sample per label set
                family = counters.get(record.name)
                if family is None:
                    family = counters[record.name] = CounterMetricFamily(
                        record.name, help_text, labels=label_names
                    )
                family.add_metric(values, record.value)
            elif isinstance(record, Gauge):
                gauge = GaugeMetricFamily(record.name, help_text, labels=label_names)
                gauge.add_metric(values, record.value)
                yield gauge
            elif isinstance(record, Histogram):
                histogram = HistogramMetricFamily(record.name, help_text, labels=label_names)
                histogram.add_metric(values, list(record.buckets.items()), record.sum)
                yield histogram
        yield from counters.values()


def prometheus_text(records: Iterable[Record], model_name: str) -> bytes:
    """The records in Prometheus' text exposition format, each labelled with ``model_name``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Records(records, {"model_name": model_name}))
    return generate_latest(registry)
