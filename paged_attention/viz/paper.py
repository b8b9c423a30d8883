"""The PagedAttention paper's figures, reproduced: memory breakdown (Figure 2), batched requests
(Figure 13), latency against request rate (Figure 12), the block-size sweep and measured throughput.

Drawn for notebooks 06 (fragmentation) and 07 (throughput) and the ``bench`` experiments.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from .style import FIG2_COLORS, SEQUENCE_COLORS


def memory_breakdown(
    ours: dict[str, Sequence[float]],
    paper: dict[str, Sequence[float]] | None = None,
    categories: Sequence[str] = (
        "token states",
        "reserved",
        "internal fragmentation",
        "external fragmentation + free",
    ),
    title: str = "",
) -> Figure:
    """The PagedAttention paper's Figure 2: where KV memory goes, one stacked bar per system.

    ``ours`` and ``paper`` map a system's label to its percentages per category (summing to 100).
    With ``paper``, each system gets two bars side by side: ours (solid) and the paper's (hatched).
    """
    names = list(ours)
    fig, ax = plt.subplots(figsize=(1.5 * len(names) + 2.6, 3.8))
    width = 0.38 if paper else 0.6
    for i, name in enumerate(names):
        bars = [(i - width / 2 if paper else i, ours[name], None, "ours")]
        if paper and name in paper:
            bars.append((i + width / 2, paper[name], "//", "paper"))
        for x, values, hatch, who in bars:
            bottom = 0.0
            for value, color in zip(values, FIG2_COLORS, strict=True):
                ax.bar(x, value, width, bottom=bottom, color=color, hatch=hatch, edgecolor="white", lw=0.5)
                bottom += value
            ax.text(x, 101, f"{values[0]:.1f}", ha="center", va="bottom", fontsize=7, color=FIG2_COLORS[0])
            if paper:
                ax.text(x, -3, who, ha="center", va="top", fontsize=7, color="#4a5568")
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.tick_params(axis="x", pad=14 if paper else 4)
    ax.set_ylim(0, 108)
    ax.set_ylabel("share of KV-cache memory (%)")
    handles = [Patch(facecolor=c, label=label) for c, label in zip(FIG2_COLORS, categories, strict=True)]
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
        ax.bar(x, ours[name], width, color=SEQUENCE_COLORS[i % 10], label="ours" if i == 0 else None)
        ax.text(x, ours[name], f"{ours[name]:.1f}", ha="center", va="bottom", fontsize=7)
        if peaks:
            ax.plot([x - width / 2.5, x + width / 2.5], [peaks[name]] * 2, color="#2d3748", lw=1)
        if paper and name in paper:
            ax.bar(i + width / 2, paper[name], width, color=SEQUENCE_COLORS[i % 10], alpha=0.45, hatch="//",
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
        for i, (name, values) in enumerate(by_budget.items()):  # type: ignore[union-attr]
            ax2.plot(budgets, values, "o-", color=SEQUENCE_COLORS[i % 10], label=name, ms=4)
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
    for i, (name, values) in enumerate(latencies.items()):
        ax.plot(rates, values, "o-", ms=3.5, color=SEQUENCE_COLORS[i % 10], label=name)
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
        ax_b.bar(i, tokens_per_s[name], color=SEQUENCE_COLORS[i % 10])
        ax_b.text(i, tokens_per_s[name], f"{tokens_per_s[name]:.0f}", ha="center", va="bottom", fontsize=8)
    ax_b.set_xticks(range(len(names)), names, fontsize=8, rotation=15)
    ax_b.set_ylabel("output tokens/s")
    ax_b.spines[["top", "right"]].set_visible(False)
    for name, (times, batch) in batch_over_time.items():
        ax_t.step(times, batch, where="post", color=SEQUENCE_COLORS[names.index(name) % 10], lw=1, label=name)
    ax_t.set_xlabel("seconds")
    ax_t.set_ylabel("running sequences")
    ax_t.legend(fontsize=8, frameon=False)
    ax_t.spines[["top", "right"]].set_visible(False)
    fig.suptitle(title or "Same model, same KV bytes: throughput and batch size", fontsize=10)
    fig.tight_layout()
    return fig
