"""``python -m paged_attention bench block-size``: which block size is best (the paper's §7.2, Fig. 18b).

The experiment (each trace near the paged system's capacity at block sizes 1 to 256) is
:mod:`paged_attention.experiments.block_size`; the figure
:func:`paged_attention.viz.paper.block_size_figure`. Writes ``figures/block_size.{png,json}``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ...experiments import block_size
from ...viz.paper import block_size_figure
from ...viz.tables import table
from ._results import write_results


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
    traces = {k: (rate, opts.requests or n) for k, (rate, n) in block_size.TRACES.items()}
    payload = block_size.run(traces=traces, seed=opts.seed, progress=True)
    for name, t in payload["traces"].items():
        rows = [
            [b, v * 1000, m]
            for b, v, m in zip(payload["block_sizes"], t["normalized_latency"], t["mean_batch"], strict=True)
        ]
        print(f"{name} at {t['rate']:g} req/s")
        print(table(rows, ["block size", "ms/token", "mean batch"]))
        lo, hi = t["near_best"]
        plo, phi = payload["paper_best"][name]
        near = f"within {block_size.NEAR_BEST:.0%}: {lo}-{hi}"
        print(f"best {t['best_block_size']}; {near} (paper: {plo}-{phi})\n")
    write_results("block_size", payload, block_size_figure(payload), opts.out)
