"""The PagedAttention paper's figures, reproduced: memory breakdown (Figure 2), batched requests
(Figure 13), latency against request rate (Figure 12), the block-size sweep and measured throughput;
and each of those experiments' results (:mod:`paged_attention.experiments`) drawn as its figure.

Drawn for notebooks 06 (fragmentation) and 07 (throughput) and the ``bench`` experiments.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..experiments.paper import FIG2_CATEGORIES, FIG2_PAGED_UNSPLIT, LABELS, MANAGERS
from .style import FIG2_COLORS, SEQUENCE_COLORS, manager_color, measured_on

UNSPLIT_COLOR = "#a0aec0"  # a share the paper reports without splitting it into categories
FREE_COLOR = "#fbe3c4"  # free memory, drawn apart from external fragmentation (a paler FIG2_COLORS[3])


def memory_breakdown(
    ours: dict[str, Sequence[float]],
    paper: dict[str, Sequence[float]] | None = None,
    categories: Sequence[str] = FIG2_CATEGORIES,
    title: str = "",
    unsplit: dict[str, float] | None = None,
    notes: dict[str, str] | None = None,
    free: dict[str, float] | None = None,
) -> Figure:
    """The PagedAttention paper's Figure 2: where KV memory goes, one stacked bar per system.

    ``ours`` and ``paper`` map a system's label to its percentages per category (summing to 100),
    in the order of ``categories`` (the paper's four by default: the fourth is "External frag. &
    Others", free memory included). With ``paper``, each system gets two bars side by side: ours
    (solid) and the paper's (hatched). ``unsplit`` maps a label to the share of the paper's bar that
    the paper gives as one number without splitting it into categories (vLLM's 3.7%): that bar is
    drawn as its token states and one grey segment of that size. ``notes`` adds a line under a
    label (for instance how much of the run the system was memory-bound). ``free`` maps a label to
    the part of *our* fourth segment that is free memory (percent): it is drawn apart, pale, so that a
    cache with room to spare does not read as fragmented.
    """
    names = list(ours)
    unsplit = unsplit or {}
    fig, ax = plt.subplots(figsize=(1.5 * len(names) + 2.6, 3.8))
    width = 0.38 if paper else 0.6
    for i, name in enumerate(names):
        bars = [(i - width / 2 if paper else i, ours[name], None, "ours", False)]
        if paper and name in paper:
            bars.append((i + width / 2, paper[name], "//", "paper", name in unsplit))
        for x, values, hatch, who, rest_unsplit in bars:
            segments = list(zip(values, FIG2_COLORS, strict=True))
            if rest_unsplit:
                segments = [segments[0], (unsplit[name], UNSPLIT_COLOR)]
            elif who == "ours" and free and name in free:
                spare = min(free[name], segments[-1][0])
                segments[-1:] = [(segments[-1][0] - spare, segments[-1][1]), (spare, FREE_COLOR)]
            bottom = 0.0
            for value, color in segments:
                ax.bar(x, value, width, bottom=bottom, color=color, hatch=hatch, edgecolor="white", lw=0.5)
                bottom += value
            ax.text(x, 101, f"{values[0]:.1f}", ha="center", va="bottom", fontsize=7, color=FIG2_COLORS[0])
            if paper:
                ax.text(x, -3, who, ha="center", va="top", fontsize=7, color="#4a5568")
    labels = [f"{n}\n{notes[n]}" if notes and n in notes else n for n in names]
    ax.set_xticks(range(len(names)), labels, fontsize=8)
    ax.tick_params(axis="x", pad=14 if paper else 4)
    ax.set_ylim(0, 108)
    ax.set_ylabel("share of KV-cache memory (%)")
    handles = [Patch(facecolor=c, label=label) for c, label in zip(FIG2_COLORS, categories, strict=True)]
    if free:
        handles.append(Patch(facecolor=FREE_COLOR, label="free (ours; in the paper's fourth)"))
    if paper and any(n in unsplit for n in names):
        label = "not split by the paper"
        handles.append(Patch(facecolor=UNSPLIT_COLOR, hatch="//", edgecolor="white", label=label))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_title(title or "Where the KV cache goes (token-state share on top)", fontsize=10)
    fig.tight_layout()
    return fig


def batched_requests(
    ours: dict[str, float],
    paper: dict[str, float] | None = None,
    peaks: dict[str, int] | None = None,
    budgets: Sequence[float] | None = None,
    by_budget: dict[str, Sequence[float]] | None = None,
    title: str = "",
) -> Figure:
    """The paper's Figure 13 (average batched requests per system), and optionally how it grows with
    the KV budget (``budgets`` in GiB, ``by_budget[name]`` the average batch at each)."""
    names = list(ours)
    panels = 2 if budgets is not None and by_budget else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 3.6), squeeze=False)
    ax = axes[0, 0]
    width = 0.38 if paper else 0.6
    for i, name in enumerate(names):
        x = i - width / 2 if paper else i
        ax.bar(x, ours[name], width, color=manager_color(name), label="ours" if i == 0 else None)
        ax.text(x, ours[name], f"{ours[name]:.1f}", ha="center", va="bottom", fontsize=7)
        if peaks:
            ax.plot([x - width / 2.5, x + width / 2.5], [peaks[name]] * 2, color="#2d3748", lw=1)
        if paper and name in paper:
            ax.bar(i + width / 2, paper[name], width, color=manager_color(name), alpha=0.45, hatch="//",
                   edgecolor="white", label="paper" if i == 0 else None)  # fmt: skip
            ax.text(i + width / 2, paper[name], f"{paper[name]:.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("batched requests (time average)")
    if peaks:
        ax.plot([], [], color="#2d3748", lw=1, label="peak (ours)")
    ax.legend(fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_title(title or "How many requests run at once", fontsize=10)
    if panels == 2:
        ax2 = axes[0, 1]
        for name, values in by_budget.items():  # type: ignore[union-attr]
            ax2.plot(budgets, values, "o-", color=manager_color(name), label=name, ms=4)
        ax2.set_xlabel("KV-cache budget (GiB)")
        ax2.set_ylabel("batched requests (saturated)")
        ax2.legend(fontsize=8, frameon=False)
        ax2.spines[["top", "right"]].set_visible(False)
        ax2.set_title("... against the memory given to the KV cache", fontsize=10)
    fig.tight_layout()
    return fig


def latency_vs_rate(
    rates: Sequence[float],
    latencies: dict[str, Sequence[float]],
    threshold: float | None = None,
    title: str = "",
) -> Figure:
    """The paper's Figure 12: normalized latency (s per output token) against request rate."""
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name, values in latencies.items():
        ax.plot(rates, values, "o-", ms=3.5, color=manager_color(name), label=name)
    if threshold is not None:
        ax.axhline(threshold, color="#718096", ls=":", lw=1, label=f"{threshold} s/token")
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("normalized latency (s/token)")
    top = 4 * threshold if threshold else max(max(v) for v in latencies.values())
    ax.set_ylim(0, top)
    ax.legend(fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_title(title or "Latency against load", fontsize=10)
    fig.tight_layout()
    return fig


def block_size_sweep(
    block_sizes: Sequence[int], values: dict[str, Sequence[float]], ylabel: str, title: str = ""
) -> Figure:
    """One line per trace: a metric (e.g. normalized latency) against the block size (log scale)."""
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for i, (name, ys) in enumerate(values.items()):
        ax.plot(block_sizes, ys, "o-", ms=4, color=SEQUENCE_COLORS[i % 10], label=name)
        best = min(range(len(ys)), key=lambda j: ys[j])
        ax.plot(block_sizes[best], ys[best], "*", ms=12, color=SEQUENCE_COLORS[i % 10])
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(block_sizes), [str(b) for b in block_sizes])
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_title(title or "Block size: small blocks read slowly, large ones waste memory", fontsize=10)
    fig.tight_layout()
    return fig


def throughput_comparison(
    tokens_per_s: dict[str, float],
    batch_over_time: dict[str, tuple[Sequence[float], Sequence[int]]],
    title: str = "",
) -> Figure:
    """Measured output tokens/s per memory manager (left) and each one's running batch over time (right)."""
    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [1, 1.6]})
    names = list(tokens_per_s)
    for i, name in enumerate(names):
        ax_b.bar(i, tokens_per_s[name], color=manager_color(name))
        ax_b.text(i, tokens_per_s[name], f"{tokens_per_s[name]:.0f}", ha="center", va="bottom", fontsize=8)
    ax_b.set_xticks(range(len(names)), names, fontsize=8, rotation=15)
    ax_b.set_ylabel("output tokens/s")
    ax_b.spines[["top", "right"]].set_visible(False)
    for name, (times, batch) in batch_over_time.items():
        ax_t.step(times, batch, where="post", color=manager_color(name), lw=1, label=name)
    ax_t.set_xlabel("seconds")
    ax_t.set_ylabel("running sequences")
    ax_t.legend(fontsize=8, frameon=False)
    ax_t.spines[["top", "right"]].set_visible(False)
    fig.suptitle(title or "Same model, same KV bytes: throughput and batch size", fontsize=10)
    fig.tight_layout()
    return fig


def batch_sweep(
    sweeps: dict[str, tuple[Sequence[str], dict[str, Sequence[float]], dict[str, Sequence[float]]]],
    bound_at: float = 0.5,
    title: str = "",
) -> Figure:
    """Mean batch against a swept setting (request rate, KV budget), one panel per sweep.

    ``sweeps[xlabel] = (ticks, batch, bound)``: the settings' tick labels, ``batch[name]`` each
    system's time-averaged batch at each setting, and ``bound[name]`` the share of the run in which
    some request waited. A marker is filled where that share is at least ``bound_at`` (memory was
    the bottleneck), hollow where it is not.
    """
    fig, axes = plt.subplots(1, len(sweeps), figsize=(5.2 * len(sweeps), 3.6), squeeze=False)
    for ax, (xlabel, (ticks, batch, bound)) in zip(axes[0], sweeps.items(), strict=True):
        xs = list(range(len(ticks)))
        for name, ys in batch.items():
            color = manager_color(name)
            ax.plot(xs, ys, "-", color=color, lw=1, label=name)
            for x, y, share in zip(xs, ys, bound[name], strict=True):
                ax.plot(x, y, "o", ms=5, color=color, mfc=color if share >= bound_at else "white")
        ax.plot([], [], "o", color="#4a5568", label=f"filled: a request waits >= {bound_at:.0%} of the run")
        ax.set_xticks(xs, list(ticks), fontsize=8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("batched requests (time average)")
        ax.legend(fontsize=7, frameon=False)
        ax.spines[["top", "right"]].set_visible(False)
    fig.suptitle(title or "Batched requests against the load and the memory", fontsize=10)
    fig.tight_layout()
    return fig


# ---- The experiments' results (the payloads of experiments.<name>.run), as the figures above ---------


def fragmentation_figure(payload: dict) -> Figure:
    """Figure 2 from :func:`paged_attention.experiments.fragmentation.run`: ours and the paper's."""
    ours = {LABELS[m]: payload["ours"][m]["stack"] for m in MANAGERS}
    for m in ("pow2", "oracle"):  # (Max is the same either way: seven 2048-slot ranges)
        ours[f"{LABELS[m]}\nfirst-fit"] = payload["ours"][f"{m}/first-fit"]["stack"]
    theirs = {LABELS[m]: v for m, v in payload["paper"].items()}
    bound = {LABELS[m]: f"bound {payload['ours'][m]['saturated_share']:.0%}" for m in MANAGERS}
    return memory_breakdown(
        ours,
        theirs,
        categories=payload["categories"],
        title="KV memory by category: ours (solid) and the paper's Figure 2 (hatched)",
        unsplit={LABELS["paged"]: FIG2_PAGED_UNSPLIT},
        notes=bound,
    )


def capacity_figure(payload: dict) -> Figure:
    """Figure 13 and the budget sweep from :func:`paged_attention.experiments.capacity.run`."""
    return batched_requests(
        {LABELS[m]: r["mean_batch"] for m, r in payload["ours"].items()},
        {LABELS[m]: v for m, v in payload["paper"].items()},
        peaks={LABELS[m]: r["peak_batch"] for m, r in payload["ours"].items()},
        budgets=payload["budgets_gib"],
        by_budget={LABELS[m]: v for m, v in payload["by_budget"].items()},
        title=f"Batched requests, ShareGPT-like at {payload['setup']['rate']:g} req/s: "
        "ours and the paper's Figure 13 (2 req/s)",
    )


def latency_figure(payload: dict) -> Figure:
    """Figure 12 from :func:`paged_attention.experiments.latency.run`."""
    return latency_vs_rate(
        payload["rates"],
        {LABELS[m]: v for m, v in payload["normalized_latency"].items()},
        threshold=payload["setup"]["threshold_s_per_token"],
        title="Normalized latency against request rate (ShareGPT-like, OPT-13B on A100 by cost model)",
    )


def block_size_figure(payload: dict) -> Figure:
    """The block-size sweep from :func:`paged_attention.experiments.block_size.run`."""
    return block_size_sweep(
        payload["block_sizes"],
        {f"{name} ({t['rate']:g} req/s)": t["normalized_latency"] for name, t in payload["traces"].items()},
        ylabel="normalized latency (s/token)",
    )


def throughput_figure(payload: dict) -> Figure:
    """Measured throughput and batch timelines from :func:`paged_attention.experiments.throughput.run`."""
    return throughput_comparison(
        {LABELS[c]: v for c, v in payload["tokens_per_s"].items()},
        {LABELS[c]: (t["seconds"], t["batch"]) for c, t in payload["timeline"].items()},
        title=f"Embedded model on {measured_on(payload)}, "
        f"{payload['setup']['kv_slots']} KV slots for every manager",
    )
