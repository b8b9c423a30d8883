"""``python -m paged_attention bench block-size``: which block size is best (the paper's §7.2, Fig. 18b).

Blocks that are too large waste their unfilled tails (internal fragmentation), so fewer requests
fit; blocks that are too small make the attention kernel read many small pieces (the cost model
charges each block read a fixed overhead, see :mod:`paged_attention.experiments.cost_model`). Each trace is
served near the paged system's capacity, where memory matters, at block sizes 1 to 256, and the
mean normalized latency is recorded. The paper found 16-128 best on ShareGPT and 16-32 on Alpaca.
Writes ``figures/block_size.{png,json}``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from matplotlib.figure import Figure

from ... import viz
from ...experiments import paper
from ...experiments.serve import serve
from ...experiments.traces import synthetic_trace
from ._progress import progress as bar
from ._results import table, write_results

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


def figure(payload: dict) -> Figure:
    return viz.paper.block_size_sweep(
        payload["block_sizes"],
        {f"{name} ({t['rate']:g} req/s)": t["normalized_latency"] for name, t in payload["traces"].items()},
        ylabel="normalized latency (s/token)",
    )


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m paged_attention bench block-size", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--requests", type=int, default=None, help="requests per trace (default: 600 / 3000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for block_size.{png,json} (default figures/)"
    )
    opts = parser.parse_args(args)
    traces = {k: (rate, opts.requests or n) for k, (rate, n) in TRACES.items()}
    payload = run(traces=traces, seed=opts.seed, progress=True)
    for name, t in payload["traces"].items():
        rows = [
            [b, v * 1000, m]
            for b, v, m in zip(payload["block_sizes"], t["normalized_latency"], t["mean_batch"], strict=True)
        ]
        print(f"{name} at {t['rate']:g} req/s")
        print(table(rows, ["block size", "ms/token", "mean batch"]))
        lo, hi = t["near_best"]
        plo, phi = payload["paper_best"][name]
        print(f"best {t['best_block_size']}; within {NEAR_BEST:.0%}: {lo}-{hi} (paper: {plo}-{phi})\n")
    write_results("block_size", payload, figure(payload), opts.out)
