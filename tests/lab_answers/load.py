"""Load-exercise answers written apart from the notebooks (right ones and plausible wrong ones)."""

from __future__ import annotations

import math
import random

import numpy as np
import torch


def stream_metrics_right(send_time, chunk_times, num_tokens):
    itl, previous = [], None
    for arrived in chunk_times:
        if previous is not None:
            itl.append(arrived - previous)
        previous = arrived
    tpot = sum(itl) / (num_tokens - 1) if num_tokens >= 2 else None  # the gaps sum to last - first
    return chunk_times[0] - send_time, itl, tpot, chunk_times[-1] - send_time


def stream_metrics_divides_by_chunks(send_time, chunk_times, num_tokens):
    itl = [chunk_times[i + 1] - chunk_times[i] for i in range(len(chunk_times) - 1)]
    tpot = (chunk_times[-1] - chunk_times[0]) / (len(chunk_times) - 1) if num_tokens > 1 else None
    return chunk_times[0] - send_time, itl, tpot, chunk_times[-1] - send_time


def stream_metrics_all_tokens(send_time, chunk_times, num_tokens):
    itl = [chunk_times[i + 1] - chunk_times[i] for i in range(len(chunk_times) - 1)]
    tpot = (chunk_times[-1] - chunk_times[0]) / num_tokens if num_tokens > 1 else None
    return chunk_times[0] - send_time, itl, tpot, chunk_times[-1] - send_time


def stream_metrics_itl_from_send(send_time, chunk_times, num_tokens):
    times = [send_time, *chunk_times]
    itl = [times[i + 1] - times[i] for i in range(len(times) - 1)]  # counts the wait for the first
    tpot = (chunk_times[-1] - chunk_times[0]) / (num_tokens - 1) if num_tokens > 1 else None
    return chunk_times[0] - send_time, itl, tpot, chunk_times[-1] - send_time


def stream_metrics_e2el_from_first(send_time, chunk_times, num_tokens):
    itl = [chunk_times[i + 1] - chunk_times[i] for i in range(len(chunk_times) - 1)]
    tpot = (chunk_times[-1] - chunk_times[0]) / (num_tokens - 1) if num_tokens > 1 else None
    return chunk_times[0] - send_time, itl, tpot, chunk_times[-1] - chunk_times[0]


def stream_metrics_forgets_send(send_time, chunk_times, num_tokens):
    itl = [chunk_times[i + 1] - chunk_times[i] for i in range(len(chunk_times) - 1)]
    tpot = (chunk_times[-1] - chunk_times[0]) / (num_tokens - 1) if num_tokens > 1 else None
    return chunk_times[0], itl, tpot, chunk_times[-1]


def stream_metrics_float32(send_time, chunk_times, num_tokens):
    times = torch.tensor(chunk_times)  # float32: 1e6 s only to the nearest 0.06 s
    itl = (times[1:] - times[:-1]).tolist()
    tpot = float(times[-1] - times[0]) / (num_tokens - 1) if num_tokens > 1 else None
    return float(times[0] - send_time), itl, tpot, float(times[-1] - send_time)


def arrival_times_right(num_requests, rate, burstiness, seed):
    """vLLM's convention: the first request goes at once, each next one a gamma gap later."""
    if rate == float("inf"):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def arrival_times_scale_is_mean(num_requests, rate, burstiness, seed):
    if rate == float("inf"):
        return [0.0] * num_requests
    rng, now, out = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        now += rng.gammavariate(burstiness, 1 / rate)  # mean burstiness / rate
        out.append(now)
    return out


def arrival_times_exponential(num_requests, rate, burstiness, seed):
    if rate == float("inf"):
        return [0.0] * num_requests
    rng, now, out = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        now += rng.expovariate(rate)  # Poisson whatever the burstiness
        out.append(now)
    return out


def arrival_times_gaps(num_requests, rate, burstiness, seed):
    if rate == float("inf"):
        return [0.0] * num_requests
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1 / (rate * burstiness)) for _ in range(num_requests)]


def arrival_times_no_inf(num_requests, rate, burstiness, seed):
    rng, now, out = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        now += rng.gammavariate(burstiness, 1 / (rate * burstiness))  # scale 0 at rate inf: ValueError
        out.append(now)
    return out


def arrival_times_unseeded(num_requests, rate, burstiness, seed):
    if rate == float("inf"):
        return [0.0] * num_requests
    gaps = np.random.gamma(burstiness, 1.0 / (rate * burstiness), num_requests)  # ignores seed
    return np.cumsum(gaps).tolist()


def arrival_times_two_values(num_requests, rate, burstiness, seed):
    """Gaps of 0 or one value, with the gamma's mean and CV: right in two moments, wrong in shape."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    zero = 1 / (1 + burstiness)  # P(gap = 0): CV^2 = p / (1 - p) = 1 / burstiness
    big = (1 / rate) / (1 - zero)
    times, now = [], 0.0
    for _ in range(num_requests):
        now += 0.0 if rng.random() < zero else big
        times.append(now)
    return times
