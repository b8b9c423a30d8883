"""Figures of float32 against bfloat16 on a CPU (notebook 07, ``bench engine --dtype ...``)."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from .style import COLORS

DTYPE_COLORS = {"float32": COLORS["weights"], "bfloat16": COLORS["tokens"], "float16": COLORS["future"]}


def step_vs_bound(result: dict) -> Figure:
    """A decode step's measured time by batch size, per dtype, beside that dtype's weight-read bound
    (weight bytes / read bandwidth, dashed) and arithmetic bound (a black tick on each bar):
    :func:`..experiments.dtypes.compare`'s result."""
    rows = result["rows"]
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    batches = sorted({r["batch"] for r in rows})
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    width = 0.8 / len(dtypes)
    for i, dtype in enumerate(dtypes):
        ms = {r["batch"]: r["step_s"] * 1e3 for r in rows if r["dtype"] == dtype}
        xs = [b + (i - (len(dtypes) - 1) / 2) * width for b in range(len(batches))]
        bars = ax.bar(xs, [ms[b] for b in batches], width, label=dtype, color=DTYPE_COLORS.get(dtype))
        ax.bar_label(bars, labels=[f"{ms[b]:.0f}" for b in batches], padding=2, fontsize=8)
        bound = next(r["bound_s"] for r in rows if r["dtype"] == dtype) * 1e3
        label = f"{dtype}: reading the weights once, {bound:.0f} ms"
        ax.axhline(bound, color=DTYPE_COLORS.get(dtype), linestyle="--", linewidth=1, label=label)
        arithmetic = {
            r["batch"]: r["arithmetic_s"] * 1e3 for r in rows if r["dtype"] == dtype and "arithmetic_s" in r
        }
        if len(arithmetic) == len(batches):  # (a result measured before the arithmetic bound was)
            label = "the step's multiply-adds at one large product's rate" if i == 0 else None
            heights = [arithmetic[b] for b in batches]
            ax.scatter(xs, heights, marker="_", s=260, linewidths=2, color="black", zorder=3, label=label)
    ax.set_xticks(range(len(batches)), [f"{b} sequence{'s' * (b != 1)}" for b in batches])
    ax.set_ylabel("ms per decode step")
    ax.set_title("A decode step against its weight-read and arithmetic bounds (measured)")
    ax.legend(frameon=False, loc="upper left", fontsize=8)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


#: The parts of a profiled step (:data:`..experiments.step_profile.PARTS`), bottom to top.
PART_COLORS = {
    "matrix products": COLORS["weights"],
    "attention": COLORS["tokens"],
    "other operations": COLORS["future"],
    "Python and the rest": "#cbd5e0",
}


def step_parts(profiles: dict[str, dict]) -> Figure:
    """One stacked bar per profiled decode step (label -> :func:`..experiments.step_profile.profile_decode`'s
    result): the step's milliseconds split into its parts."""
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    labels = list(profiles)
    bottoms = [0.0] * len(labels)
    for part, color in PART_COLORS.items():
        ms = [profiles[k]["step_s"] * 1e3 * profiles[k]["share"][part] for k in labels]
        bars = ax.barh(labels, ms, left=bottoms, color=color, label=part)
        ax.bar_label(bars, labels=[f"{v:.0f}" if v >= 4 else "" for v in ms], label_type="center", fontsize=8)
        bottoms = [b + v for b, v in zip(bottoms, ms, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("ms per decode step (profiled shares of the unprofiled step time)")
    ax.set_title("Where a decode step's time goes (measured)")
    ax.legend(frameon=False, fontsize=8, ncol=2, loc="lower right")
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig
