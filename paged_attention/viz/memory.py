"""Figures of KV-cache memory: bytes per token, memory against context, reservation maps, block
maps and whole-arena maps.

Drawn for notebooks 01 (the KV cache), 02 (allocator and page table), 06 (fragmentation) and 08
(sharing).
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from .._checks import cdiv
from ..memory.accounting import ReservationRow
from ..memory.allocator import BlockAllocator
from ..memory.page_table import PageTable, written_slots
from .style import ARENA_COLORS, COLORS, FIG2_COLORS, SEQUENCE_COLORS, GiB


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
    kv_budget_bytes: int,
    gpu_bytes: int,
    batch_sizes: Sequence[int],
    max_context: int,
    model_name: str,
    gpu_name: str,
) -> Figure:
    """The GPU's memory split into weights, KV-cache budget and the rest, up to the whole GPU, and
    over it the memory a batch needs: the weights plus ``batch`` requests' KV cache, against the
    tokens per request. A batch fits while its line stays inside the KV budget; the legend gives the
    longest requests (at most ``max_context``) that each batch size fits.
    """
    if weights_bytes + kv_budget_bytes > gpu_bytes:
        raise ValueError(
            f"weights ({weights_bytes / GiB:.1f} GiB) + KV budget ({kv_budget_bytes / GiB:.1f} GiB) "
            f"exceed the GPU ({gpu_bytes / GiB:.1f} GiB)"
        )
    fig, ax = plt.subplots(figsize=(8.6, 4))
    weights, budget, gpu = weights_bytes / GiB, kv_budget_bytes / GiB, gpu_bytes / GiB
    ax.axhspan(0, weights, color=COLORS["weights"], alpha=0.35, lw=0, label=f"weights ({weights:g} GiB)")
    ax.axhspan(weights, weights + budget, color=COLORS["future"], alpha=0.45, lw=0,
               label=f"KV-cache budget ({budget:g} GiB)")  # fmt: skip
    ax.axhspan(weights + budget, gpu, color=FIG2_COLORS[3], alpha=0.35, lw=0,
               label=f"the rest, for activations ({gpu - weights - budget:g} GiB)")  # fmt: skip
    ax.axhline(gpu, color="black", lw=1.2, label=f"the whole GPU ({gpu:g} GiB)")
    contexts = list(range(0, max_context + 1, max(1, max_context // 128)))
    for i, batch in enumerate(batch_sizes):
        fits = min(max_context, kv_budget_bytes // (batch * bytes_per_token))
        ax.plot(
            contexts,
            [weights + batch * c * bytes_per_token / GiB for c in contexts],
            label=f"batch {batch}: fits up to {fits:,} tokens each",
            color=plt.get_cmap("Blues")(0.45 + 0.55 * i / max(1, len(batch_sizes) - 1)),
            lw=2,
        )
    ax.set_xlabel("tokens per request (prompt + output)")
    ax.set_ylabel("GPU memory (GiB)")
    ax.set_ylim(0, gpu * 1.3)
    ax.set_xlim(0, max_context)
    ax.set_title(f"{model_name} on {gpu_name}: weights + the KV cache of a batch")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


def reservation_map(
    rows: Sequence[ReservationRow],
    max_len: int,
    title: str,
    finished: Sequence[bool] | None = None,
) -> Figure:
    """One bar per request: its max-length reservation split into tokens, future tokens and waste.

    A request marked in ``finished`` has released its range: its bar is drawn empty and hatched.
    """
    finished = list(finished) if finished is not None else [False] * len(rows)
    if len(finished) != len(rows):
        raise ValueError(f"finished has {len(finished)} entries for {len(rows)} rows")
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(rows) + 1.4))
    live = [(i, r) for i, r in enumerate(rows) if not finished[i]]
    y = [i for i, _ in live]
    tokens = [r.tokens for _, r in live]
    future = [r.future for _, r in live]
    wasted = [r.wasted for _, r in live]
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
    done = [i for i, f in enumerate(finished) if f]
    if done:
        ax.barh(done, [max_len] * len(done), color="white", edgecolor="#a0aec0", hatch="..",
                label="finished: range released")  # fmt: skip
    ticks = [f"request {i}" + (" (finished)" if f else "") for i, f in enumerate(finished)]
    ax.set_yticks(range(len(rows)), ticks)
    ax.invert_yaxis()
    ax.set_xlim(0, max_len)
    ax.set_xlabel("slots of the request's contiguous reservation")
    ax.set_title(title)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.08), ncol=2, fontsize=8, frameon=False)
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
    for seq, table in enumerate(page_tables):
        for block_id in table.block_ids:
            owner.setdefault(block_id, seq)
    filled = written_slots(page_tables)

    rows = cdiv(allocator.num_blocks, columns)
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


def arena_map(panels: dict[str, Sequence[tuple[int, int, str]]], num_slots: int, title: str = "") -> Figure:
    """Snapshots of whole KV caches, one strip each, slot 0 on the left: what is where.

    Each panel is a list of ``(start, length, category)`` pieces (``ContiguousKVCacheManager.segments``
    or :func:`paged_attention.viz.memory_map.paged_segments`); anything not covered is free.
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
