"""Every figure of the project. Notebooks call these and save through :func:`save`.

Keeping the drawing code here, not in notebook cells, means a figure looks the same wherever it is
drawn and a notebook cell stays about the idea, not about matplotlib. Each function takes plain
data, returns a ``matplotlib.figure.Figure`` and never calls ``plt.show()``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from .allocator import BlockAllocator
from .metrics import ReservationRow
from .page_table import PageTable

GiB = 1024**3
COLORS = {
    "tokens": "#2b6cb0",
    "future": "#90cdf4",
    "wasted": "#e53e3e",
    "free": "#edf2f7",
    "weights": "#4a5568",
}
SEQUENCE_COLORS = plt.get_cmap("tab10").colors


def repo_root() -> Path | None:
    """The source checkout this package lives in, if it lives in one (editable install)."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").exists() and (root / "notebooks").is_dir() else None


def figures_dir() -> Path:
    """Where figures go: ``$PAGED_ATTENTION_FIGURES``, else the checkout's ``figures/``, else ./figures."""
    env = os.environ.get("PAGED_ATTENTION_FIGURES")
    root = repo_root()
    path = Path(env) if env else (root / "figures" if root else Path.cwd() / "figures")
    path.mkdir(parents=True, exist_ok=True)
    return path


def save(fig: Figure, name: str) -> None:
    """Save ``fig`` as ``figures/<name>.png`` (no software tag, so reruns are byte-stable).

    Returns nothing, so that a notebook cell ending in ``plots.save(...)`` prints no path.
    """
    fig.savefig(figures_dir() / f"{name}.png", dpi=110, bbox_inches="tight", metadata={"Software": None})


def kv_bytes_per_token(names: Sequence[str], bytes_per_token: Sequence[int]) -> Figure:
    """Horizontal bars: KiB of KV cache per token for each model."""
    fig, ax = plt.subplots(figsize=(6.4, 0.45 * len(names) + 1.2))
    kib = [b / 1024 for b in bytes_per_token]
    bars = ax.barh(list(names), kib, color=COLORS["tokens"])
    ax.bar_label(bars, labels=[f"{k:,.0f} KiB" for k in kib], padding=3)
    ax.invert_yaxis()
    ax.set_xlabel("KV cache per token (KiB, fp16)")
    ax.set_xlim(0, max(kib) * 1.25)
    ax.set_title("One token's keys and values, summed over all layers")
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


def kv_memory_vs_context(
    bytes_per_token: int,
    weights_bytes: int,
    gpu_bytes: int,
    batch_sizes: Sequence[int],
    max_context: int,
    model_name: str,
    gpu_name: str,
) -> Figure:
    """KV-cache GiB against context length for several batch sizes, beside the room the GPU leaves."""
    fig, ax = plt.subplots(figsize=(6.4, 4))
    contexts = list(range(0, max_context + 1, max(1, max_context // 64)))
    room = (gpu_bytes - weights_bytes) / GiB
    ax.axhspan(
        0,
        room,
        color=COLORS["free"],
        zorder=0,
        label=f"room for KV on {gpu_name} after {model_name}'s weights ({room:.0f} GiB)",
    )
    for i, batch in enumerate(batch_sizes):
        ax.plot(
            contexts,
            [batch * c * bytes_per_token / GiB for c in contexts],
            label=f"batch {batch}",
            color=plt.get_cmap("Blues")(0.4 + 0.6 * i / max(1, len(batch_sizes) - 1)),
        )
    ax.set_xlabel("tokens per request (prompt + output)")
    ax.set_ylabel("KV cache (GiB)")
    ax.set_ylim(0, max(room * 3, 1))
    ax.set_xlim(0, max_context)
    ax.set_title(f"{model_name}: the KV cache outgrows the weights")
    ax.legend(loc="upper left", fontsize=8)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


def reservation_map(rows: Sequence[ReservationRow], max_len: int, title: str) -> Figure:
    """One bar per request: its max-length reservation split into tokens, future tokens and waste."""
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(rows) + 1.4))
    y = list(range(len(rows)))
    tokens = [r.tokens for r in rows]
    future = [r.future for r in rows]
    wasted = [r.wasted for r in rows]
    ax.barh(y, tokens, color=COLORS["tokens"], label="token states")
    ax.barh(y, future, left=tokens, color=COLORS["future"], label="reserved for future tokens")
    ax.barh(
        y,
        wasted,
        left=[t + f for t, f in zip(tokens, future, strict=True)],
        color=COLORS["wasted"],
        alpha=0.75,
        label="never used (internal fragmentation)",
    )
    ax.set_yticks(y, [f"request {i}" for i in y])
    ax.invert_yaxis()
    ax.set_xlim(0, max_len)
    ax.set_xlabel("slots of the request's contiguous reservation")
    ax.set_title(title)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.08), ncol=3, fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


def block_map(
    allocator: BlockAllocator,
    page_tables: Sequence[PageTable],
    block_size: int,
    labels: Sequence[str] | None = None,
    title: str = "",
    columns: int = 8,
) -> Figure:
    """The physical KV cache as a grid of blocks, each split into its ``block_size`` slots.

    A slot holding a token is filled with its sequence's colour; a shared block is hatched and
    shows its reference count; allocated slots not yet written (a last block's unfilled tail) are
    outlined only; free blocks are grey.
    """
    labels = list(labels) if labels is not None else [f"seq {i}" for i in range(len(page_tables))]
    owner: dict[int, int] = {}
    filled: dict[int, int] = {}
    for seq, table in enumerate(page_tables):
        for index, block_id in enumerate(table.block_ids):
            owner.setdefault(block_id, seq)
            in_block = min(block_size, table.num_tokens - index * block_size)
            filled[block_id] = max(filled.get(block_id, 0), in_block)

    rows = -(-allocator.num_blocks // columns)
    fig, ax = plt.subplots(figsize=(1.1 * columns + 0.4, 0.75 * rows + 1.3))
    slot_w, gap = 1.0 / block_size, 0.12
    for block_id in range(allocator.num_blocks):
        x0, y0 = (block_id % columns) * (1 + gap), -(block_id // columns) * (1 + gap)
        refs = allocator.ref_count(block_id)
        for slot in range(block_size):
            if block_id not in owner:
                face, edge, hatch = COLORS["free"], "#cbd5e0", None
            else:
                color = SEQUENCE_COLORS[owner[block_id] % len(SEQUENCE_COLORS)]
                written = slot < filled[block_id]
                face = color if written else "white"
                edge = color if not written else "white"
                hatch = "///" if refs > 1 and written else None
            ax.add_patch(
                Rectangle(
                    (x0 + slot * slot_w, y0),
                    slot_w,
                    1,
                    facecolor=face,
                    edgecolor=edge,
                    hatch=hatch,
                    linewidth=1.0,
                )
            )
        ax.add_patch(Rectangle((x0, y0), 1, 1, fill=False, edgecolor="#4a5568", linewidth=1.2))
        tag = f"{block_id}" + (f" ×{refs}" if refs > 1 else "")
        ax.text(x0 + 0.04, y0 + 1.02, tag, fontsize=7, va="bottom", ha="left", color="#2d3748")
    ax.set_xlim(-0.1, columns * (1 + gap))
    ax.set_ylim(-(rows - 1) * (1 + gap) - 0.1, 1.35)
    ax.set_aspect("equal")
    ax.axis("off")
    handles = [
        Patch(facecolor=SEQUENCE_COLORS[i % len(SEQUENCE_COLORS)], label=label)
        for i, label in enumerate(labels)
    ]
    handles += [
        Patch(facecolor="white", edgecolor="#4a5568", label="allocated, not yet written"),
        Patch(facecolor="#a0aec0", hatch="///", edgecolor="white", label="shared (×ref count)"),
        Patch(facecolor=COLORS["free"], edgecolor="#cbd5e0", label="free block"),
    ]
    ax.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=4, fontsize=8, frameon=False
    )
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


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
    used = -(-seq_len // block_size)
    table = [int(b) for b in block_table_row[:used]]
    num_tiles = -(-seq_len // tile)
    cmap = plt.get_cmap("viridis")
    tile_colors = [cmap(0.15 + 0.7 * t / max(1, num_tiles - 1)) for t in range(num_tiles)]
    gap = 0.18
    width = num_blocks * (1 + gap) - gap
    fig, ax = plt.subplots(figsize=(max(6.0, 0.62 * width + 0.6), 3.4))
    slot_w = 1.0 / block_size

    def draw_block(x0: float, y0: float, positions: Sequence[int | None]) -> None:
        for slot, pos in enumerate(positions):
            face = "white" if pos is None else tile_colors[pos // tile]
            ax.add_patch(
                Rectangle(
                    (x0 + slot * slot_w, y0), slot_w, 1, facecolor=face, edgecolor="white", linewidth=0.8
                )
            )
        ax.add_patch(Rectangle((x0, y0), 1, 1, fill=False, edgecolor="#4a5568", linewidth=1.2))

    y_logical, y_physical = 2.3, 0.0
    logical_x0 = (width - (used * (1 + gap) - gap)) / 2
    for i, block_id in enumerate(table):
        positions = [p if p < seq_len else None for p in range(i * block_size, (i + 1) * block_size)]
        lx = logical_x0 + i * (1 + gap)
        draw_block(lx, y_logical, positions)
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
        ax.text(
            px + 0.5, y_physical - 0.08, str(block_id), ha="center", va="top", fontsize=7, color="#2d3748"
        )
    ax.text(-0.25, y_logical + 0.5, "the sequence\n(block table order)", ha="right", va="center", fontsize=8)
    ax.text(-0.25, y_physical + 0.5, "physical cache\n(block id below)", ha="right", va="center", fontsize=8)
    ax.set_xlim(-0.1, width + 0.1)
    ax.set_ylim(y_physical - 0.5, y_logical + 1.5)
    ax.set_aspect("equal")
    ax.axis("off")
    handles = [
        Patch(facecolor=c, label=f"iteration {t}: positions {t * tile}-{min(seq_len, (t + 1) * tile) - 1}")
        for t, c in enumerate(tile_colors)
    ]
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
    num_tiles = -(-seq_len // tile)
    num_parts = -(-seq_len // partition_size)
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
        part_tiles = -(-(min(seq_len, (s + 1) * partition_size) - s * partition_size) // tile)
        for t in range(part_tiles):
            box(t, y, colors[s])
        labels.append((y + 0.35, f"partition {s}\n(own program)"))
    split_tiles = -(-partition_size // tile) if num_parts > 1 else num_tiles
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


def kernel_bandwidth(rows: Sequence[object], peak: float | None, title: str) -> Figure:
    """Decode-kernel bandwidth (KV bytes read / s) per method against batch size, one panel per context.

    ``rows`` are :class:`paged_attention.benchmarks.kernel.BandwidthRow`; ``peak`` (bytes/s) draws
    the HBM peak as a dashed line when the GPU is known.
    """
    contexts = sorted({r.context for r in rows})
    methods = list(dict.fromkeys(r.method for r in rows))
    fig, axes = plt.subplots(1, len(contexts), figsize=(3.2 * len(contexts), 3.2), sharey=True, squeeze=False)
    for ax, context in zip(axes[0], contexts, strict=True):
        for i, method in enumerate(methods):
            pts = sorted(
                (r.batch, r.kv_bytes / r.seconds / 1e9)
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
    axes[0][0].set_ylabel("KV bytes read / time (GB/s)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"Paged decode bandwidth: {title}", fontsize=10)
    fig.tight_layout()
    return fig
