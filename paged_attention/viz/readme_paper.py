"""README blocks of the paper's experiments, replayed (``bench fragmentation``, ``capacity``,
``latency``, ``block-size``), each from the JSON its command wrote.

The replays run the real scheduler and managers on synthetic traces, each step timed by the cost
model, so they are deterministic: the same command prints the same numbers on any machine. The
paper's numbers come from :mod:`paged_attention.experiments.paper`.
"""

from __future__ import annotations

from pathlib import Path

from ..experiments import paper
from ..experiments.paper import LABELS
from .readme_results import TRACE_NAMES, load


def fragmentation_block(folder: Path | None = None) -> str:
    """Figure 2: where the KV cache goes, ours beside the paper's."""
    r = load("fragmentation", folder)
    s = r["setup"]
    lines = [
        f"**Figure 2, where the KV cache goes** (`bench fragmentation`, {s['num_requests']:,} requests at "
        f"{s['rate']:g} req/s, time averages while memory is the bottleneck; percent of the cache). The "
        "paper's caption says only \"during the experiment in §6.2\"; OPT-13B on ShareGPT at Figure 13's "
        f"{paper.FIG13_SHAREGPT_RATE:g} req/s is our reading:",
        "",
        "| system | token states | reservation | internal frag. | external frag. & others | paper |",
        "|---|---|---|---|---|---|",
    ]
    rows = [(m, f"{LABELS[m]}, buddy") for m in ("max", "pow2", "oracle")] + [
        ("paged", "paged (blocks of 16)")
    ]
    rows += [(f"{m}/first-fit", f"{LABELS[m]}, first fit") for m in ("pow2", "oracle")]
    for key, label in rows:
        stack = r["ours"][key]["stack"]
        cells = [f"**{v:.1f}**" if key == "paged" and i == 0 else f"{v:.1f}" for i, v in enumerate(stack)]
        if key == "paged":
            cells[1] = "0"
            theirs = f"{paper.FIG2['paged'][0]} token states"
        elif key in paper.FIG2:
            theirs = " / ".join(f"{v:g}" for v in paper.FIG2[key])
        else:
            theirs = "-"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {theirs} |")
    lines += [
        "",
        f"Every segment of the contiguous systems with buddy placement is within "
        f"{r['max_abs_diff_points_contiguous_buddy']:.1f} points of the paper's. First-fit placement helps "
        "the contiguous systems but leaves them far from paging.",
    ]
    return "\n".join(lines) + "\n"


def capacity_block(folder: Path | None = None) -> str:
    """Figure 13: how many requests run at once, and how that grows with the KV budget."""
    r = load("capacity", folder)
    order = ("max", "pow2", "oracle", "paged")
    lines = [
        "**Figure 13, batched requests** (`bench capacity`, same run, time average over the run):",
        "",
        "| | " + " | ".join(LABELS[m] if m != "paged" else "paged" for m in order) + " |",
        "|---|---|---|---|---|",
        "| ours (peak) | "
        + " | ".join(f"{r['ours'][m]['mean_batch']:.1f} ({r['ours'][m]['peak_batch']})" for m in order)
        + " |",
        "| paper | " + " | ".join(f"{r['paper'][m]:.2f}" for m in order) + " |",
        "",
    ]
    budgets = r["budgets_gib"]
    shown = [i for i, b in enumerate(budgets) if b in (budgets[0], 12, budgets[-1])]
    gib = " / ".join(f"{budgets[i]:g}" for i in shown)

    def at(m: str) -> str:
        return " / ".join(f"{r['by_budget'][m][i]:.1f}" for i in shown)

    lines.append(
        f"The ratio holds as memory grows: with {gib} GiB of KV cache the paged manager batches "
        f"{at('paged')} requests against Oracle's {at('oracle')} and Max's {at('max')}."
    )
    return "\n".join(lines) + "\n"


def latency_block(folder: Path | None = None) -> str:
    """Figure 12: the request rate each manager sustains, and paging's ratios over them."""
    r = load("latency", folder)
    over, theirs = r["paged_over"], r["paper_paged_over"]
    threshold = r["setup"]["threshold_s_per_token"]
    return (
        f"**Figure 12, latency against load** (`bench latency`, {r['setup']['num_requests']} requests per "
        f"rate): normalized latency (s per output token) stays flat until a manager's memory fills; "
        f"crossing {threshold:g} s/token, paging sustains **{over['oracle']:.1f}x** the request rate of "
        f"{LABELS['oracle']} (paper: {theirs['oracle'][0]:g}-{theirs['oracle'][1]:g}x) and "
        f"**{over['max']:.1f}x** that of {LABELS['max']} "
        f"(paper: {theirs['max'][0]:g}-{theirs['max'][1]:g}x).\n"
    )


def block_size_block(folder: Path | None = None) -> str:
    """§7.2: which block sizes serve within 10% of the best."""
    r = load("block_size", folder)
    said = []
    for name, t in r["traces"].items():
        low, high = t["near_best"]
        best_low, best_high = r["paper_best"][name]
        said.append(
            f"on {TRACE_NAMES.get(name, name)}-like traffic ({t['rate']:g} req/s) block sizes {low}-{high} "
            f"are within 10% of the best ({t['best_block_size']}; paper: {best_low}-{best_high})"
        )
    return (
        f"**Block size** (`bench block-size`): {'; '.join(said)}. Small blocks are penalised only "
        "through an assumed fixed cost per block read (`block_read_overhead` in "
        "`experiments/cost_model.py`).\n"
    )
