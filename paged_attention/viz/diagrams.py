"""Diagrams of structures, state machines and processes, drawn from the package's own data: the
sentinel-linked free queue and fork with copy-on-write (notebook 02), and the life of a request in
the scheduler (notebook 04), and the server's two processes (notebook 09).
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from ..engine.sequence import SequenceStatus
from .style import COLORS, SEQUENCE_COLORS

SENTINEL_COLOR = "#cbd5e0"
SHARED_COLOR = "#6b46c1"


def _box(ax, x: float, y: float, text: str, color: str, width: float = 0.8, height: float = 0.5) -> None:
    ax.add_patch(
        FancyBboxPatch(
            (x - width / 2, y - height / 2),
            width,
            height,
            boxstyle="round,pad=0.02",
            facecolor=color,
            edgecolor="#2d3748",
        )
    )
    ax.text(
        x,
        y,
        text,
        ha="center",
        va="center",
        fontsize=9,
        color="white" if color != SENTINEL_COLOR else "black",
    )


def _arrow(ax, start: tuple[float, float], end: tuple[float, float], color: str, rad: float = 0.0) -> None:
    ax.add_patch(
        FancyArrowPatch(
            start,
            end,
            arrowstyle="-|>",
            mutation_scale=10,
            color=color,
            connectionstyle=f"arc3,rad={rad}",
            shrinkA=2,
            shrinkB=2,
        )
    )


def free_queue(states: Sequence[tuple[str, Sequence[int], Sequence[int]]]) -> Figure:
    """One row per state ``(caption, block ids front to back, block ids taken out)``: the head
    sentinel, the blocks, the tail sentinel, ``next_free`` links above (to the right) and
    ``prev_free`` links below (to the left); a block taken out stands apart with both links None."""
    width = max(len(order) + len(out) for _, order, out in states) + 3
    fig, ax = plt.subplots(figsize=(1.15 * width + 1, 1.35 * len(states) + 0.4))
    for row, (caption, order, out) in enumerate(states):
        y = -1.35 * row
        nodes = [("head", SENTINEL_COLOR)] + [(f"block {b}", COLORS["tokens"]) for b in order]
        nodes.append(("tail", SENTINEL_COLOR))
        for i, (label, color) in enumerate(nodes):
            _box(ax, i, y, label, color)
        for i in range(len(nodes) - 1):
            _arrow(ax, (i + 0.3, y + 0.12), (i + 0.7, y + 0.12), "#2f855a", rad=-0.35)
            _arrow(ax, (i + 0.7, y - 0.12), (i + 0.3, y - 0.12), "#c05621", rad=-0.35)
        for j, block in enumerate(out):
            x = len(nodes) + 0.6 + j
            _box(ax, x, y, f"block {block}", COLORS["wasted"])
            ax.text(x, y - 0.42, "links: None", ha="center", va="top", fontsize=7)
        ax.text(-0.5, y + 0.45, caption, ha="left", va="bottom", fontsize=9)
    ax.text(width - 1.4, 0.55, "next_free →", color="#2f855a", fontsize=8, ha="right")
    ax.text(width - 1.4, 0.38, "← prev_free", color="#c05621", fontsize=8, ha="right")
    ax.set_xlim(-0.7, width)
    ax.set_ylim(-1.35 * len(states) + 0.6, 0.9)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.tight_layout()
    return fig


def copy_on_write(
    states: Sequence[tuple[str, dict[str, list[int]], dict[int, int], dict[int, int]]], block_size: int
) -> Figure:
    """One row per state ``(caption, page tables {name: block ids}, tokens written in each block,
    reference count of each block)``: each table's entries on a line of their own, an arrow from each
    entry to the physical block it names, and the blocks below, those held by more than one table
    drawn as shared, each with its filled slots and its reference count."""
    rows = []
    for caption, tables, filled, refs in states:
        blocks = sorted({b for ids in tables.values() for b in ids})
        rows.append((caption, tables, filled, refs, blocks))
    width = (
        max(max(len(r[4]) for r in rows), max(len(ids) for r in rows for ids in r[1].values())) * 1.3 + 1.5
    )
    heights = [1.9 + 0.75 * len(r[1]) for r in rows]
    fig, ax = plt.subplots(figsize=(1.05 * width + 0.6, 0.95 * sum(heights) + 0.3))
    top = 0.0
    for (caption, tables, filled, refs, blocks), height in zip(rows, heights, strict=True):
        where = {b: i * 1.3 for i, b in enumerate(blocks)}
        base = top - height + 0.6
        for b, x in where.items():
            color = SHARED_COLOR if refs.get(b, 0) > 1 else COLORS["tokens"]
            _box(ax, x, base, f"block {b}", color, width=1.0)
            label = f"{filled.get(b, 0)}/{block_size} slots, ref {refs.get(b, 0)}"
            ax.text(x, base - 0.32, label, ha="center", va="top", fontsize=7)
        for k, (name, ids) in enumerate(tables.items()):
            y = base + 1.1 + 0.75 * (len(tables) - 1 - k)
            ax.text(-1.0, y, name, ha="right", va="center", fontsize=9, fontweight="bold")
            shift = (k - (len(tables) - 1) / 2) * 0.6  # tables side by side: no arrow crosses a box
            color = SEQUENCE_COLORS[k % len(SEQUENCE_COLORS)]
            for i, b in enumerate(ids):
                _box(ax, i * 1.3 + shift, y, f"[{i}]", SENTINEL_COLOR, width=0.5, height=0.38)
                _arrow(ax, (i * 1.3 + shift, y - 0.19), (where[b] + shift / 3, base + 0.25), color)
        ax.text(-1.3, top - 0.05, caption, ha="left", va="top", fontsize=9)
        top -= height
    ax.set_xlim(-1.4, width - 0.9)
    ax.set_ylim(top, 0.1)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.tight_layout()
    return fig


# The scheduler's moves (engine/core/scheduler.py): from, to, where the arrow starts and ends (offsets
# from the two boxes' centres), its bend, its label and where the label sits.
TRANSITIONS = (
    (
        "waiting",
        "running",
        (0.7, 0),
        (-0.7, 0),
        0.0,
        "admitted: its prompt's blocks\nleave the watermark free",
        (1.7, 0.12),
        "center",
    ),
    (
        "running",
        "finished",
        (0.7, 0),
        (-0.7, 0),
        0.0,
        "stop token or string,\nmax_tokens",
        (5.1, 0.12),
        "center",
    ),
    (
        "running",
        "preempted",
        (-0.35, -0.32),
        (0.35, 0.32),
        0.0,
        "preempted (recompute):\nits blocks freed",
        (2.65, -1.1),
        "left",
    ),
    (
        "preempted",
        "waiting",
        (-0.35, 0.32),
        (0.35, -0.32),
        0.0,
        "back at the front\nof the waiting queue",
        (0.75, -1.1),
        "right",
    ),
    (
        "running",
        "swapped",
        (0.25, -0.32),
        (-0.45, 0.32),
        0.0,
        "preempted (swap):\nblocks copied to CPU",
        (3.75, -2.0),
        "right",
    ),
    (
        "swapped",
        "running",
        (-0.15, 0.32),
        (0.55, -0.32),
        0.0,
        "swapped back in,\nbefore any admission",
        (4.75, -0.75),
        "left",
    ),
    (
        "waiting",
        "finished",
        (0.2, 0.32),
        (-0.2, 0.32),
        -0.3,
        "aborted (from any state)",
        (3.4, 1.3),
        "center",
    ),
)
POSITIONS = {
    "waiting": (0, 0),
    "running": (3.4, 0),
    "finished": (6.8, 0),
    "preempted": (1.7, -2.2),
    "swapped": (5.1, -2.2),
}


def request_states() -> Figure:
    """The states of a sequence (:class:`SequenceStatus`) and the scheduler's moves between them."""
    states = [s.value for s in SequenceStatus]
    assert set(states) == set(POSITIONS), "a state of SequenceStatus is missing from the diagram"
    fig, ax = plt.subplots(figsize=(9.0, 4.2))
    colors = {
        "waiting": "#dd6b20",
        "running": COLORS["tokens"],
        "finished": "#2f855a",
        "preempted": COLORS["wasted"],
        "swapped": "#6b46c1",
    }
    for state in states:
        x, y = POSITIONS[state]
        _box(ax, x, y, state.upper(), colors[state], width=1.3, height=0.6)
    for start, end, out, into, rad, label, (lx, ly), ha in TRANSITIONS:
        (x0, y0), (x1, y1) = POSITIONS[start], POSITIONS[end]
        _arrow(ax, (x0 + out[0], y0 + out[1]), (x1 + into[0], y1 + into[1]), "#2d3748", rad=rad)
        ax.text(lx, ly, label, ha=ha, va="bottom" if ly >= 0 else "center", fontsize=7.5)
    ax.set_xlim(-1, 7.6)
    ax.set_ylim(-2.7, 1.6)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(
        "The life of a request in the scheduler (the paper's vLLM, v0; v1 has no swapping)", fontsize=10
    )
    fig.tight_layout()
    return fig


def processes(inputs: Sequence[str], outputs: Sequence[str]) -> Figure:
    """The server's two processes and the two sockets between them (notebook 09): ``inputs`` and
    ``outputs`` are the message kinds each socket carries (:data:`~..engine.engine_core.MESSAGES`)."""
    fig, ax = plt.subplots(figsize=(9.6, 4.4))
    front, core = "#2b6cb0", "#2f855a"
    rooms = (
        (0.0, front, "front process (python -m paged_attention serve)", (
            "uvicorn event loop: HTTP, JSON, server-sent events",
            "AsyncLLM: one RequestStream (queue) per request",
            "MPClient: tokenizes prompts, pickles messages",
        ), "vLLM: api_server, AsyncLLM, InputProcessor,\nOutputProcessor (detokenizes), AsyncMPClient"),
        (5.8, core, "engine-core process (EngineCoreProc)", (
            "busy loop: messages, then step(), then outputs",
            "LLMEngine.step: schedule -> execute -> update",
            "scheduler, KV-cache manager, model runner,\nsampler, detokenizer",
        ), "vLLM: EngineCoreProc (socket threads),\nScheduler, executor -> model runner"),
    )  # fmt: skip
    for x, color, title, parts, theirs in rooms:
        ax.add_patch(FancyBboxPatch((x, 0), 4.2, 3.6, boxstyle="round,pad=0.05", facecolor="#f7fafc",
                                    edgecolor=color, linewidth=1.5))  # fmt: skip
        ax.text(x + 2.1, 3.35, title, ha="center", va="center", fontsize=9, weight="bold", color=color)
        for i, part in enumerate(parts):
            _box(ax, x + 2.1, 2.6 - 0.85 * i, part, color, width=3.9, height=0.62)
        ax.text(x + 2.1, -0.45, theirs, ha="center", va="top", fontsize=7.5, style="italic", color="#4a5568")

    def kinds(names: Sequence[str]) -> str:
        return ",\n".join(", ".join(names[i : i + 2]) for i in range(0, len(names), 2))

    _arrow(ax, (4.25, 2.6), (5.75, 2.6), "#2d3748")
    ax.text(5.0, 2.72, "input\n" + kinds(inputs), ha="center", va="bottom", fontsize=7.5)
    _arrow(ax, (5.75, 0.9), (4.25, 0.9), "#2d3748")
    ax.text(5.0, 0.78, "output\n" + kinds(outputs), ha="center", va="top", fontsize=7.5)
    ax.set_xlim(-0.2, 10.2)
    ax.set_ylim(-1.3, 3.9)
    ax.axis("off")
    ax.set_title("One request across two processes: ZeroMQ PUSH/PULL sockets, pickled messages", fontsize=10)
    fig.tight_layout()
    return fig
