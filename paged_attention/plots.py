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


def engine_timeline(
    steps: Sequence[object], max_num_batched_tokens: int | None = None, title: str = ""
) -> Figure:
    """Continuous batching step by step: sequences running and waiting, KV-cache use, tokens per step.

    ``steps`` holds one :class:`paged_attention.engine.StepStats` per ``LLMEngine.step()`` (anything
    with ``num_running``, ``num_waiting``, ``num_swapped``, ``num_scheduled_tokens``, ``num_preempted``
    and ``kv_usage``). Steps that preempted a sequence get a red line in every panel.
    ``max_num_batched_tokens`` draws the per-step token budget.
    """
    x = list(range(1, len(steps) + 1))
    fig, axes = plt.subplots(
        3, 1, figsize=(7.2, 6.2), sharex=True, gridspec_kw={"height_ratios": [1.6, 1.0, 1.0]}
    )
    seqs, kv, tokens = axes
    running = [s.num_running for s in steps]
    seqs.fill_between(x, running, step="mid", color=COLORS["tokens"], alpha=0.85, label="running")
    seqs.step(x, [s.num_waiting for s in steps], where="mid", color="#dd6b20", label="waiting")
    if any(s.num_swapped for s in steps):
        seqs.step(x, [s.num_swapped for s in steps], where="mid", color="#805ad5", label="swapped to CPU")
    seqs.set_ylabel("sequences")
    kv.fill_between(x, [100 * s.kv_usage for s in steps], step="mid", color=COLORS["future"])
    kv.axhline(100, color=COLORS["weights"], lw=0.8, ls=":")
    kv.set_ylim(0, 105)
    kv.set_ylabel("KV blocks\nin use (%)")
    tokens.bar(x, [s.num_scheduled_tokens for s in steps], width=1.0, color=COLORS["weights"])
    if max_num_batched_tokens:
        tokens.axhline(max_num_batched_tokens, color=COLORS["weights"], lw=0.8, ls="--")
        tokens.text(
            x[-1] if x else 1, max_num_batched_tokens, "token budget", ha="right", va="bottom", fontsize=7
        )
    tokens.set_ylabel("tokens\nscheduled")
    tokens.set_xlabel("engine step")
    preempted = [i for i, s in zip(x, steps, strict=True) if s.num_preempted]
    for ax in axes:
        for step in preempted:
            ax.axvline(step, color=COLORS["wasted"], lw=0.8, alpha=0.7, zorder=0)
        ax.spines[["top", "right"]].set_visible(False)
        ax.set_xlim(0.5, len(steps) + 0.5)
    handles, labels = seqs.get_legend_handles_labels()
    if preempted:
        handles.append(plt.Line2D([], [], color=COLORS["wasted"], lw=0.8))
        labels.append("a preemption")
    seqs.legend(handles, labels, loc="upper right", fontsize=8, ncol=len(labels), frameon=False)
    seqs.set_ylim(0, max([*running, *(s.num_waiting + s.num_swapped for s in steps), 1]) * 1.3)
    total = sum(s.num_preempted for s in steps)
    seqs.set_title(title or f"{len(steps)} engine steps, {total} preemptions", fontsize=10)
    fig.tight_layout()
    return fig


IDLE_SLOT = {"facecolor": "white", "edgecolor": "#a0aec0", "hatch": "///"}


def batching_gantt(
    panels: dict[str, Sequence[tuple[int, int, int]]],
    title: str = "",
) -> Figure:
    """Static against continuous batching, one row per request, one panel per policy.

    Each request is ``(start, done, released)`` in steps: it waits from step 0 to ``start``, produces
    tokens from ``start`` to ``done``, and keeps its batch slot, idle, until ``released`` (the end of
    its static batch; equal to ``done`` under continuous batching).
    """
    names = list(panels)
    num_requests = max(len(spans) for spans in panels.values())
    end = max(released for spans in panels.values() for _, _, released in spans)
    fig, axes = plt.subplots(
        len(names), 1, figsize=(7.2, 0.26 * num_requests * len(names) + 1.6), sharex=True, squeeze=False
    )
    for ax, name in zip(axes[:, 0], names, strict=True):
        spans = panels[name]
        for i, (start, done, released) in enumerate(spans):
            color = SEQUENCE_COLORS[i % len(SEQUENCE_COLORS)]
            ax.barh(i, start, color=COLORS["free"], height=0.7)
            ax.barh(i, done - start, left=start, color=color, height=0.7)
            if released > done:
                ax.barh(i, released - done, left=done, height=0.7, **IDLE_SLOT)
        last = max(released for _, _, released in spans)
        ax.axvline(last, color="#2d3748", lw=1, ls=":")
        ax.text(last, -0.9, f" all done: step {last}", fontsize=8, va="center", color="#2d3748")
        ax.set_yticks(range(len(spans)), [f"req {i}" for i in range(len(spans))], fontsize=7)
        ax.set_ylim(len(spans) - 0.4, -1.4)
        ax.set_title(name, fontsize=9, loc="left")
        ax.spines[["top", "right"]].set_visible(False)
    axes[-1, 0].set_xlim(0, end * 1.12)
    axes[-1, 0].set_xlabel("step (one forward pass of the whole batch)")
    handles = [
        Patch(facecolor=COLORS["free"], label="waiting for a batch slot"),
        Patch(facecolor=SEQUENCE_COLORS[0], label="generating"),
        Patch(**IDLE_SLOT, label="done, slot idle until the batch ends"),
    ]
    axes[0, 0].legend(
        handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.12), ncol=3, fontsize=8, frameon=False
    )
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def scheduler_timeline(
    steps: Sequence[object],
    num_blocks: int,
    watermark_blocks: int = 0,
    max_num_batched_tokens: int | None = None,
    title: str = "",
) -> Figure:
    """The scheduler's state after every step of a trace, with preemptions marked.

    ``steps`` are :class:`paged_attention.simulate.StepRecord` (``num_running``, ``num_waiting``,
    ``num_swapped``, ``free_blocks``, ``num_scheduled_tokens``, ``num_preempted``). Top: sequences
    running, waiting and swapped out. Middle: free KV blocks, with the admission watermark. Bottom:
    tokens computed per step against the token budget. A red tick marks every step that preempted.
    """
    from matplotlib.ticker import MaxNLocator

    x = [s.step for s in steps]
    preempt_steps = [s.step for s in steps if s.num_preempted]
    fig, (ax_q, ax_m, ax_t) = plt.subplots(
        3, 1, figsize=(8, 6.4), sharex=True, gridspec_kw={"height_ratios": [3, 2.2, 1.4]}
    )
    ax_q.step(x, [s.num_running for s in steps], where="post", color=COLORS["tokens"], label="running")
    ax_q.step(x, [s.num_waiting for s in steps], where="post", color="#dd6b20", label="waiting")
    swapped = [s.num_swapped for s in steps]
    if any(swapped):
        ax_q.step(x, swapped, where="post", color="#805ad5", label="swapped to CPU")
    ax_q.set_ylabel("sequences")
    ax_q.yaxis.set_major_locator(MaxNLocator(integer=True))
    free = [s.free_blocks for s in steps]
    ax_m.fill_between(x, free, step="post", color="#9ae6b4", lw=0)
    ax_m.step(x, free, where="post", color="#38a169", lw=0.8, label="free blocks")
    ax_m.set_ylim(0, num_blocks * 1.05)
    if watermark_blocks:
        ax_m.axhline(
            watermark_blocks, color="#276749", ls="--", lw=1, label=f"watermark ({watermark_blocks} blocks)"
        )
    ax_m.set_ylabel(f"free blocks\n(of {num_blocks})")
    ax_t.bar(x, [s.num_scheduled_tokens for s in steps], width=1.0, color="#a0aec0", label="tokens this step")
    if max_num_batched_tokens:
        ax_t.axhline(max_num_batched_tokens, color="#2d3748", ls="--", lw=1, label="token budget")
    ax_t.set_ylabel("tokens")
    ax_t.set_xlabel("step")
    for ax in (ax_q, ax_m, ax_t):
        for step in preempt_steps:
            ax.axvline(step, color="#e53e3e", lw=0.6, alpha=0.35, zorder=0)
        ax.spines[["top", "right"]].set_visible(False)
    ax_m.plot(
        preempt_steps, [num_blocks * 1.02] * len(preempt_steps), "v", color="#e53e3e", ms=4,
        label=f"preemption ({len(preempt_steps)} steps)",
    )  # fmt: skip
    for ax in (ax_q, ax_m, ax_t):
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    if x:
        ax_t.set_xlim(x[0] - 0.5, x[-1] + 0.5)
    ax_q.set_title(title or "Continuous batching, step by step", fontsize=10)
    fig.tight_layout()
    return fig


FIG2_COLORS = ("#2b6cb0", "#90cdf4", "#e53e3e", "#f6ad55")  # tokens, reserved, internal, external + free


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


ARENA_COLORS = {"tokens": FIG2_COLORS[0], "reserved": FIG2_COLORS[1], "internal": FIG2_COLORS[2],
                "rounding": FIG2_COLORS[3]}  # fmt: skip


def arena_map(panels: dict[str, Sequence[tuple[int, int, str]]], num_slots: int, title: str = "") -> Figure:
    """Snapshots of whole KV caches, one strip each, slot 0 on the left: what is where.

    Each panel is a list of ``(start, length, category)`` pieces (``ContiguousKVCacheManager.segments``
    or :func:`paged_attention.memory_map.paged_segments`); anything not covered is free.
    """
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 0.75 * len(panels) + 1.2), squeeze=False)
    for ax, (name, pieces) in zip(axes[:, 0], panels.items(), strict=True):
        ax.add_patch(Rectangle((0, 0), num_slots, 1, color=COLORS["free"], lw=0))
        for start, length, category in pieces:
            ax.add_patch(Rectangle((start, 0), length, 1, color=ARENA_COLORS[category], lw=0))
        ax.set_xlim(0, num_slots)
        ax.set_ylim(0, 1)
        ax.set_yticks([])
        ax.set_ylabel(name, rotation=0, ha="right", va="center", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        ax.spines[["top", "right", "left"]].set_visible(False)
    axes[-1, 0].set_xlabel("slot address in the KV cache")
    labels = {"tokens": "token states", "reserved": "reserved for future tokens",
              "internal": "internal fragmentation", "rounding": "buddy rounding (external)"}  # fmt: skip
    handles = [Patch(facecolor=ARENA_COLORS[k], label=v) for k, v in labels.items()]
    handles.append(Patch(facecolor=COLORS["free"], label="free"))
    axes[0, 0].legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.15), ncol=5, fontsize=7,
                      frameon=False)  # fmt: skip
    if title:
        fig.suptitle(title, fontsize=10, y=1.02)
    fig.tight_layout()
    return fig


# -- sharing (notebook 08, bench sharing) ---------------------------------------------------------
def prefix_tree(
    chains: dict[str, Sequence[bytes]],
    block_of: dict[bytes, int],
    status: dict[bytes, str],
    ref_counts: dict[bytes, int] | None = None,
    title: str = "",
) -> Figure:
    """The prefix cache as a tree of blocks: each request is a path from the root, one node per full
    block; requests with a common beginning share the first nodes of their paths.

    ``chains[label]`` is a request's block-hash chain, ``block_of[hash]`` the physical block that
    holds it, ``status[hash]`` one of ``"in use"``, ``"cached, free"`` (freed but still findable)
    or ``"evicted"``; ``ref_counts[hash]`` the owners of a block in use.
    """
    colors = {"in use": COLORS["tokens"], "cached, free": "#9ae6b4", "evicted": "#e2e8f0"}
    parent: dict[bytes, bytes | None] = {}
    children: dict[bytes | None, list[bytes]] = {}
    ends: dict[bytes, list[str]] = {}
    for label, chain in chains.items():
        previous: bytes | None = None
        for h in chain:
            if h not in parent:
                parent[h] = previous
                children.setdefault(previous, []).append(h)
            previous = h
        if previous is not None:
            ends.setdefault(previous, []).append(label)
    # Leaves get consecutive rows; an inner node sits at the mean row of its children.
    row: dict[bytes, float] = {}
    depth: dict[bytes, int] = {}
    next_row = [0]

    def place(node: bytes, d: int) -> None:
        depth[node] = d
        kids = children.get(node, [])
        for kid in kids:
            place(kid, d + 1)
        if kids:
            row[node] = sum(row[k] for k in kids) / len(kids)
        else:
            row[node] = next_row[0]
            next_row[0] += 1

    for root in children.get(None, []):
        place(root, 0)
    width = max(depth.values(), default=0) + 1
    fig, ax = plt.subplots(figsize=(1.25 * width + 2.6, 0.62 * max(next_row[0], 1) + 1.2))
    for node, up in parent.items():
        if up is not None:
            ax.plot(
                [depth[up] + 0.4, depth[node] - 0.4], [-row[up], -row[node]], color="#a0aec0", lw=1, zorder=1
            )
    for node in parent:
        x, y = depth[node], -row[node]
        state = status.get(node, "evicted")
        ax.add_patch(Rectangle((x - 0.4, y - 0.22), 0.8, 0.44, facecolor=colors[state], edgecolor="#4a5568",
                               lw=1, zorder=2))  # fmt: skip
        refs = (ref_counts or {}).get(node, 0)
        text = f"blk {block_of[node]}" + (f" ×{refs}" if refs > 1 else "") if node in block_of else "—"
        ax.text(x, y, text, ha="center", va="center", fontsize=7, zorder=3,
                color="white" if state == "in use" else "#1a202c")  # fmt: skip
    for node, labels in ends.items():
        if children.get(node):  # a request that others continue: its name goes under its last block
            ax.text(depth[node], -row[node] - 0.27, ", ".join(labels), ha="center", va="top", fontsize=7,
                    color="#2d3748")  # fmt: skip
        else:
            ax.text(
                depth[node] + 0.5, -row[node], ", ".join(labels), va="center", fontsize=8, color="#2d3748"
            )
    ax.set_xlim(-0.6, width + 1.6)
    ax.set_ylim(-next_row[0] + 0.3, 0.6)
    ax.set_xticks(range(width), [f"block {i}" for i in range(width)], fontsize=7)
    ax.set_yticks([])
    ax.spines[["top", "right", "left"]].set_visible(False)
    handles = [Patch(facecolor=c, edgecolor="#4a5568", label=s) for s, c in colors.items()]
    ax.legend(
        handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, fontsize=8, frameon=False
    )
    ax.set_xlabel(
        "logical block of the prompt (each node: one full block, named by its hash chain)", fontsize=8
    )
    if title:
        ax.set_title(title, fontsize=10, pad=24)
    fig.tight_layout()
    return fig


def sharing_savings(
    widths: Sequence[int],
    savings: dict[str, dict[str, Sequence[float]]],
    paper: dict[str, tuple[float, float]] | None = None,
    title: str = "",
) -> Figure:
    """The paper's Figure 15: KV memory saved by sharing, per trace, for parallel sampling (``n``)
    and beam search (width), in percent. ``savings[trace][mode]`` holds one fraction per width;
    ``paper[mode]`` the range the paper reports (drawn as a band)."""
    modes = {"parallel": "parallel sampling (n)", "beam": "beam search (beam width)"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    traces = list(savings)
    bar = 0.8 / max(1, len(traces))
    for ax, (mode, label) in zip(axes, modes.items(), strict=True):
        if paper and mode in paper:
            low, high = paper[mode]
            ax.axhspan(low, high, color="#fbd38d", alpha=0.45, lw=0, label=f"paper, Alpaca: {low}-{high}%")
        for i, trace in enumerate(traces):
            values = [100 * v for v in savings[trace][mode]]
            xs = [j + (i - (len(traces) - 1) / 2) * bar for j in range(len(widths))]
            ax.bar(xs, values, bar, color=SEQUENCE_COLORS[i % 10], label=trace)
            for x, v in zip(xs, values, strict=True):
                ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(widths)), [str(w) for w in widths])
        ax.set_xlabel(label)
        ax.spines[["top", "right"]].set_visible(False)
        ax.legend(fontsize=8, frameon=False, loc="upper left")
    axes[0].set_ylabel("KV memory saved by sharing (%)")
    fig.suptitle(title or "Memory saved by sharing blocks (the paper's Figure 15)", fontsize=10)
    fig.tight_layout()
    return fig


def prefix_caching_speedup(results: dict[str, dict[str, float]], paper: dict[str, float] | None = None,
                           title: str = "") -> Figure:  # fmt: skip
    """Requests per second with prefix caching off and on, per shared prefix (``results[prefix]`` holds
    ``off``/``on`` rates and the ``hit_rate``); the paper's speedups (vs Orca Oracle) as text."""
    fig, ax = plt.subplots(figsize=(6.2, 3.6))
    names = list(results)
    for j, name in enumerate(names):
        r = results[name]
        for i, key in enumerate(("off", "on")):
            x = j + (i - 0.5) * 0.36
            ax.bar(
                x, r[key], 0.36, color=SEQUENCE_COLORS[i], label=f"prefix caching {key}" if j == 0 else None
            )
            ax.text(x, r[key], f"{r[key]:.1f}", ha="center", va="bottom", fontsize=7)
        note = f"{r['on'] / r['off']:.2f}x, hit rate {100 * r['hit_rate']:.0f}%"
        if paper and name in paper:
            note += f"\n(paper: {paper[name]}x)"
        ax.text(j, max(r["on"], r["off"]) * 1.12, note, ha="center", va="bottom", fontsize=7.5)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("requests/s on this CPU")
    ax.set_ylim(0, 1.8 * max(max(r["on"], r["off"]) for r in results.values()))
    ax.legend(fontsize=8, frameon=False, loc="upper left")
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_title(
        title or "A shared few-shot prefix, computed once (the paper's Figure 17 setup)", fontsize=10
    )
    fig.tight_layout()
    return fig


def sharing_over_time(
    used_blocks: Sequence[int], unshared_blocks: Sequence[int], title: str = "", label: str = "step"
) -> Figure:
    """Blocks held at each step, and how many the same page tables would hold without sharing."""
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    steps = range(len(used_blocks))
    ax.fill_between(
        steps, used_blocks, unshared_blocks, color="#fbd38d", alpha=0.6, lw=0, label="saved by sharing"
    )
    ax.plot(steps, unshared_blocks, color="#c05621", lw=1.2, label="without sharing")
    ax.plot(steps, used_blocks, color=COLORS["tokens"], lw=1.5, label="blocks in use")
    ax.set_xlabel(label)
    ax.set_ylabel("KV blocks")
    ax.set_ylim(0, None)
    ax.legend(fontsize=8, frameon=False, loc="upper left")
    ax.spines[["top", "right"]].set_visible(False)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
