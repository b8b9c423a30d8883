"""Seeded synthetic request traces: how long each prompt is and how many tokens it will produce.

Experiments on memory need traffic, not text: a request is its prompt length, its output length
(known in advance only to the experimenter, never to the scheduler) and its arrival time. Every
trace here is drawn from a seeded ``random.Random``, so a notebook shows the same trace each run.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from .._checks import check_int, check_positive_int
from .paper import FIG11_MEANS


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: ``prompt_len`` tokens in, ``output_len`` tokens out."""

    prompt_len: int
    output_len: int
    arrival_time: float = 0.0

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


def uniform_trace(
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int = 0,
) -> list[TraceRequest]:
    """``num_requests`` requests, all arriving at time 0, lengths uniform in the inclusive ranges."""
    check_positive_int("num_requests", num_requests)
    for name, (lo, hi) in (("prompt_len", prompt_len), ("output_len", output_len)):
        check_int(f"{name}[0]", lo, minimum=1)
        check_int(f"{name}[1]", hi, minimum=lo)
    rng = random.Random(seed)
    return [TraceRequest(rng.randint(*prompt_len), rng.randint(*output_len)) for _ in range(num_requests)]


@dataclass(frozen=True)
class TraceShape:
    """The length statistics of a workload: log-normal prompt and output lengths, capped at ``max_len``.

    A log-normal length with mean ``m`` and shape ``sigma`` has coefficient of variation
    ``sqrt(exp(sigma**2) - 1)``: ``sigma`` sets how spread out the lengths are, independently of
    their mean. A request whose prompt + output would exceed ``max_len`` is drawn again.
    """

    name: str
    prompt_mean: float
    prompt_sigma: float
    output_mean: float
    output_sigma: float
    max_len: int = 2048


# The PagedAttention paper (§6.1, Fig. 11) plots its two datasets' length distributions in full and
# gives only their means as numbers (``paper.FIG11_MEANS``); the shapes below use those means,
# rounded to whole tokens. The spread of ShareGPT's output lengths is pinned down by the paper's own
# Figure 2: the time-averaged "reservation" share of Orca (Max) gives E[o^2]/E[o] in tokens, hence
# the log-normal sigma below (derived in notebook 06, checked in the tests).
# The prompt spread is not pinned down by any reported number (Figure 2 hardly depends on it); the
# Alpaca-like shape assumes ShareGPT's spreads. These are synthetic fits, not the datasets.
SHAREGPT_OUTPUT_SIGMA = 0.754
_SHAREGPT_MEANS = [round(mean) for mean in FIG11_MEANS["sharegpt"]]
_ALPACA_MEANS = [round(mean) for mean in FIG11_MEANS["alpaca"]]
SHAREGPT = TraceShape("ShareGPT-like", _SHAREGPT_MEANS[0], 1.0, _SHAREGPT_MEANS[1], SHAREGPT_OUTPUT_SIGMA)
ALPACA = TraceShape("Alpaca-like", _ALPACA_MEANS[0], 1.0, _ALPACA_MEANS[1], SHAREGPT_OUTPUT_SIGMA)
TRACE_SHAPES = {"sharegpt": SHAREGPT, "alpaca": ALPACA}


def _lognormal_length(rng: random.Random, mean: float, sigma: float) -> int:
    mu = math.log(mean) - sigma**2 / 2  # so that the mean of exp(N(mu, sigma^2)) is ``mean``
    return max(1, round(rng.lognormvariate(mu, sigma)))


def poisson_arrivals(num_requests: int, request_rate: float, rng: random.Random) -> list[float]:
    """Arrival times (seconds) of a Poisson process: exponential gaps with mean ``1 / request_rate``."""
    check_positive_int("num_requests", num_requests)
    if not isinstance(request_rate, (int, float)) or not request_rate > 0:
        raise ValueError(
            f"request_rate must be a positive number (requests per second), got {request_rate!r}"
        )
    times, now = [], 0.0
    for _ in range(num_requests):
        now += rng.expovariate(request_rate)
        times.append(now)
    return times


def synthetic_trace(
    shape: TraceShape | str, num_requests: int, request_rate: float | None = None, seed: int = 0
) -> list[TraceRequest]:
    """``num_requests`` requests of ``shape`` (or its name: ``"sharegpt"``, ``"alpaca"``).

    With ``request_rate`` (requests per second) they arrive as a Poisson process; without it all
    arrive at time 0 (an infinite backlog: the cache is the bottleneck from the first step).
    """
    if isinstance(shape, str):
        if shape not in TRACE_SHAPES:
            raise ValueError(f"shape must be a TraceShape or one of {sorted(TRACE_SHAPES)}, got {shape!r}")
        shape = TRACE_SHAPES[shape]
    check_positive_int("num_requests", num_requests)
    rng = random.Random(seed)
    lengths: list[tuple[int, int]] = []
    while len(lengths) < num_requests:
        p = _lognormal_length(rng, shape.prompt_mean, shape.prompt_sigma)
        o = _lognormal_length(rng, shape.output_mean, shape.output_sigma)
        if p + o <= shape.max_len:
            lengths.append((p, o))
    times = (
        poisson_arrivals(num_requests, request_rate, rng)
        if request_rate is not None
        else [0.0] * num_requests
    )
    return [TraceRequest(p, o, t) for (p, o), t in zip(lengths, times, strict=True)]


def fixed_trace(num_requests: int, prompt_len: int, output_len: int) -> list[TraceRequest]:
    """``num_requests`` identical requests at time 0: the simplest trace for tests and pictures."""
    check_positive_int("num_requests", num_requests)
    check_positive_int("prompt_len", prompt_len)
    check_positive_int("output_len", output_len)
    return [TraceRequest(prompt_len, output_len) for _ in range(num_requests)]
