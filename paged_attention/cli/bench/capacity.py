"""``python -m paged_attention bench capacity``: how many requests run at once (the paper's Figure 13).

The experiment (the paper's point, ShareGPT-like at 2 requests/s, and a sweep of the KV budget
under a backlog) is :mod:`paged_attention.experiments.capacity`; the figure
:func:`paged_attention.viz.paper.capacity_figure`. Writes ``figures/capacity.{png,json}``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ...experiments import capacity, paper
from ...viz.paper import capacity_figure
from ...viz.tables import table
from ._results import write_results


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m paged_attention bench capacity", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=paper.FIG13_SHAREGPT_RATE, help="requests per second")
    parser.add_argument("--sweep-requests", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for capacity.{png,json} (default figures/)"
    )
    opts = parser.parse_args(args)
    payload = capacity.run(opts.requests, opts.rate, opts.sweep_requests, seed=opts.seed, progress=True)
    rows = [
        [m, r["mean_batch"], r["peak_batch"], paper.FIG13[m], f"{payload['relative_diff'][m]:+.0%}"]
        for m, r in payload["ours"].items()
    ]
    print(table(rows, ["manager", "mean batch", "peak", "paper", "ours vs paper"]))
    rows = [
        [f"{g} GiB", *(payload["by_budget"][m][i] for m in paper.MANAGERS)]
        for i, g in enumerate(payload["budgets_gib"])
    ]
    print(table(rows, ["KV budget", *paper.MANAGERS]))
    write_results("capacity", payload, capacity_figure(payload), opts.out)
