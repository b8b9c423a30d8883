"""Serving under load, measured: latency against request rate per KV-cache manager (notebook 09).

One colour per manager in every panel (:data:`MANAGER_COLORS`). The drawing functions take the
payload of :func:`paged_attention.experiments.serve_sweep.run` (or a sweep of the same shape).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from ..experiments.paper import LABELS
from .style import MANAGER_COLORS, measured_on


def serve_sweep_figure(payload: dict, title: str | None = None) -> Figure:
    """Three panels against request rate: normalized latency (the paper's Figure 12 axis, with the
    sustained-rate threshold), mean TTFT and mean TPOT."""
    rates = payload["rates"]
    panels = (
        ("normalized_latency", "normalized latency (s/token)"),
        ("ttft_mean", "mean TTFT (s)"),
        ("tpot_mean", "mean TPOT (s/token)"),
    )
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for manager, values in payload[key].items():
            color = MANAGER_COLORS.get(manager, "#4a5568")
            ax.plot(
                rates[: len(values)], values, "o-", ms=3.5, color=color, label=LABELS.get(manager, manager)
            )
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.spines[["top", "right"]].set_visible(False)
    threshold = payload.get("threshold_s_per_token")
    if threshold:
        axes[0].axhline(
            threshold, color="#718096", ls=":", lw=1, label=f"threshold {threshold * 1000:.0f} ms/token"
        )
        axes[0].set_ylim(0, 3 * threshold)
    axes[0].legend(fontsize=8, frameon=False)
    setup = payload.get("setup", {})
    fig.suptitle(
        title
        or f"Measured through the server: {setup.get('model', '?')} on {measured_on(payload)}, "
        f"{setup.get('num_kv_blocks', '?')} KV blocks for every manager, "
        f"ShareGPT-like lengths x {setup.get('length_scale', '?')}",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def metrics_timeline(
    times: list[float], series: dict[str, list[float]], kv_usage: list[float], title: str = ""
) -> Figure:
    """What ``GET /metrics`` said while a burst ran: request counts (running, waiting, ...) above,
    the KV cache's usage below, against seconds since the burst began."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 4.2), sharex=True, height_ratios=(3, 2))
    for i, (name, values) in enumerate(series.items()):
        top.step(times, values, where="post", color=("#2b6cb0", "#e53e3e", "#718096")[i % 3], label=name)
    top.set_ylabel("requests")
    top.legend(fontsize=8, frameon=False)
    bottom.fill_between(times, [100 * u for u in kv_usage], step="post", color="#90cdf4")
    bottom.set_ylim(0, 100)
    bottom.set_ylabel("KV blocks used (%)")
    bottom.set_xlabel("seconds since the burst began")
    for ax in (top, bottom):
        ax.spines[["top", "right"]].set_visible(False)
    top.set_title(title or "A burst, seen through /metrics", fontsize=10)
    fig.tight_layout()
    return fig
