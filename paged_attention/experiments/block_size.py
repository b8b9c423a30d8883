"""Which block size is best: the paper's §7.2, Figure 18b (``bench block-size``).

Blocks that are too large waste their unfilled tails (internal fragmentation), so fewer requests
fit; blocks that are too small make the attention kernel read many small pieces (the cost model
charges each block read a fixed overhead, see :mod:`paged_attention.experiments.cost_model`). Each trace is
served near the paged system's capacity, where memory matters, at block sizes 1 to 256, and the
mean normalized latency is recorded. The paper found 16-128 best on ShareGPT and 16-32 on Alpaca.
The figure: :func:`paged_attention.viz.paper.block_size_figure`.
"""

from __future__ import annotations

from . import paper
from .progress import progress as bar
from .serve import serve
from .traces import synthetic_trace

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TRACES = {"sharegpt": (2.0, 600), "alpaca": (50.0, 3000)}  # name -> (requests/s, number of requests)
NEAR_BEST = 0.10  # block sizes within 10% of the best latency count as "best"


def run(
    block_sizes: tuple[int, ...] = BLOCK_SIZES, traces: dict = TRACES, seed: int = 0, progress: bool = False
) -> dict:
    """Normalized latency and mean batch per trace and block size, and the near-best range."""
    out: dict = {"block_sizes": list(block_sizes), "traces": {}, "paper_best": paper.BEST_BLOCK_SIZES}
    for name, (rate, num_requests) in traces.items():
        trace = synthetic_trace(name, num_requests, rate, seed)
        runs = [serve(trace, "paged", block_size=b, report_every=0) for b in bar(block_sizes, progress, name)]
        latency = [r.normalized_latency for r in runs]
        best = min(latency)
        near = [b for b, v in zip(block_sizes, latency, strict=True) if v <= best * (1 + NEAR_BEST)]
        out["traces"][name] = {
            "rate": rate,
            "num_requests": num_requests,
            "normalized_latency": latency,
            "mean_batch": [r.mean_batch for r in runs],
            "best_block_size": block_sizes[latency.index(best)],
            "near_best": [min(near), max(near)],
        }
    return out
