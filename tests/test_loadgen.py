"""The load generator's arithmetic: arrivals, workloads, per-request latencies, the run's summary,
and a /metrics page read back (the HTTP side is tested against a live server in test_serving*)."""

from __future__ import annotations

import math
import statistics

import pytest

from paged_attention.experiments import loadgen
from paged_attention.experiments.latency_stats import RequestResult, percentiles, stream_metrics, summarize


def test_arrivals_have_the_mean_and_spread_asked_for() -> None:
    for burstiness in (0.25, 1.0, 4.0):
        times = loadgen.arrival_times(20000, 5.0, burstiness, seed=3)
        gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
        assert all(g >= 0 for g in gaps)
        assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.05)
        cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
        assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)
    assert loadgen.arrival_times(4, math.inf) == [0.0] * 4
    assert loadgen.arrival_times(5, 2.0, seed=1) == loadgen.arrival_times(5, 2.0, seed=1)
    assert loadgen.arrival_times(5, 2.0, seed=1) != loadgen.arrival_times(5, 2.0, seed=2)


@pytest.mark.parametrize(
    "args, match",
    [((0, 1.0), "num_requests"), ((3, 0.0), "rate"), ((3, -1.0), "rate"), ((3, 1.0, 0.0), "burstiness"),
     ((3, 1.0, math.inf), "burstiness"), ((True, 1.0), "num_requests")],
)  # fmt: skip
def test_bad_arrival_arguments_are_refused(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        loadgen.arrival_times(*args)


def test_sharegpt_workload_fits_the_model_and_cuts_prompts_from_the_pool() -> None:
    pool = list(range(100, 400))
    requests = loadgen.sharegpt_workload(50, pool, max_model_len=64, length_scale=0.5, seed=0)
    assert len(requests) == 50
    for r in requests:
        assert r.prompt and all(t in pool for t in r.prompt) and r.ignore_eos
        assert len(r.prompt) + r.max_tokens <= 64 and r.max_tokens >= 1
        assert r.endpoint == "/v1/completions"
    assert requests == loadgen.sharegpt_workload(50, pool, 64, 0.5, seed=0)
    chat = loadgen.chat_workload(3, max_tokens=8)
    assert all(r.endpoint == "/v1/chat/completions" and r.max_tokens == 8 for r in chat)
    with pytest.raises(ValueError, match="length_scale"):
        loadgen.sharegpt_workload(2, pool, 64, length_scale=2.0)


def test_stream_metrics_count_tokens_not_chunks() -> None:
    m = stream_metrics(10.0, [10.5, 10.7, 11.5], num_tokens=6)  # the last chunk carries 4 tokens
    assert m.ttft == pytest.approx(0.5) and m.e2el == pytest.approx(1.5)
    assert m.itl == pytest.approx([0.2, 0.8]) and m.tpot == pytest.approx(1.0 / 5)
    assert stream_metrics(0.0, [0.3], 1).tpot is None
    with pytest.raises(ValueError):
        stream_metrics(0.0, [], 1)
    with pytest.raises(ValueError):
        stream_metrics(1.0, [0.5], 1)  # a chunk before the request was sent


def test_summary_throughput_percentiles_and_goodput() -> None:
    fast = RequestResult(True, 10, 5, stream_metrics(0.0, [0.1, 0.2, 0.3, 0.4, 0.5], 5))
    slow = RequestResult(True, 10, 5, stream_metrics(0.0, [2.0, 2.4, 2.8, 3.2, 3.6], 5))
    failed = RequestResult(False, error="boom", status=503)
    summary = summarize([fast, slow, failed], duration=4.0, slos={"ttft": 1.0, "tpot": 0.5})
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["output_throughput"] == pytest.approx(10 / 4) and summary["request_throughput"] == 0.5
    assert summary["ttft_s"]["mean"] == pytest.approx(1.05) and summary["good_requests"] == 1
    assert summary["goodput"] == pytest.approx(0.25)
    assert summary["normalized_latency_s_per_token"]["mean"] == pytest.approx((0.5 / 5 + 3.6 / 5) / 2)
    assert summary["errors"] == {"503: boom": 1}
    assert percentiles(list(range(101)))["p99"] == pytest.approx(99.0)
    assert math.isnan(percentiles([])["mean"])
    with pytest.raises(ValueError, match="SLO"):
        summarize([fast], 1.0, {"latency": 1.0})


def test_a_metrics_page_reads_back() -> None:
    from paged_attention.engine.metrics import Counter, Gauge, Histogram
    from paged_attention.serving.metrics import prometheus_text

    records = [
        Gauge("vllm:num_requests_running", {}, 3.0),
        Counter("vllm:request_success", {"finished_reason": "stop"}, 7),
        Counter("vllm:request_success", {"finished_reason": "length"}, 2),
        Histogram("vllm:time_to_first_token_seconds", {}, 2, 0.3, {"0.1": 1, "1.0": 2, "+Inf": 2}),
    ]
    page = loadgen.parse_metrics(prometheus_text(records, "m").decode())
    assert page["vllm:num_requests_running"] == 3.0
    assert page["vllm:request_success_total{finished_reason=stop}"] == 7
    assert page["vllm:request_success_total{finished_reason=length}"] == 2
    assert page["vllm:time_to_first_token_seconds_count"] == 2
    assert page["vllm:time_to_first_token_seconds_sum"] == pytest.approx(0.3)
    assert page["vllm:time_to_first_token_seconds_bucket{le=0.1}"] == 1
