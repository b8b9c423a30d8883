"""Figures of speculative decoding (notebook 10, ``bench spec-decode``)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from .style import COLORS


def speedup_bars(rows: Sequence[dict]) -> Figure:
    """Output tokens/s with n-gram drafts over without, per workload and batch size (measured)."""
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    labels = [f"{r['workload']}\nbatch {r['batch']}" for r in rows]
    speedups = [r["speedup"] for r in rows]
    colors = [COLORS["tokens"] if s >= 1 else COLORS["wasted"] for s in speedups]
    bars = ax.bar(labels, speedups, color=colors)
    ax.bar_label(bars, labels=[f"{s:.2f}x" for s in speedups], padding=2)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("tokens/s with drafts / without")
    ax.set_ylim(0, max(speedups) * 1.2)
    ax.set_title("n-gram speculative decoding, greedy, identical outputs (measured)")
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


def acceptance_by_position(accepted_per_position: Sequence[int], num_drafts: int) -> Figure:
    """The share of verification steps whose draft at each position was accepted."""
    fig, ax = plt.subplots(figsize=(5.6, 3.0))
    positions = list(range(1, len(accepted_per_position) + 1))
    shares = [a / num_drafts if num_drafts else 0.0 for a in accepted_per_position]
    ax.bar(positions, shares, color=COLORS["tokens"])
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted, share of steps")
    ax.set_ylim(0, 1)
    ax.set_xticks(positions)
    ax.set_title("Acceptance by draft position")
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig
