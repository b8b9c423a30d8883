"""How many requests run at once, per manager: the paper's Figure 13 (``bench capacity``).

Two measurements, both through the real scheduler and managers with OPT-13B/A100 step times:

* the paper's point: the ShareGPT-like trace at 2 requests/s on its 12 GiB (15,728-slot) cache;
  average (over time) and peak number of running requests per manager, beside the paper's counts;
* the same question against the KV budget (4-24 GiB) under a backlog (every request waiting from
  the start), time-averaged over the run: how the gap grows or shrinks with memory.

The figure: :func:`paged_attention.viz.paper.capacity_figure`.
"""

from __future__ import annotations

from . import paper
from .cost_model import model_spec
from .progress import progress as bar
from .serve import serve
from .traces import synthetic_trace

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
