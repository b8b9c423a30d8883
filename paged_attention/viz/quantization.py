"""Figures of quantized pages (notebook 11, ``bench kv-dtype``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from .style import COLORS, SEQUENCE_COLORS


def channel_magnitudes(keys: Sequence[float], values: Sequence[float], layer: int, head: int) -> Figure:
    """The largest ``|k|`` and ``|v|`` of each channel (head dimension) of one layer's KV head over a
    text: the few channels far above the rest set a shared scale's step."""
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 2.8), sharey=True)
    for ax, magnitudes, name in ((axes[0], keys, "keys"), (axes[1], values, "values")):
        ax.bar(
            range(len(magnitudes)), magnitudes, color=COLORS["tokens"] if name == "keys" else COLORS["future"]
        )
        ax.set_title(f"{name}: largest |x| per channel (layer {layer}, KV head {head})", fontsize=9)
        ax.set_xlabel("channel")
        ax.spines[["top", "right"]].set_visible(False)
    axes[0].set_ylabel("largest |x| over the text")
    fig.tight_layout()
    return fig


def format_errors(errors: Mapping[str, Sequence[float]], what: str) -> Figure:
    """The distribution of one error measure per format (log scale), e.g. each token's KL divergence."""
    fig, ax = plt.subplots(figsize=(7.2, 3.0))
    names = list(errors)
    ax.boxplot([list(errors[n]) for n in names], showfliers=True, flierprops={"markersize": 2})
    ax.set_xticks(range(1, len(names) + 1), names, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel(what)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


def kv_dtype_summary(result: Mapping) -> Figure:
    """``bench kv-dtype``: per format, the requests running at once and output tokens/s in the demo's
    KV budget (left), and the mean KL divergence per token from the reference cache (right)."""
    rows = list(result["rows"])
    labels = [r["format"].replace(" (", "\n(") for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 4.0))
    x = range(len(rows))
    colors = [SEQUENCE_COLORS[i % len(SEQUENCE_COLORS)] for i in x]
    for ax, key, title in ((axes[0], "peak_running", "requests running at once (most)"),
                           (axes[1], "tokens_per_s", "output tokens/s")):  # fmt: skip
        bars = ax.bar(x, [r[key] for r in rows], color=colors)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_title(title, fontsize=9)
    kl = [max(r["error"]["kl_mean"], 1e-9) for r in rows[1:]]
    bars = axes[2].bar(range(1, len(rows)), kl, color=colors[1:])
    axes[2].bar_label(bars, fmt="%.1e", fontsize=8)
    axes[2].set_yscale("log")
    axes[2].set_title(f"mean KL per token from {rows[0]['format']}", fontsize=9)
    for ax in axes:
        ax.set_xticks(list(x), labels, fontsize=7, rotation=35, ha="right")
        ax.spines[["top", "right"]].set_visible(False)
    fig.suptitle(
        f"{result['model']}: a KV budget of {result['budget_bytes'] / 2**20:.1f} MiB "
        f"({result['budget_blocks_of_reference']} {rows[0]['format']} blocks)",
        fontsize=10,
    )
    fig.tight_layout()
    return fig
