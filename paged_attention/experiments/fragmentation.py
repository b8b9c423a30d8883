"""Where KV memory goes, per manager: the paper's Figure 2, with our managers (``bench fragmentation``).

Serve one ShareGPT-like trace (Poisson arrivals at 2 requests/s, OPT-13B on an A100-40GB through
the cost model, 15,728 KV slots) with Orca's three reservation policies and with paging, and
split KV memory into the paper's four categories (``paper.FIG2_CATEGORIES``: token states,
reservation, internal fragmentation, external fragmentation & others), time-averaged while memory
is the bottleneck: over each manager's own steps with a request waiting (``saturated_share`` says
how much of its run that was), over the whole run for one that never waits. The caption of the
paper's Figure 2 says only "during the experiment in §6.2"; this trace and rate are our reading.
Contiguous policies run twice: with the buddy allocator the paper assumed and with first-fit, to
show the conclusion does not hinge on a weak allocator. The figure:
:func:`paged_attention.viz.paper.fragmentation_figure`.
"""

from __future__ import annotations

from . import paper
from .progress import progress as bar
from .serve import figure2_stack, serve
from .traces import synthetic_trace


def run(
    num_requests: int = 2000, rate: float = paper.FIG13_SHAREGPT_RATE, seed: int = 0, progress: bool = False
) -> dict:
    """Figure 2 stacks (percent) and batch sizes per manager and placement, with the paper's numbers."""
    trace = synthetic_trace("sharegpt", num_requests, rate, seed)
    runs = {}
    # Max is the same under either placement (seven 2048-slot ranges), so first fit runs Pow2 and Oracle.
    configs = [(m, "buddy") for m in paper.MANAGERS] + [("pow2", "first-fit"), ("oracle", "first-fit")]
    for manager, placement in bar(configs, progress, "fragmentation"):
        key = manager if placement == "buddy" else f"{manager}/first-fit"
        result = serve(trace, manager, placement=placement)
        runs[key] = {
            "stack": figure2_stack(result.memory),
            "mean_batch": result.mean_batch,
            "peak_batch": result.peak_batch,
            "saturated_share": result.saturated_share,
        }
    worst = max(
        abs(a - b)
        for m in ("max", "pow2", "oracle")
        for a, b in zip(runs[m]["stack"], paper.FIG2[m], strict=True)
    )
    return {
        "setup": {
            "num_requests": num_requests,
            "rate": rate,
            "seed": seed,
            "kv_slots": paper.KV_SLOTS,
            "max_model_len": paper.MAX_MODEL_LEN,
            "block_size": paper.BLOCK_SIZE,
            "step_overhead_s": paper.STEP_OVERHEAD,
        },
        "categories": list(paper.FIG2_CATEGORIES),
        "ours": runs,
        "paper": {m: list(v) for m, v in paper.FIG2.items()},
        "max_abs_diff_points_contiguous_buddy": worst,
    }
