"""Figures of structured outputs (notebook 12)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from .style import COLORS


def allowed_per_step(counts: Sequence[int], vocab_size: int, texts: Sequence[str]) -> Figure:
    """How many tokens a grammar's mask allows at each step of one answer (log scale), the steps
    that allow one token (forced: the model has no say) marked apart. ``texts``: the text so far
    at each step, for the labels."""
    fig, ax = plt.subplots(figsize=(7.2, 3.4))
    steps = list(range(len(counts)))
    colors = [COLORS["wasted"] if c == 1 else COLORS["tokens"] for c in counts]
    bars = ax.bar(steps, counts, color=colors)
    ax.bar_label(bars, labels=[str(c) for c in counts], padding=1, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylim(0.8, vocab_size * 1.5)
    ax.axhline(vocab_size, color="black", linewidth=0.8, linestyle="--")
    ax.text(
        len(counts) - 0.5,
        vocab_size,
        f"whole vocabulary ({vocab_size:,})",
        ha="right",
        va="bottom",
        fontsize=8,
    )
    ax.set_xticks(
        steps, [repr(t) if len(t) <= 6 else "…" + repr(t[-5:])[1:] for t in texts], rotation=60, fontsize=7
    )
    ax.set_xlabel("text so far (one bar per step)")
    ax.set_ylabel("tokens allowed next")
    ax.set_title("A grammar's mask, step by step (red: one token allowed, forced)")
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig
