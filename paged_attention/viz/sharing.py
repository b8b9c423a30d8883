"""Figures of block sharing: the prefix-cache tree, memory saved by parallel sampling and beam
search (the paper's §6.3 and Figure 15), prefix-caching speedup, and blocks held over time; and the results
of :mod:`paged_attention.experiments.sharing` as figures and tables.

Drawn for notebook 08 (sharing) and ``bench sharing``.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from .style import COLORS, SEQUENCE_COLORS
from .tables import table


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
    paper: dict[str, dict[str, tuple[float, float]]] | None = None,
    title: str = "",
) -> Figure:
    """The paper's §6.3: KV memory saved by sharing (Figure 15 plots Alpaca; §6.3's text gives
    ShareGPT), per trace, for parallel sampling (``n``)
    and beam search (width), in percent. ``savings[trace][mode]`` holds one fraction per width;
    ``paper[trace][mode]`` the range (percent) the paper reports for that trace, drawn as a band in
    the trace's colour (a trace named ``"X-like"`` is labelled by the paper's ``"X"``)."""
    modes = {"parallel": "parallel sampling (n)", "beam": "beam search (beam width)"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    traces = list(savings)
    bar = 0.8 / max(1, len(traces))
    top = 0.0
    for ax, (mode, label) in zip(axes, modes.items(), strict=True):
        for i, trace in enumerate(traces):
            if paper and mode in paper.get(trace, {}):
                low, high = paper[trace][mode]
                color = SEQUENCE_COLORS[i % 10]
                name = trace.removesuffix("-like")
                ax.axhspan(low, high, color=color, alpha=0.16, lw=0, label=f"paper, {name}: {low}-{high}%")
                for edge in (low, high):
                    ax.axhline(edge, color=color, lw=0.8, ls="--", alpha=0.8)
                top = max(top, high)
        for i, trace in enumerate(traces):
            values = [100 * v for v in savings[trace][mode]]
            xs = [j + (i - (len(traces) - 1) / 2) * bar for j in range(len(widths))]
            ax.bar(xs, values, bar, color=SEQUENCE_COLORS[i % 10], label=f"ours, {trace}")
            for x, v in zip(xs, values, strict=True):
                ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
            top = max([top, *values])
        ax.set_xticks(range(len(widths)), [str(w) for w in widths])
        ax.set_xlabel(label)
        ax.spines[["top", "right"]].set_visible(False)
        ax.legend(fontsize=7.5, frameon=False, loc="upper left", ncol=2)
    axes[0].set_ylim(0, 1.45 * top if top else 1.0)
    axes[0].set_ylabel("KV memory saved by sharing (%)")
    fig.suptitle(
        title
        or "Memory saved by sharing blocks: ours, and the paper's (§6.3: Figure 15 Alpaca, text ShareGPT)",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def prefix_caching_speedup(results: dict[str, dict[str, float]], paper: dict[str, float] | None = None,
                           title: str = "") -> Figure:  # fmt: skip
    """Requests per second with prefix caching off and on, per shared prefix (``results[prefix]`` holds
    ``off``/``on`` rates and the ``hit_rate``). ``paper[prefix]``, the paper's speedup for that prefix
    (Figure 16: vLLM vs Orca (Oracle), on a GPU), is written beside ours as text, labelled as such:
    the two ratios compare different things."""
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
        note = f"on / off: {r['on'] / r['off']:.2f}x, hit rate {100 * r['hit_rate']:.0f}%"
        if paper and name in paper:
            note += f"\n(paper, vs Orca (Oracle) on a GPU: {paper[name]}x)"
        ax.text(j, max(r["on"], r["off"]) * 1.12, note, ha="center", va="bottom", fontsize=7.5)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("requests/s on this CPU")
    ax.set_ylim(0, 1.8 * max(max(r["on"], r["off"]) for r in results.values()))
    ax.legend(fontsize=8, frameon=False, loc="upper left")
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_title(
        title or "A shared few-shot prefix, found by hashing, computed once (the paper's Figure 16 workload)",
        fontsize=10,
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


# ---- The results of experiments.sharing (run_memory, run_prefix), as figures and tables ----------

TRACE_NAMES = {"alpaca": "Alpaca-like", "sharegpt": "ShareGPT-like"}


def memory_figure(payload: dict) -> Figure:
    """Our savings per trace (``run_memory``'s payload), each beside the paper's range for the trace
    it imitates (a band)."""
    return sharing_savings(
        payload["setup"]["widths"],
        {TRACE_NAMES.get(t, t): v for t, v in payload["savings"].items()},
        {
            TRACE_NAMES.get(t, t): {mode: (r[0], r[1]) for mode, r in ranges.items()}
            for t, ranges in payload["paper_fig15"].items()
        },
    )


def prefix_figure(payload: dict) -> Figure:
    """Requests per second with prefix caching off and on (``run_prefix``'s payload), per prefix."""
    results = {}
    for name, r in payload["results"].items():
        rates = {key: r[key]["requests_per_s"] for key in ("off", "on")}
        results[f"{name} ({r['prefix_len']} tokens)"] = {**rates, "hit_rate": r["on"]["hit_rate"]}
    paper_speedups = {
        f"{name} ({r['prefix_len']} tokens)": payload["paper_fig16_speedup_vs_orca_oracle"][name]
        for name, r in payload["results"].items()
        if name in payload["paper_fig16_speedup_vs_orca_oracle"]
    }
    return prefix_caching_speedup(results, paper_speedups)


def memory_report_text(payload: dict) -> str:
    """Our savings per trace, mode and width, and the paper's range for that trace and mode."""
    rows = []
    for trace, by_mode in payload["savings"].items():
        for mode, values in by_mode.items():
            low_high = payload["paper_fig15"].get(trace, {}).get(mode)
            paper_range = f"{low_high[0]}-{low_high[1]}%" if low_high else "-"
            rows.append([trace, mode, *[f"{100 * v:.1f}%" for v in values], paper_range])
    header = ["trace", "sharing", *[f"width {w}" for w in payload["setup"]["widths"]], "paper (OPT-13B)"]
    return table(rows, header)


def prefix_report_text(payload: dict) -> str:
    """Per prefix: hit rate, prompt and model tokens, requests/s off and on, batch, same outputs."""
    rows = []
    for name, r in payload["results"].items():
        off, on = r["off"], r["on"]
        rows.append([
            f"{name} ({r['prefix_len']})", f"{100 * on['hit_rate']:.0f}%",
            f"{off['prompt_tokens_computed']} -> {on['prompt_tokens_computed']}",
            f"{off['model_tokens']} -> {on['model_tokens']}", off["requests_per_s"], on["requests_per_s"],
            f"{r['speedup']:.2f}x", f"{off['peak_batch']} -> {on['peak_batch']}",
            "yes" if r["same_outputs"] else "NO",
        ])  # fmt: skip
    header = ["prefix", "hit rate", "prompt tokens computed", "all tokens through the model", "req/s off",
              "req/s on", "speedup", "largest batch", "same tokens"]  # fmt: skip
    return table(rows, header)
