"""Figures of the paged-attention kernels: what one program reads, split-K partitions, and the
decode kernel's bandwidth (as a figure and as a table).

Drawn for notebook 03 (the Triton kernel) and ``bench kernel``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from .._checks import cdiv
from .style import COLORS, SEQUENCE_COLORS

if TYPE_CHECKING:
    from ..experiments.kernel_timing import BandwidthRow


def program_reads(
    block_table_row: Sequence[int],
    seq_len: int,
    block_size: int,
    tile: int,
    num_blocks: int,
    title: str = "",
) -> Figure:
    """What one paged-attention program reads: its sequence's tiles, and where they lie in the cache.

    Top: the sequence as the program sees it, positions ``0 .. seq_len - 1`` in logical blocks, each
    slot coloured by the loop iteration (tile) that loads it. Bottom: the physical cache, a strip of
    ``num_blocks`` blocks; the blocks the block table points to carry the same colours, the rest are
    grey (never touched), and a line joins each logical block to its physical block.
    """
    used = cdiv(seq_len, block_size)
    table = [int(b) for b in block_table_row[:used]]
    num_tiles = cdiv(seq_len, tile)
    cmap = plt.get_cmap("viridis")
    tile_colors = [cmap(0.15 + 0.7 * t / max(1, num_tiles - 1)) for t in range(num_tiles)]
    gap = 0.18
    width = num_blocks * (1 + gap) - gap
    fig, ax = plt.subplots(
        figsize=(min(14.0, max(6.0, 0.62 * width + 0.6)), 3.4)
    )  # long tables: narrower blocks
    slot_w = 1.0 / block_size

    def draw_block(x0: float, y0: float, positions: Sequence[int | None]) -> None:
        for slot, pos in enumerate(positions):
            face = "white" if pos is None else tile_colors[pos // tile]
            ax.add_patch(
                Rectangle(
                    (x0 + slot * slot_w, y0),
                    slot_w,
                    1,
                    facecolor=face,
                    edgecolor="white",
                    linewidth=0.8 if num_blocks <= 40 else 0,
                )
            )
        ax.add_patch(Rectangle((x0, y0), 1, 1, fill=False, edgecolor="#4a5568", linewidth=1.2))

    y_logical, y_physical = 2.3, 0.0
    logical_x0 = (width - (used * (1 + gap) - gap)) / 2
    for i, block_id in enumerate(table):
        positions = [p if p < seq_len else None for p in range(i * block_size, (i + 1) * block_size)]
        lx = logical_x0 + i * (1 + gap)
        draw_block(lx, y_logical, positions)
        if used <= 24 or i % 5 == 0:
            ax.text(lx + 0.5, y_logical + 1.08, f"logical {i}", ha="center", va="bottom", fontsize=7)
        px = block_id * (1 + gap)
        draw_block(px, y_physical, positions)
        ax.annotate(
            "",
            xy=(px + 0.5, y_physical + 1.02),
            xytext=(lx + 0.5, y_logical - 0.02),
            arrowprops=dict(arrowstyle="->", color="#718096", linewidth=0.9, shrinkA=0, shrinkB=0),
        )
    for block_id in range(num_blocks):
        px = block_id * (1 + gap)
        if block_id not in table:
            ax.add_patch(Rectangle((px, y_physical), 1, 1, facecolor=COLORS["free"], edgecolor="#cbd5e0"))
        if num_blocks <= 40 or block_id % 5 == 0:
            ax.text(
                px + 0.5, y_physical - 0.08, str(block_id), ha="center", va="top", fontsize=7, color="#2d3748"
            )
    ax.text(-0.25, y_logical + 0.5, "the sequence\n(block table order)", ha="right", va="center", fontsize=8)
    ax.text(-0.25, y_physical + 0.5, "physical cache\n(block id below)", ha="right", va="center", fontsize=8)
    ax.set_xlim(-0.1, width + 0.1)
    ax.set_ylim(y_physical - 0.5, y_logical + 1.5)
    ax.set_aspect("equal")
    ax.axis("off")
    shown = range(num_tiles) if num_tiles <= 8 else [0, 1, num_tiles - 2, num_tiles - 1]  # a short legend
    handles = [
        Patch(
            facecolor=tile_colors[t],
            label=f"iteration {t}: positions {t * tile}-{min(seq_len, (t + 1) * tile) - 1}",
        )
        for t in shown
    ]
    if num_tiles > 8:
        handles.insert(2, Patch(facecolor="white", label=f"... {num_tiles - 4} more, colours between"))
    handles.append(Patch(facecolor=COLORS["free"], edgecolor="#cbd5e0", label="not read by this program"))
    ax.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, fontsize=8, frameon=False
    )
    ax.set_title(title or f"One program, seq_len={seq_len}, block_size={block_size}, tile={tile}")
    fig.tight_layout()
    return fig


def split_k_partitions(seq_len: int, partition_size: int, tile: int, title: str = "") -> Figure:
    """Split-K as a timeline: one program walking every tile, against one program per partition.

    Each box is one loop iteration (``tile`` tokens). Without split-K a single program does them all
    in turn; with it, partition ``s`` (tokens ``s * partition_size ...``) runs as its own program,
    in parallel with the others if the GPU has idle SMs, and a short merge pass combines the results.
    """
    num_tiles = cdiv(seq_len, tile)
    num_parts = cdiv(seq_len, partition_size)
    colors = [SEQUENCE_COLORS[s % len(SEQUENCE_COLORS)] for s in range(num_parts)]
    rows = num_parts + 2
    fig, ax = plt.subplots(figsize=(7.2, 0.42 * rows + 1.5))

    def box(x: float, y: float, color: str | tuple, label: str = "") -> None:
        ax.add_patch(Rectangle((x, y), 0.9, 0.7, facecolor=color, edgecolor="white"))
        if label:
            ax.text(x + 0.45, y + 0.35, label, ha="center", va="center", fontsize=7, color="white")

    y = rows - 1
    for t in range(num_tiles):
        box(t, y, colors[t * tile // partition_size])
    labels = [(y + 0.35, "no split-K:\none program")]
    for s in range(num_parts):
        y = rows - 3 - s
        part_tiles = cdiv(min(seq_len, (s + 1) * partition_size) - s * partition_size, tile)
        for t in range(part_tiles):
            box(t, y, colors[s])
        labels.append((y + 0.35, f"partition {s}\n(own program)"))
    split_tiles = cdiv(partition_size, tile) if num_parts > 1 else num_tiles
    merge_y = rows - 2 - num_parts
    ax.add_patch(
        Rectangle((split_tiles, merge_y + 0.35), 0.9, num_parts - 0.3, facecolor="#4a5568", edgecolor="white")
    )
    ax.text(
        split_tiles + 1.1, merge_y + 0.35 + (num_parts - 0.3) / 2, "merge\n(exact)", va="center", fontsize=8
    )
    for y_label, text in labels:
        ax.text(-0.4, y_label, text, ha="right", va="center", fontsize=8)
    ax.axvline(split_tiles + 0.95, color="#a0aec0", linestyle=":", linewidth=1)
    ax.axvline(num_tiles - 0.05, color="#a0aec0", linestyle=":", linewidth=1)
    ax.set_xlim(-0.2, num_tiles + 0.5)
    ax.set_ylim(-0.3, rows)
    ax.set_yticks([])
    ax.spines[["top", "right", "left"]].set_visible(False)
    ax.set_xlabel(f"loop iterations of {tile} tokens (time, when every program gets its own SM)")
    ax.set_title(
        title or f"Split-K: {seq_len} tokens in {num_parts} partitions of {partition_size}, then one merge"
    )
    fig.tight_layout()
    return fig


def kernel_bandwidth(rows: Sequence[BandwidthRow], peak: float | None, title: str) -> Figure:
    """Decode-kernel bandwidth (KV bytes read / GPU busy time) per method against batch size, one
    panel per context.

    ``rows`` are :class:`paged_attention.experiments.kernel_timing.BandwidthRow`; ``peak`` (bytes/s) draws
    the HBM peak as a dashed line when the GPU is known.
    """
    contexts = sorted({r.context for r in rows})
    methods = list(dict.fromkeys(r.method for r in rows))
    fig, axes = plt.subplots(1, len(contexts), figsize=(3.2 * len(contexts), 3.2), sharey=True, squeeze=False)
    for ax, context in zip(axes[0], contexts, strict=True):
        for i, method in enumerate(methods):
            pts = sorted(
                (r.batch, r.kernel_bytes_per_second / 1e9)
                for r in rows
                if r.context == context and r.method == method
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=method, color=SEQUENCE_COLORS[i])
        if peak:
            ax.axhline(peak / 1e9, color="black", ls="--", lw=1, label="HBM peak")
        ax.set_xscale("log", base=2)
        ax.set_title(f"context {context:,}", fontsize=9)
        ax.set_xlabel("batch (sequences)")
        ax.spines[["top", "right"]].set_visible(False)
    axes[0][0].set_ylabel("KV bytes read / GPU time (GB/s)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"Paged decode bandwidth: {title}", fontsize=10)
    fig.tight_layout()
    return fig


def bandwidth_table(rows: Sequence[BandwidthRow], peak: float | None) -> str:
    """The same rows as text: the GPU's time per call and its bandwidth (KV bytes / GPU busy time),
    its share of the HBM ``peak`` (bytes/s, when known), the time against the ``contiguous`` row of
    the same batch and context, and the whole call's time as a caller sees it (host checks and
    launches included; on a CPU the only time there is)."""
    by_key = {(r.method, r.batch, r.context): r for r in rows}
    on_gpu = any(r.device_seconds for r in rows)
    head = (
        "batch",
        "context",
        "method",
        "GPU us" if on_gpu else "us",
        "GB/s",
        "% peak",
        "vs contiguous",
        "call us",
    )
    lines = ["{:>6} {:>8} {:>11} {:>9} {:>8} {:>7} {:>14} {:>9}".format(*head)]
    for r in rows:
        base = by_key.get(("contiguous", r.batch, r.context))
        busy = r.device_seconds or r.seconds
        ratio = f"{busy / (base.device_seconds or base.seconds):.3f}x" if base else ""
        pct = f"{100 * r.kernel_bytes_per_second / peak:.0f}%" if peak else "-"
        gbps = r.kernel_bytes_per_second / 1e9
        lines.append(
            f"{r.batch:>6} {r.context:>8} {r.method:>11} {busy * 1e6:>9.1f} {gbps:>8.1f} {pct:>7} "
            f"{ratio:>14} {r.seconds * 1e6:>9.1f}"
        )
    return "\n".join(lines)
