"""``python -m paged_attention bench capacity``: how many requests run at once (the paper's Figure 13).

Two measurements, both through the real scheduler and managers with OPT-13B/A100 step times:

* the paper's point: the ShareGPT-like trace at 2 requests/s on its 12 GiB (15,728-slot) cache;
  average (over time) and peak number of running requests per manager, beside the paper's counts;
* the same question against the KV budget (4-24 GiB) under a backlog (every request waiting from
  the start), time-averaged over the run: how the gap grows or shrinks with memory.

Writes ``figures/capacity.{png,json}``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from matplotlib.figure import Figure

from ... import viz
from ...experiments import paper
from ...experiments.cost_model import model_spec
from ...experiments.serve import serve
from ...experiments.traces import synthetic_trace
from ._progress import progress as bar
from ._results import table, write_results

BUDGETS_GIB = (4, 8, 12, 16, 24)


def run(
    num_requests: int = 2000,
    rate: float = paper.FIG13_SHAREGPT_RATE,
    sweep_requests: int = 600,
    budgets_gib: tuple[float, ...] = BUDGETS_GIB,
    seed: int = 0,
    progress: bool = False,
) -> dict:
    """Mean and peak batched requests at the paper's point, and saturated mean batch per KV budget."""
    trace = synthetic_trace("sharegpt", num_requests, rate, seed)
    point = {}
    for manager in bar(paper.MANAGERS, progress, "capacity at 2 req/s"):
        result = serve(trace, manager, report_every=0)
        point[manager] = {"mean_batch": result.mean_batch, "peak_batch": result.peak_batch}
    backlog = synthetic_trace("sharegpt", sweep_requests, None, seed)
    spec = model_spec(paper.PAPER_MODEL)
    sweep: dict[str, list[float]] = {m: [] for m in paper.MANAGERS}
    for gib, manager in bar([(g, m) for g in budgets_gib for m in paper.MANAGERS], progress, "budget sweep"):
        slots = spec.kv_slots(int(gib * 2**30))
        sweep[manager].append(serve(backlog, manager, num_slots=slots, report_every=0).mean_batch)
    return {
        "setup": {"num_requests": num_requests, "rate": rate, "sweep_requests": sweep_requests, "seed": seed},
        "ours": point,
        "paper": paper.FIG13,
        "relative_diff": {m: point[m]["mean_batch"] / paper.FIG13[m] - 1 for m in paper.MANAGERS},
        "budgets_gib": list(budgets_gib),
        "by_budget": sweep,
    }


def figure(payload: dict) -> Figure:
    label = paper.LABELS
    return viz.paper.batched_requests(
        {label[m]: r["mean_batch"] for m, r in payload["ours"].items()},
        {label[m]: v for m, v in payload["paper"].items()},
        peaks={label[m]: r["peak_batch"] for m, r in payload["ours"].items()},
        budgets=payload["budgets_gib"],
        by_budget={label[m]: v for m, v in payload["by_budget"].items()},
        title=f"Batched requests, ShareGPT-like at {payload['setup']['rate']:g} req/s: "
        "ours and the paper's Figure 13 (2 req/s)",
    )


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
    payload = run(opts.requests, opts.rate, opts.sweep_requests, seed=opts.seed, progress=True)
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
    write_results("capacity", payload, figure(payload), opts.out)
