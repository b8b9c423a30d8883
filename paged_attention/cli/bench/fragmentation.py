"""``python -m paged_attention bench fragmentation``: the paper's Figure 2, with our managers.

The experiment (one ShareGPT-like trace at 2 requests/s, Orca's three reservation policies under
buddy and first-fit placement, and paging) is :mod:`paged_attention.experiments.fragmentation`; the
figure :func:`paged_attention.viz.paper.fragmentation_figure`. Writes ``figures/fragmentation.{png,json}``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ...experiments import fragmentation, paper
from ...viz.paper import fragmentation_figure
from ...viz.tables import table
from ._results import write_results


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m paged_attention bench fragmentation", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=paper.FIG13_SHAREGPT_RATE, help="requests per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for fragmentation.{png,json} (default figures/)"
    )
    opts = parser.parse_args(args)
    payload = fragmentation.run(opts.requests, opts.rate, opts.seed, progress=True)
    rows = []
    for key, r in payload["ours"].items():
        manager = key.split("/")[0]
        theirs = payload["paper"].get(manager) if "/" not in key else None
        rows.append([key, *r["stack"], " / ".join(f"{v:.1f}" for v in theirs) if theirs else "-"])
    print(table(rows, ["manager", *(f"{c} %" for c in payload["categories"]), "paper"]))
    print(
        "largest gap to the paper (contiguous, buddy): "
        f"{payload['max_abs_diff_points_contiguous_buddy']:.1f} points"
    )
    write_results("fragmentation", payload, fragmentation_figure(payload), opts.out)
