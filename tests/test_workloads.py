"""Synthetic traces (ShareGPT-like, Alpaca-like, Poisson arrivals) and the trace executor's time model."""

import itertools
import math
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_attention.experiments.paper import KV_SLOTS, MAX_MODEL_LEN, cost_model, make_manager
from paged_attention.experiments.replay import StepRecord, TraceResult, cost_model_step_time, run_trace
from paged_attention.experiments.traces import (
    ALPACA,
    SHAREGPT,
    SHAREGPT_OUTPUT_SIGMA,
    TraceRequest,
    TraceShape,
    _lognormal_length,
    fixed_trace,
    poisson_arrivals,
    synthetic_trace,
    uniform_trace,
)
from paged_attention.memory.paged_manager import PagedKVCacheManager


# -- trace shapes -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def traces():
    return {name: synthetic_trace(name, 4000, seed=0) for name in ("sharegpt", "alpaca")}


@pytest.mark.parametrize(
    ("name", "prompt_mean", "output_mean", "tolerance"),
    [("sharegpt", 161, 338, 0.03), ("alpaca", 19, 58, 0.05)],
)
def test_trace_means_match_the_papers_datasets(traces, name, prompt_mean, output_mean, tolerance):
    trace = traces[name]
    assert len(trace) == 4000
    assert statistics.mean(r.prompt_len for r in trace) == pytest.approx(prompt_mean, rel=tolerance)
    assert statistics.mean(r.output_len for r in trace) == pytest.approx(output_mean, rel=tolerance)


def test_trace_lengths_are_positive_and_capped(traces):
    for trace in traces.values():
        assert all(r.prompt_len >= 1 and r.output_len >= 1 for r in trace)
        assert all(r.total_len == r.prompt_len + r.output_len <= 2048 for r in trace)
        assert all(r.arrival_time == 0.0 for r in trace)  # no rate: an infinite backlog
    sharegpt = traces["sharegpt"]
    assert max(r.total_len for r in sharegpt) > 1500  # the cap is reached, not just respected
    assert statistics.pstdev(r.output_len for r in sharegpt) > 150  # a spread, not a constant


def test_the_output_spread_matches_the_shape_sigma(traces):
    # The coefficient of variation of a log-normal is sqrt(exp(sigma^2) - 1) (~0.87 for 0.754);
    # the 2048 cap trims the tail a little, so allow 15%.
    outputs = [r.output_len for r in traces["sharegpt"]]
    cv = statistics.pstdev(outputs) / statistics.mean(outputs)
    assert cv == pytest.approx(math.sqrt(math.exp(SHAREGPT_OUTPUT_SIGMA**2) - 1), rel=0.15)


def test_traces_are_seeded():
    assert synthetic_trace("sharegpt", 50, seed=7) == synthetic_trace("sharegpt", 50, seed=7)
    assert synthetic_trace("sharegpt", 50, seed=7) != synthetic_trace("sharegpt", 50, seed=8)
    assert synthetic_trace(SHAREGPT, 50, 2.0, seed=7) == synthetic_trace("sharegpt", 50, 2.0, seed=7)
    assert synthetic_trace(ALPACA, 50, seed=7) == synthetic_trace("alpaca", 50, seed=7)
    assert uniform_trace(20, (1, 9), (3, 4), seed=1) == uniform_trace(20, (1, 9), (3, 4), seed=1)


def test_poisson_arrivals():
    trace = synthetic_trace("sharegpt", 4000, request_rate=2.0, seed=0)
    times = [r.arrival_time for r in trace]
    assert times[0] > 0 and all(a < b for a, b in itertools.pairwise(times))
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.5, rel=0.05)
    assert statistics.pstdev(gaps) == pytest.approx(0.5, rel=0.1)  # exponential: sd == mean
    # the lengths do not depend on whether arrival times are drawn
    no_rate = synthetic_trace("sharegpt", 4000, seed=0)
    assert [(r.prompt_len, r.output_len) for r in trace] == [(r.prompt_len, r.output_len) for r in no_rate]
    assert poisson_arrivals(3, 1.0, random.Random(0)) == poisson_arrivals(3, 1.0, random.Random(0))


def test_custom_shapes_and_fixed_and_uniform_traces():
    tiny = TraceShape("tiny", 4, 0.5, 6, 0.5, max_len=12)
    trace = synthetic_trace(tiny, 300, seed=1)
    assert all(r.total_len <= 12 for r in trace)
    assert fixed_trace(3, 5, 7) == [TraceRequest(5, 7)] * 3
    uniform = uniform_trace(200, (2, 5), (10, 10), seed=0)
    assert {r.prompt_len for r in uniform} == {2, 3, 4, 5} and {r.output_len for r in uniform} == {10}


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda: synthetic_trace("wikitext", 10),
            ValueError,
            r"one of \['alpaca', 'sharegpt'\], got 'wikitext'",
        ),
        (lambda: synthetic_trace("ShareGPT", 10), ValueError, "shape must be a TraceShape or one of"),
        (lambda: synthetic_trace("sharegpt", 0), ValueError, "num_requests must be a positive int, got 0"),
        (lambda: synthetic_trace("sharegpt", 2.5), TypeError, "num_requests must be an int"),
        (
            lambda: synthetic_trace("sharegpt", 10, request_rate=0),
            ValueError,
            "request_rate must be a positive",
        ),
        (lambda: synthetic_trace("sharegpt", 10, request_rate=-2.0), ValueError, "request_rate must be"),
        (lambda: synthetic_trace("sharegpt", 10, request_rate=math.nan), ValueError, "request_rate must be"),
        (lambda: synthetic_trace("sharegpt", 10, request_rate="2"), ValueError, "request_rate must be"),
        (lambda: poisson_arrivals(0, 1.0, random.Random(0)), ValueError, "num_requests must be a positive"),
        (lambda: fixed_trace(0, 5, 5), ValueError, "num_requests must be a positive int"),
        (lambda: fixed_trace(1, 0, 5), ValueError, "prompt_len must be a positive int"),
        (lambda: fixed_trace(1, 5, 0), ValueError, "output_len must be a positive int"),
        (lambda: uniform_trace(1, (0, 5), (1, 2)), ValueError, r"prompt_len\[0\] must be a positive int"),
        (lambda: uniform_trace(1, (3, 2), (1, 2)), ValueError, r"prompt_len\[1\] must be an int >= 3"),
        (lambda: uniform_trace(1, (1, 2), (2, 1)), ValueError, r"output_len\[1\] must be an int >= 2"),
    ],
)
def test_bad_trace_input_is_named(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_the_sharegpt_output_spread_reproduces_figure_2s_reserved_share():
    """The fit the ShareGPT-like trace is built on (see workloads.py and notebook 06).

    Under Orca (Max) with 7 requests in flight, a request with output length o spends o steps in the
    batch and reserves, on average over those steps, (o + 1) / 2 future-token slots. Averaged over
    time, the reserved slots per request are E[o (o + 1) / 2] / E[o]; the paper's Figure 2 reports
    13.3% of the 15,728-slot cache reserved across the 7 requests.
    """
    rng = random.Random(0)
    outputs = [_lognormal_length(rng, SHAREGPT.output_mean, SHAREGPT_OUTPUT_SIGMA) for _ in range(20000)]
    reserved_per_request = sum(o * (o + 1) / 2 for o in outputs) / sum(outputs)
    assert reserved_per_request == pytest.approx(0.133 * KV_SLOTS / (KV_SLOTS // MAX_MODEL_LEN), rel=0.03)
    # and the sigma matters: a narrower spread misses the paper's number by far
    narrow = [_lognormal_length(rng, SHAREGPT.output_mean, 0.3) for _ in range(20000)]
    assert sum(o * (o + 1) / 2 for o in narrow) / sum(narrow) < 0.8 * reserved_per_request


@settings(max_examples=50)
@given(mean=st.floats(2, 500), sigma=st.floats(0.05, 1.5), seed=st.integers(0, 1000))
def test_lognormal_lengths_are_positive_ints(mean, sigma, seed):
    rng = random.Random(seed)
    lengths = [_lognormal_length(rng, mean, sigma) for _ in range(20)]
    assert all(isinstance(n, int) and n >= 1 for n in lengths)


# -- the trace executor's clock ---------------------------------------------------------------------
def test_with_a_step_time_arrivals_are_seconds_and_the_clock_jumps_over_idle_gaps():
    trace = [TraceRequest(4, 2, 0.0), TraceRequest(4, 3, 100.0)]
    result = run_trace(trace, PagedKVCacheManager(16, 4), step_time=lambda out: 0.5)
    assert [s.time for s in result.steps] == [0.0, 0.5, 100.0, 100.5, 101.0]
    assert [s.num_running for s in result.steps] == [1, 0, 1, 1, 0]
    assert result.finish_step == {0: 1, 1: 4}
    assert result.finish_time == {0: 1.0, 1: 101.5}  # the end of the step that made the last token
    assert result.duration == 2.5  # idle time is not a step


def test_without_a_step_time_arrivals_count_steps():
    trace = [TraceRequest(4, 3, 5.0)]
    result = run_trace(trace, PagedKVCacheManager(16, 4))
    assert len(result.steps) == 8 and [s.num_running for s in result.steps] == [0] * 5 + [1, 1, 0]
    assert result.finish_step == {0: 7} and result.finish_time == {0: 8}
    assert result.duration == 8.0


def test_without_a_step_time_each_step_starts_at_its_index():
    result = run_trace([TraceRequest(4, 3, 5.0)], PagedKVCacheManager(16, 4))
    assert [s.time for s in result.steps] == [float(i) for i in range(8)]  # got 5.0, 6.0, ..., 12.0


def test_a_request_arriving_mid_step_waits_for_the_next_step():
    trace = [TraceRequest(4, 4, 0.0), TraceRequest(4, 1, 0.7)]
    result = run_trace(trace, PagedKVCacheManager(16, 4), step_time=lambda out: 0.5)
    # steps start at 0, 0.5, 1.0: the second request (t=0.7) is first scheduled at 1.0
    assert [s.num_running for s in result.steps] == [1, 1, 1, 0]
    assert result.finish_step == {0: 3, 1: 2}
    assert result.finish_time == {0: 2.0, 1: 1.5}


def test_time_mean_running_weights_each_step_by_its_duration():
    result = TraceResult(
        steps=[
            StepRecord(0, 1, 0, 0, 1, 0, 0, 0, 0, 0.0, 3.0),
            StepRecord(1, 4, 0, 0, 4, 0, 0, 0, 0, 3.0, 1.0),
        ]
    )
    assert result.mean_running == 2.5
    assert result.time_mean_running == pytest.approx((1 * 3 + 4 * 1) / 4)
    assert result.duration == 4.0 and result.peak_running == 4
    empty = TraceResult()
    assert (empty.mean_running, empty.time_mean_running, empty.peak_running) == (0.0, 0.0, 0)


def test_time_averages_of_a_run_follow_the_step_times():
    trace = [TraceRequest(8, 6, 0.0), TraceRequest(8, 2, 0.0)]

    def slow_prefill(out):
        return 10.0 if out.num_tokens > 2 else 1.0

    result = run_trace(trace, PagedKVCacheManager(16, 4), step_time=slow_prefill)
    assert [s.duration for s in result.steps] == [10.0] + [1.0] * 5
    assert [s.num_running for s in result.steps] == [2, 1, 1, 1, 1, 0]
    assert result.time_mean_running == pytest.approx((2 * 10 + 4) / 15)
    assert result.mean_running == pytest.approx(6 / 6)


def test_mean_memory_needs_recorded_reports():
    trace = fixed_trace(20, 100, 50)
    quiet = run_trace(trace, make_manager("max", num_slots=1024, max_model_len=256), report_every=0)
    assert all(s.report is None and s.token_slots == -1 for s in quiet.steps)
    with pytest.raises(ValueError, match="no memory reports were recorded"):
        quiet.mean_memory()
    with pytest.raises(ValueError, match="no memory reports were recorded"):
        quiet.mean_memory(saturated_only=False)
    loud = run_trace(trace, make_manager("max", num_slots=1024, max_model_len=256), report_every=3)
    assert [s.step for s in loud.steps if s.report is not None] == list(range(0, len(loud.steps), 3))
    shares = loud.mean_memory()
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["internal_fragmentation"] > 0.2  # Max reserves 256 slots for 150 tokens


def test_cost_model_step_times_are_positive_and_grow_with_work():
    step_time = cost_model_step_time(cost_model())
    trace = fixed_trace(3, 500, 4)
    result = run_trace(trace, make_manager("paged"), step_time=step_time)
    durations = [s.duration for s in result.steps]
    assert len(durations) == 4 and all(d > 0 for d in durations)
    assert durations[0] > 3 * durations[1]  # a 1,500-token prefill against a 3-token decode
    assert durations[1] <= durations[2] <= durations[3]  # the contexts grow by a token each step
    assert result.finish_time[0] == pytest.approx(sum(durations))
    bare = run_trace(
        trace, make_manager("paged"), step_time=cost_model_step_time(cost_model(step_overhead=0.0))
    )
    assert [s.duration for s in bare.steps] == pytest.approx([d - 0.015 for d in durations])
