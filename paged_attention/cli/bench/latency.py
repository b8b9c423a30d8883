"""``python -m paged_attention bench latency``: latency against load (the paper's Figure 12).

The experiment (a ShareGPT-like trace per request rate, each manager's normalized latency and the
rate it sustains) is :mod:`paged_attention.experiments.latency`; the figure
:func:`paged_attention.viz.paper.latency_figure`. Writes ``figures/latency.{png,json}``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ...experiments import latency, paper
from ...viz.paper import latency_figure
from ...viz.tables import table
from ._results import write_results


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m paged_attention bench latency", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--requests", type=int, default=600, help="requests per rate")
    parser.add_argument(
        "--threshold", type=float, default=latency.THRESHOLD, help="s/token that counts as sustained"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for latency.{png,json} (default figures/)"
    )
    opts = parser.parse_args(args)
    payload = latency.run(opts.requests, threshold=opts.threshold, seed=opts.seed, progress=True)
    rows = [
        [f"{r:.2f}", *(payload["normalized_latency"][m][i] * 1000 for m in paper.MANAGERS)]
        for i, r in enumerate(payload["rates"])
    ]
    print(table(rows, ["req/s", *(f"{m} ms/tok" for m in paper.MANAGERS)]))
    for m, ratio in payload["paged_over"].items():
        theirs = payload["paper_paged_over"].get(m)
        print(
            f"paged sustains {ratio:.1f}x the rate of {m}"
            + (f" (paper: {theirs[0]}-{theirs[1]}x)" if theirs else "")
        )
    write_results("latency", payload, latency_figure(payload), opts.out)
