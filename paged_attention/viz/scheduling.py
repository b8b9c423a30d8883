"""Figures of scheduling and batching: static against continuous batching, the scheduler's state
step by step, and the engine's steps.

Drawn for notebooks 04 (the scheduler) and 05 (the engine).
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from .style import COLORS, SEQUENCE_COLORS
from .tables import plural


def engine_timeline(
    steps: Sequence[object], max_num_batched_tokens: int | None = None, title: str = ""
) -> Figure:
    """Continuous batching step by step: sequences running and waiting, KV-cache use, tokens per step.

    ``steps`` holds one :class:`~paged_attention.engine.outputs.StepStats` per ``LLMEngine.step()``
    (anything with ``num_running``, ``num_waiting``, ``num_swapped``, ``num_scheduled_tokens``,
    ``num_preempted`` and ``kv_usage``). Steps that preempted a sequence get a red line in every panel.
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

    ``steps`` are :class:`paged_attention.experiments.replay.StepRecord` (``num_running``, ``num_waiting``,
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
            watermark_blocks,
            color="#276749",
            ls="--",
            lw=1,
            label=f"watermark ({plural(watermark_blocks, 'block')})",
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
