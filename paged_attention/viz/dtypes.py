"""Figures of float32 against bfloat16 on a CPU (notebook 07, ``bench engine --dtype ...``)."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from .style import COLORS

DTYPE_COLORS = {"float32": COLORS["weights"], "bfloat16": COLORS["tokens"], "float16": COLORS["future"]}


def step_vs_bound(result: dict) -> Figure:
    """A decode step's measured time by batch size, per dtype, beside that dtype's weight-read bound
    (weight bytes / read bandwidth, dashed): :func:`..experiments.dtypes.compare`'s result."""
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
    ax.set_xticks(range(len(batches)), [f"{b} sequence{'s' * (b != 1)}" for b in batches])
    ax.set_ylabel("ms per decode step")
    ax.set_title("A decode step against its weight-read bound (measured)")
    ax.legend(frameon=False, loc="upper left", fontsize=8)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig
