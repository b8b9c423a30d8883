"""One rule for the torch thread count of every command that times a real model, printed by each.

On a 2-core machine OpenMP threads spin-wait for each other: with 2 threads while any other process
is busy, a matmul-bound step gets 25-30x slower. So by default: as many threads as cores (at most 2)
when the machine is otherwise idle (1-minute load average under 1), else 1. ``--threads`` fixes it.
"""

from __future__ import annotations

import os

import torch


def set_threads(threads: int | None = None) -> int:
    """Set torch's intra-op thread count (``None``: the rule above) and return it."""
    if threads is None:
        cores = min(2, os.cpu_count() or 1)
        try:
            busy = os.getloadavg()[0] >= 1.0
        except OSError:  # pragma: no cover - no load average on this OS
            busy = False
        threads = 1 if busy else cores
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    return threads
