"""Latency against load, per manager: the paper's Figure 12 (``bench latency``).

For each request rate, a ShareGPT-like trace with Poisson arrivals is served by each manager with
OPT-13B/A100 step times, and the mean *normalized latency* (end-to-end seconds divided by output
tokens) is recorded. Each curve is flat until the manager's memory fills, then climbs steeply as
requests queue. The rate at which a curve crosses a latency threshold is the rate the system
sustains; the paper reports paging sustaining 1.7-2.7x the rate of Orca (Oracle) and 2.7-8x that of
Orca (Max) on ShareGPT (Figure 12, §6.2; the ranges span its three models). Ours is one model
through a cost model, a synthetic trace and a threshold we chose: compare the ordering and the
rough size, not the digits. The figure: :func:`paged_attention.viz.paper.latency_figure`.
"""

from __future__ import annotations

from . import paper
from .progress import progress as bar
from .serve import serve, sustainable_rate
from .traces import synthetic_trace

RATES = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.25, 2.5)
THRESHOLD = 0.1  # s/token: about 2.5x the unloaded normalized latency of this setup


def run(
    num_requests: int = 600,
    rates: tuple[float, ...] = RATES,
    threshold: float = THRESHOLD,
    seed: int = 0,
    progress: bool = False,
) -> dict:
    """Normalized latency per manager and rate, the sustained rates, and paging's ratios over each."""
    latencies: dict[str, list[float]] = {m: [] for m in paper.MANAGERS}
    for rate, manager in bar([(r, m) for r in rates for m in paper.MANAGERS], progress, "latency"):
        trace = synthetic_trace("sharegpt", num_requests, rate, seed)
        latencies[manager].append(serve(trace, manager, report_every=0).normalized_latency)
    sustained = {m: sustainable_rate(rates, latencies[m], threshold) for m in paper.MANAGERS}
    return {
        "setup": {"num_requests": num_requests, "seed": seed, "threshold_s_per_token": threshold},
        "rates": list(rates),
        "normalized_latency": latencies,
        "sustained_rate": sustained,
        "paged_over": {
            m: sustained["paged"] / sustained[m] for m in ("max", "pow2", "oracle") if sustained[m]
        },
        "paper_paged_over": {m: list(v) for m, v in paper.FIG12_SHAREGPT.items()},
    }
