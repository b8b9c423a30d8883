"""Checks of the load exercises (notebook 09): a streamed request's latencies from its timestamps,
and gamma arrivals with a burstiness knob, graded statistically.

The student's code is reached through drivers (:mod:`.student`): an exception it raises (other than
the exercise's own ``NotImplementedError``) becomes a :class:`CheckFailed` naming the call, its
inputs and the line of the cell that raised, so that a crash is reported like any other failing case.
"""

from __future__ import annotations

import itertools
import math
import numbers
import random
import statistics
from collections.abc import Sequence
from typing import Any

from ..experiments import latency_stats
from .checking import CheckFailed, expect
from .student import Student, driver


def _plain(value: Any) -> Any:
    """A returned value as JSON carries it: numbers as floats, sequences as lists, others by name."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, (str, bytes)):
        return repr(value)[:80]
    try:
        return [_plain(v) for v in value]
    except TypeError:
        return f"<a {type(value).__name__}>"


@driver
def metrics_run(state: dict, objects: tuple, send: float, chunks: list[float], tokens: int) -> Any:
    """``stream_metrics(send, chunks, tokens)``: its four fields, from a 4-tuple or an object with
    attributes ``ttft``, ``itl``, ``tpot``, ``e2el``; or what it returned instead."""
    result = objects[0](send, list(chunks), tokens)
    fields = ("ttft", "itl", "tpot", "e2el")
    if isinstance(result, (tuple, list)) and len(result) == 4:
        return {"fields": [_plain(v) for v in result]}
    if all(hasattr(result, f) for f in fields):
        return {"fields": [_plain(getattr(result, f)) for f in fields]}
    size = f" of {len(result)}" if isinstance(result, (tuple, list)) else ""
    return {"other": f"a {type(result).__name__}{size}"}


@driver
def arrivals_run(state: dict, objects: tuple, num: int, rate: float, burstiness: float, seed: int) -> Any:
    """``arrival_times(num, rate, burstiness, seed)`` as a list of floats, or what it returned."""
    got = objects[0](num, rate, burstiness, seed)
    try:
        return [float(t) for t in got]
    except (TypeError, ValueError):
        return f"<a {type(got).__name__}>"


def _round(x: Any) -> Any:
    return round(x, 6) if isinstance(x, numbers.Real) and not isinstance(x, bool) else x


def _close(got: Any, want: float) -> bool:
    """Seconds equal to 10 us: far above float64 rounding (timestamps near 1e6 s keep ~1e-10 s), far
    below the mistakes the fixed cases are built to catch (10 ms or more) and float32's 0.06 s at 1e6 s."""
    number = isinstance(got, numbers.Real) and not isinstance(got, bool)
    return number and math.isclose(float(got), want, rel_tol=1e-6, abs_tol=1e-5)


def _seconds(case: str, want: float | None, got: Any, hint: str, clock: bool = False) -> None:
    """Raise :class:`CheckFailed` unless ``got`` is ``want`` (None) or within 10 us of it; ``clock``:
    the timestamps are near 1e6 s, where an error of float32's size gets a hint of its own."""
    if want is None:
        expect(case, None, got, hint)
    elif not _close(got, want):
        if clock and isinstance(got, numbers.Real) and abs(float(got) - want) < 0.2:
            hint += "; keep timestamps in float64: float32 resolves 1e6 s only to 0.06 s"
        raise CheckFailed(case, _round(want), _round(got), hint)


def _show(times: Sequence[float]) -> str:
    if len(times) <= 4:
        return repr(list(times))
    shown = ", ".join(repr(t) for t in times[:3])
    return f"[{shown}, ..., {times[-1]!r}] ({len(times)} chunks)"


def _metric_cases(seed: int, thorough: bool) -> list[tuple[str, float, list[float], int]]:
    """``(what the case is, send_time, chunk_times, num_tokens)``: the mistakes first, then random."""
    uneven = random.Random(11)
    t, many = 50.0, []
    for _ in range(40):
        t = round(t + uneven.choice((0.001, 0.02, 0.03, 0.25, 0.9)), 4)
        many.append(t)
    clock = 1_234_567.8912  # what time.perf_counter() reads after two weeks of uptime
    cases = [
        ("one token per chunk", 0.0, [0.2, 0.25, 0.31, 0.36], 4),
        ("the last chunk is the end-of-sequence token's, with no text", 0.0, [0.3, 0.36, 0.4], 3),
        ("sent at 10 s", 10.0, [10.5, 10.6, 10.8], 3),
        ("chunks carrying several tokens", 1.0, [1.4, 1.5, 1.9], 7),
        ("one chunk carrying all 5 tokens", 2.0, [2.3], 5),
        ("a single token", 3.0, [3.2], 1),
        ("40 chunks, uneven gaps, 55 tokens", 49.0, many, 55),
        (
            "timestamps near 1e6 s, as time.perf_counter() gives",
            clock,
            [round(clock + 0.731, 4), round(clock + 0.75, 4)],
            2,
        ),
        (
            "timestamps near 1e6 s, several tokens per chunk",
            clock,
            [round(clock + s, 4) for s in (0.4123, 0.4471, 0.5002, 0.5871)],
            9,
        ),
    ]
    rng = random.Random(seed)
    for i in range(40 if not thorough else 300):
        send = (0.0, round(rng.uniform(0, 100), 3), round(rng.uniform(1e5, 2e6), 4))[i % 3]
        t, chunks = round(send + rng.uniform(0.001, 3.0), 4), []
        for _ in range(rng.randint(1, 30)):
            chunks.append(t)
            t = round(t + rng.expovariate(20.0), 4)  # rounding makes some gaps 0: equal timestamps
        tokens = len(chunks) + rng.choice((0, 0, rng.randint(1, 3 * len(chunks))))
        cases.append(("random", send, chunks, tokens))
    return cases


def stream_metrics(student: Student, seed: int = 0, thorough: bool = False) -> int:
    """``stream_metrics(send_time, chunk_times, num_tokens) -> (ttft, itl, tpot, e2el)`` vs
    :func:`latency_stats.stream_metrics`: ``ttft`` first chunk - send, ``itl`` the gaps between
    consecutive chunks (a list one shorter than ``chunk_times``), ``tpot`` (last chunk - first
    chunk) / (num_tokens - 1) or None for one token, ``e2el`` last chunk - send; seconds, equal to
    10 us. A chunk may carry several tokens; timestamps may be ``time.perf_counter()``'s.
    A :class:`~latency_stats.StreamMetrics`-like object with those four attributes is accepted too."""
    cases = _metric_cases(seed, thorough)
    for what, send, chunks, tokens in cases:
        call = f"stream_metrics({send!r}, {_show(chunks)}, {tokens})"
        case = f"{call} ({what})" if what != "random" else call
        want = latency_stats.stream_metrics(send, chunks, tokens)
        got = student.call(case, "checks_load:metrics_run", send, list(chunks), tokens)
        if "fields" not in got:
            raise CheckFailed(case + ": what it returns", "a tuple (ttft, itl, tpot, e2el)", got["other"])
        ttft, itl, tpot, e2el = got["fields"]
        first, last, span = chunks[0], chunks[-1], chunks[-1] - chunks[0]
        clock = send > 1e5

        hint = "ttft = first chunk time - send_time"
        if send and _close(ttft, first):
            hint = "subtract send_time: ttft is the wait from sending to the first chunk"
        _seconds(case + ": ttft", want.ttft, ttft, hint, clock)

        hint = "e2el = last chunk time - send_time"
        if len(chunks) > 1 and _close(e2el, span):
            hint = "e2el runs from send_time, not from the first chunk: it includes the wait for the first"
        elif send and _close(e2el, last):
            hint = "subtract send_time: e2el is the wait from sending to the last chunk"
        _seconds(case + ": e2el", want.e2el, e2el, hint, clock)

        if not isinstance(itl, list):
            raise CheckFailed(case + ": itl", "a list of gaps", itl)
        hint = "one gap per pair of consecutive chunks: len(chunk_times) - 1 of them"
        if len(itl) == len(chunks):
            hint = "the wait before the first chunk is TTFT, not an ITL: len(chunk_times) - 1 gaps"
        elif len(itl) == tokens - 1 and tokens != len(chunks):
            hint = "a gap per pair of consecutive chunks, not per token: a chunk may carry several tokens"
        expect(case + ": len(itl)", len(want.itl), len(itl), hint)
        for i, (w, g) in enumerate(zip(want.itl, itl, strict=True)):
            _seconds(f"{case}: itl[{i}]", w, g, f"itl[{i}] = chunk_times[{i + 1}] - chunk_times[{i}]", clock)

        hint = "tpot = (last chunk - first chunk) / (num_tokens - 1)"
        if want.tpot is None:
            hint = "with a single token there is no time per token after the first: tpot is None"
        elif len(chunks) > 1 and tokens != len(chunks) and _close(tpot, span / (len(chunks) - 1)):
            hint = "a chunk may carry several tokens: divide by num_tokens - 1, not by the number of gaps"
        elif _close(tpot, span / tokens):
            hint = "divide by num_tokens - 1: the first token's wait is TTFT's, TPOT counts the ones after"
        elif _close(tpot, want.e2el / (tokens - 1)) or _close(tpot, want.e2el / tokens):
            hint = "TPOT runs from the first chunk to the last, not from send_time"
        _seconds(case + ": tpot", want.tpot, tpot, hint, clock)
    return len(cases)


# (rate, burstiness) pairs graded statistically; thorough adds the rest.
ARRIVAL_PAIRS = ((0.5, 0.25), (20.0, 0.25), (20.0, 1.0), (0.5, 4.0))
MORE_ARRIVAL_PAIRS = ((0.5, 1.0), (20.0, 4.0), (3.0, 0.5), (1.0, 2.0))
NUM_GAPS = 40_000
#: Tolerances in standard errors: any correct answer fails with probability < 1e-8 per comparison.
STANDARD_ERRORS = 6.0


def _arrival_tolerances(burstiness: float, n: int) -> tuple[float, float]:
    """Relative tolerances of the sample mean gap and the sample CV of ``n`` gamma(k) gaps.

    Gamma gaps of shape k and mean mu have CV c = 1/sqrt(k), skewness 2/sqrt(k) and excess
    kurtosis 6/k. The sample mean's standard error is mu * c / sqrt(n): relatively 1/sqrt(k n).
    The sample CV s/m by the delta method: Var(s)/sigma^2 = (1/2 + 3/(2k))/n (from the kurtosis),
    Var(m)/mu^2 = 1/(k n), and Cov(s, m)/(sigma mu) = mu3/(2 sigma^2 mu n) = 1/(k n) (from the
    skewness), so Var(s/m)/c^2 = (1/2 + 3/(2k) + 1/k - 2/k)/n = (1 + 1/k)/(2n). (Checked by
    simulation: 1,500 samples of 40,000 gaps at k = 0.25, 0.5, 1, 4 gave z-scores of standard
    deviation 0.98 to 1.02 and |z| <= 3.9.) The wrong answers are off by 2x or more at 40,000 gaps,
    far outside ``STANDARD_ERRORS`` standard errors (~6% of the mean, ~5% of the CV at k = 0.25)."""
    mean = STANDARD_ERRORS / math.sqrt(burstiness * n)
    cv = STANDARD_ERRORS * math.sqrt((1 + 1 / burstiness) / (2 * n))
    return mean, cv


def _times(
    student: Student, num: int, rate: float, burstiness: float, seed: int, hint: str = ""
) -> tuple[str, list[float]]:
    """The student's send times for one call, checked for length, order and a start at or after 0."""
    call = f"arrival_times({num}, {rate!r}, {burstiness!r}, {seed})"
    times = student.call(call, "checks_load:arrivals_run", num, rate, burstiness, seed, hint=hint)
    if not isinstance(times, list):
        raise CheckFailed(call, f"a list of {num} send times", times)
    expect(call + ": number of send times", num, len(times), "one send time per request")
    if not math.isinf(rate):
        back = next((i for i in range(1, num) if not times[i] >= times[i - 1]), None)
        if back is not None:
            raise CheckFailed(
                f"{call}: send times {back - 1} and {back}",
                "non-decreasing times",
                times[back - 1 : back + 1],
                "return the send times (the running sum of the gaps), not the gaps themselves",
            )
        if not (times[0] >= 0 and math.isfinite(times[-1])):
            raise CheckFailed(
                call + ": first and last send times", "0 <= first <= last < inf", [times[0], times[-1]]
            )
    return call, times


def arrivals(student: Student, seed: int = 0, thorough: bool = False) -> int:
    """``arrival_times(num_requests, rate, burstiness, seed) -> [send time, ...]`` (seconds from the
    start, non-decreasing), the gaps between them gamma-distributed with shape ``burstiness`` and mean
    ``1 / rate`` (``burstiness=1`` a Poisson process; the gaps' CV is ``1 / sqrt(burstiness)``), all
    0 for ``rate=inf``; the same seed gives the same list. The reference is
    :func:`paged_attention.experiments.loadgen.arrival_times`, but any generator passes: the check
    compares the mean and CV of 40,000 gaps with the gamma's (see :func:`_arrival_tolerances`), and
    only consecutive times are differenced, so the first request may be sent at 0 or after a gap."""
    rng = random.Random(seed)
    seeds = [rng.randrange(1_000_000) for _ in range(3 + len(ARRIVAL_PAIRS) + len(MORE_ARRIVAL_PAIRS))]
    passed = 0
    _times(student, 5, 2.0, 1.0, seeds[0])
    passed += 1
    for burstiness in (1.0, 0.25) if thorough else (1.0,):
        call, times = _times(
            student, 8, math.inf, burstiness, seeds[0], "rate=inf sends every request at once: return zeros"
        )
        expect(call, [0.0] * 8, times, "rate=inf sends every request at once: every send time is 0")
        passed += 1
    call, first = _times(student, 100, 5.0, 0.5, seeds[1])
    _, again = _times(student, 100, 5.0, 0.5, seeds[1])
    if first != again:
        raise CheckFailed(
            call + " twice: the same list",
            hint="draw from a generator made from seed (random.Random(seed)), not from an unseeded one",
        )
    _, other = _times(student, 100, 5.0, 0.5, seeds[2])
    if first == other:
        raise CheckFailed(f"{call} and seed {seeds[2]}: different lists", hint="the seed must seed the draws")
    passed += 1
    pairs = ARRIVAL_PAIRS + (MORE_ARRIVAL_PAIRS if thorough else ())
    for draw, (rate, burstiness) in zip(seeds[3:], pairs, strict=False):
        call, times = _times(student, NUM_GAPS + 1, rate, burstiness, draw)
        gaps = [b - a for a, b in itertools.pairwise(times)]
        mean_tol, cv_tol = _arrival_tolerances(burstiness, len(gaps))
        mean = statistics.fmean(gaps)
        if not math.isclose(mean, 1 / rate, rel_tol=mean_tol):
            hint = "the gaps' mean must be 1 / rate"
            if math.isclose(mean, burstiness / rate, rel_tol=mean_tol):
                hint = (
                    "a gamma with shape k and scale theta has mean k * theta: with k = burstiness, "
                    "theta = 1 / (rate * burstiness)"
                )
            raise CheckFailed(
                f"{call}: mean gap between consecutive send times (within {mean_tol:.1%})",
                round(1 / rate, 5),
                round(mean, 5),
                hint,
            )
        cv = math.sqrt(math.fsum((g - mean) ** 2 for g in gaps) / (len(gaps) - 1)) / mean
        if not math.isclose(cv, 1 / math.sqrt(burstiness), rel_tol=cv_tol):
            hint = "gamma gaps of shape burstiness have a coefficient of variation 1 / sqrt(burstiness)"
            if math.isclose(cv, 1.0, rel_tol=cv_tol):
                hint = "exponential gaps (CV 1) are burstiness = 1 only: draw gamma gaps of shape burstiness"
            raise CheckFailed(
                f"{call}: coefficient of variation of the gaps, stdev / mean (within {cv_tol:.1%})",
                round(1 / math.sqrt(burstiness), 4),
                round(cv, 4),
                hint,
            )
        distance, critical = _ks_gamma(gaps, rate, burstiness)
        if distance > critical:
            raise CheckFailed(
                f"{call}: distance between the gaps' distribution and the gamma's (Kolmogorov-Smirnov)",
                f"at most {critical:.4f}",
                round(distance, 4),
                "the mean and the spread are right, not the shape: draw each gap from a gamma distribution "
                "(random.gammavariate(burstiness, 1 / (rate * burstiness)))",
            )
        passed += 1
    return passed


def _ks_gamma(gaps: list[float], rate: float, burstiness: float) -> tuple[float, float]:
    """The Kolmogorov-Smirnov distance of ``gaps`` from the gamma of shape ``burstiness`` and mean
    ``1 / rate``, and the distance a right answer exceeds with probability about 1e-8 (the
    asymptotic Kolmogorov bound, sqrt(ln(2 / 1e-8) / (2 n)): 0.0155 at 40,000 gaps)."""
    import torch  # the check's side only: the drivers, run in the grader's child, need none

    x = torch.tensor(sorted(gaps), dtype=torch.float64).clamp(min=0.0)
    cdf = torch.special.gammainc(torch.tensor(burstiness, dtype=torch.float64), x * rate * burstiness)
    n = len(gaps)
    above = torch.arange(1, n + 1, dtype=torch.float64) / n - cdf
    below = cdf - torch.arange(0, n, dtype=torch.float64) / n
    return float(torch.maximum(above, below).max()), math.sqrt(math.log(2 / 1e-8) / (2 * n))
