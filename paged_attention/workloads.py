"""Seeded synthetic request traces: how long each prompt is and how many tokens it will produce.

Experiments on memory need traffic, not text: a request is its prompt length, its output length
(known in advance only to the experimenter, never to the scheduler) and its arrival time. Every
trace here is drawn from a seeded ``random.Random``, so a notebook shows the same trace each run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ._checks import check_int, check_positive_int


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
