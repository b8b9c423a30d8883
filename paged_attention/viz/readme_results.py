"""README blocks of the measured and replayed results, each from the JSON its command wrote.

One function per block, ``block(folder) -> markdown``; :mod:`.readme` lists them and rewrites the
README between their markers. A block names its command, and where it was measured: the machine,
the torch thread count and the date (replayed results are deterministic and say so).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..experiments import paper
from ..experiments.dtypes import floor_seconds, roof_seconds
from ..experiments.paper import LABELS
from ..experiments.throughput import step_time_by_batch
from .style import figures_dir
from .tables import plural

TRACE_NAMES = {"sharegpt": "ShareGPT", "alpaca": "Alpaca"}
#: the demo's table rows: (label, key of a run's numbers, format); the demo prints them, the README block too
DEMO_ROWS = (
    ("requests running at once (peak)", "peak_running", "{:.0f}"),
    ("requests running at once (mean)", "mean_running", "{:.1f}"),
    ("output tokens/s", "tokens_per_second", "{:.1f}"),
    ("wall time, s", "seconds", "{:.1f}"),
    ("KV memory holding token states", "token_share", "{:.0%}"),
    ("preemptions", "preemptions", "{:d}"),
    ("engine steps", "steps", "{:d}"),
)


def load(name: str, folder: Path | None = None) -> dict:
    """``figures/<name>.json`` (or ``folder``'s)."""
    return json.loads(((folder or figures_dir()) / f"{name}.json").read_text())


def where(r: dict) -> str:
    """``"<machine>, <date>, <n> torch thread(s)"`` of a measured run."""
    threads = r.get("threads", r.get("setup", {}).get("torch_threads"))
    said = f", {threads} torch thread{'s' * (threads != 1)}" if threads is not None else ""
    return f"{r.get('machine', 'machine not recorded')}, {r.get('date', 'date not recorded')}{said}"


def demo_block(folder: Path | None = None) -> str:
    """``python -m paged_attention demo``: its table, as the command printed it."""
    r = load("demo", folder)
    runs = r["runs"]
    rows = DEMO_ROWS
    lines = [
        f"`python -m paged_attention demo` ({where(r)}; model loaded in {r['load_seconds']:.1f} s; "
        f"dtype: {r['dtype']}; batch-invariant: {'on' if r.get('batch_invariant') else 'off'}):",
        "",
        "```",
        f"{'':34}{'contiguous':>12}{'paged':>10}",
    ]
    for name, key, fmt in rows:
        lines.append(
            f"{name:34}{fmt.format(runs['contiguous'][key]):>12}{fmt.format(runs['paged'][key]):>10}"
        )
    lines += [
        f"{'identical outputs':34}{str(r['identical']) + '/' + str(r['num_requests']):>22}",
        *(
            [
                f"  (in {r['dtype'].split(' ')[0]} a step's sums round differently when the batch",
                "   differs, so a near-tie between two tokens can flip; batch-invariant runs are identical)",
            ]
            if r["identical"] < r["num_requests"]
            and not r.get("batch_invariant")
            and r["dtype"].startswith(("bfloat16", "float16"))
            else []
        ),
        "",
        f"paged: {r['speedup']:.2f}x the throughput in the same KV memory; every block free again: "
        f"{runs['paged']['all_free'] and runs['contiguous']['all_free']}",
    ]
    for answer in r["answers"][:1]:
        lines += ["", f"> {answer['question']}", f"  {answer['text']}  [{answer['finish_reason']}]"]
    return "\n".join([*lines, "```"]) + "\n"


def batch_invariant_block(folder: Path | None = None) -> str:
    """``bench batch-invariant``: the demo's workload with the mode off and on, side by side."""
    r = load("batch_invariant", folder)
    lines = [
        f"`python -m paged_attention bench batch-invariant` ({where(r)}; {r['model']}, dtype: "
        f"{r['dtype'].split(' ')[0]}; the demo's {r['num_requests']} prompts, up to {r['max_tokens']} "
        f"tokens, {len(r['runs']['off'])} alternating runs per mode, the best one shown):",
        "",
        "| batch-invariant | contiguous tokens/s | paged tokens/s | identical outputs (the two engines) |",
        "|---|---|---|---|",
    ]
    for mode in ("off", "on"):
        same = sorted({row["identical"] for row in r["runs"][mode]})
        lines.append(
            f"| {mode} | {r['best'][mode]['contiguous']:.1f} | {r['best'][mode]['paged']:.1f} | "
            f"{' or '.join(map(str, same))}/{r['num_requests']} |"
        )
    cost = r["cost"]
    lines += [
        "",
        f"The mode's throughput, on / off: contiguous {cost['contiguous']:.2f}x, paged {cost['paged']:.2f}x.",
    ]
    return "\n".join(lines) + "\n"


def dtypes_block(folder: Path | None = None) -> str:
    """float32 against bfloat16 on this CPU: ``bench engine --dtype float32 bfloat16``'s table."""
    r = load("dtypes", folder)
    names = list(dict.fromkeys(row["dtype"] for row in r["rows"]))
    base = {row["batch"]: row["tokens_per_s"] for row in r["rows"] if row["dtype"] == names[0]}
    read, copy = r["bandwidth"]["read"] / 1e9, r["bandwidth"]["copy"] / 1e9
    lines = [
        f"`python -m paged_attention bench engine --model {r['model']} --dtype {' '.join(names)}` "
        f"({where(r)}): "
        f"sequences decoding at once, the median of {r['steps']} steps; the weight-read bound is the "
        f"weights' bytes over this core's read bandwidth, measured in the same run ({read:.1f} GB/s "
        f"reading, {copy:.1f} GB/s copying); arithmetic: the step's multiply-adds at the rate of one "
        f"large product of the dtype, the same run; the roof is the larger of those two bounds; "
        f"products: the step's matrix products alone, each layer timed as the engine multiplies; the "
        f"floor is the larger of the weight-read bound and the products:",
        "",
        f"| dtype | sequences | ms per step | tokens/s | vs {names[0]} | bound, ms | arithmetic, ms | "
        f"products, ms | step/bound | step/roof | step/floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        products = f"{row['products_s'] * 1e3:.1f}" if "products_s" in row else "-"
        arithmetic = f"{row['arithmetic_s'] * 1e3:.1f}" if "arithmetic_s" in row else "-"
        lines.append(
            f"| {row['dtype']} | {row['batch']} | {row['step_s'] * 1e3:.1f} | {row['tokens_per_s']:.1f} | "
            f"**{row['tokens_per_s'] / base[row['batch']]:.2f}x** | {row['bound_s'] * 1e3:.1f} | "
            f"{arithmetic} | {products} | {row['step_s'] / row['bound_s']:.2f}x | "
            f"{row['step_s'] / roof_seconds(row):.2f}x | {row['step_s'] / floor_seconds(row):.2f}x |"
        )
    agreement = "; ".join(
        f"{name} {a['identical']}/{a['prompts']}" for name, a in r["agreement"].items() if name != names[0]
    )
    lines += [
        "",
        f"Greedy answers ({r['max_tokens']} tokens, all prompts in one batch) token for token those of "
        f'{names[0]}: {agreement}. `dtype="auto"` there: {r["auto"]}.',
    ]
    return "\n".join(lines) + "\n"


def allocator_block(folder: Path | None = None) -> str:
    """``bench allocator``: pairs per second by allocator size and workload."""
    r = load("allocator", folder)
    names = {
        "ordered": "in order",
        "scrambled": "shuffled (after hours of serving)",
        "mixed": "fork-heavy mix",
    }
    lines = [
        f"`python -m paged_attention bench allocator` (pure Python; {where(r)}; best of {r['repeats']} "
        f"runs of {r['pairs']:,} pairs):",
        "",
        "| blocks | workload | allocate+free pairs/s | ns per pair |",
        "|---|---|---|---|",
    ]
    for row in r["results"]:
        lines.append(
            f"| {row['num_blocks']:,} | {names.get(row['workload'], row['workload'])} | "
            f"{row['pairs_per_second'] / 1e6:.2f} M | {row['ns_per_pair']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _engine_table(r: dict) -> list[str]:
    names = {
        "paged-engine": "paged engine (this package)",
        "hf-static": f"transformers `generate`, padded static batches of {r['batch_size']}",
        "hf-continuous": "transformers continuous batching (`generate_batch`'s manager)",
    }
    lines = ["| method | useful output tokens/s | paged engine is | same tokens |", "|---|---|---|---|"]
    for name in sorted(r["methods"], key=lambda n: list(names).index(n) if n in names else len(names)):
        m = r["methods"][name]
        faster = "1.00x" if name == "paged-engine" else f"{m['paged_faster']:.2f}x faster"
        same = f"{m['same_tokens']}/{r['requests']}"
        lines.append(f"| {names.get(name, name)} | {m['tokens_per_s']:,.0f} | {faster} | {same} |")
    p = r["paged"]
    lines += [
        "",
        f"The paged engine ran up to {p['peak_batch']} sequences per step in that memory "
        f"({p['preemptions']} preemptions). Over its {p['overhead_steps']} steps with at least "
        f"{p['busy_batch']} sequences, {p['outside_forward']:.1%} of the step time was outside the model's "
        f"forward pass (sampling and outputs included), of which bookkeeping {p['overhead']:.1%}: "
        f"scheduler and allocator {p['schedule_share']:.1%}, batch packing "
        f"{p['overhead'] - p['schedule_share']:.1%}.",
    ]
    return lines


def engine_block(folder: Path | None = None) -> str:
    """``bench engine`` on the embedded model: our engine against transformers' loops."""
    r = load("engine", folder)
    head = (
        f"`python -m paged_attention bench engine` ({where(r)}; {r['dtype']}): the embedded tiny Llama, "
        f"{r['requests']} requests with prompts of {r['prompt_lens'][0]}-{r['prompt_lens'][1]} and "
        f"outputs of {r['output_lens'][0]}-{r['output_lens'][1]} tokens, EOS ignored, best of "
        f"{r['repeats']} interleaved runs; the paged engine gets exactly the {r['kv_slots']:,} KV slots "
        f"one padded static batch of {r['batch_size']} holds:"
    )
    return "\n".join([head, "", *_engine_table(r)]) + "\n"


def engine_real_block(folder: Path | None = None) -> str:
    """``bench engine --model smollm2``: the same comparison on the real model."""
    r = load("engine_smollm2", folder)
    head = (
        f"`python -m paged_attention bench engine --model smollm2 --requests {r['requests']} "
        "--dtype float32` "
        f"({where(r)}): SmolLM2-135M-Instruct in {r['dtype'].split(' ')[0]}, {r['requests']} requests with "
        f"prompts and outputs of {r['prompt_lens'][0]}-{r['prompt_lens'][1]} tokens "
        f"({r['useful_tokens']:,} output tokens), EOS ignored, {r['repeats']} run(s) each; the paged engine "
        f"gets the {r['kv_slots']:,} KV slots of one padded static batch of {r['batch_size']}:"
    )
    return "\n".join([head, "", *_engine_table(r)]) + "\n"


def sharing_block(folder: Path | None = None) -> str:
    """``bench sharing``: memory saved by sharing, and a shared prefix cached."""
    memory, prefix = load("sharing_memory", folder), load("sharing_prefix", folder)
    widths = memory["setup"]["widths"]
    head = " | ".join([*(f"n = {w}" for w in widths), *(f"beam {w}" for w in widths)])
    lines = [
        f"`python -m paged_attention bench sharing` ({where(prefix)}): the embedded tiny Llama. KV memory "
        "saved by sharing blocks, as a time average over the run (blocks saved / blocks the same page "
        f"tables would hold unshared), {memory['setup']['num_requests']} requests per synthetic trace:",
        "",
        f"| trace | {head} |",
        "|---" * (1 + 2 * len(widths)) + "|",
    ]
    for trace, modes in memory["savings"].items():
        cells = [f"{100 * v:.0f}%" for v in modes["parallel"]] + [f"{100 * v:.0f}%" for v in modes["beam"]]
        label = TRACE_NAMES.get(trace, trace)
        lines.append(f"| {label}-like | " + " | ".join(cells) + " |")
    a, s = paper.FIG15_ALPACA, paper.SEC63_SHAREGPT
    lines += [
        "",
        f"The paper (OPT-13B, §6.3) reports {s['parallel'][0]}-{s['parallel'][1]}% for parallel sampling "
        f"and {s['beam'][0]}-{s['beam'][1]}% for beam search on ShareGPT (in its text), and "
        f"{a['parallel'][0]}-{a['parallel'][1]}% and {a['beam'][0]}-{a['beam'][1]}% on Alpaca "
        "(its Figure 15).",
        "",
        f"{prefix['setup']['num_requests']} requests behind one few-shot prefix, under a KV budget that "
        f"holds {prefix['setup']['budget_requests']} of them unshared ({prefix['setup']['repeats']} run(s); "
        '"tokens" counts every token run through the model):',
        "",
        "| shared prefix | hit rate | tokens, caching off -> on | requests/s, off -> on | speedup "
        "| largest batch |",
        "|---|---|---|---|---|---|",
    ]
    for name, res in prefix["results"].items():
        off, on = res["off"], res["on"]
        lines.append(
            f"| {name}, {res['prefix_len']} tokens | {on['hit_rate']:.0%} | {off['model_tokens']:,} -> "
            f"{on['model_tokens']:,} | {off['requests_per_s']:.1f} -> {on['requests_per_s']:.1f} | "
            f"{res['speedup']:.2f}x | {off['peak_batch']} -> {on['peak_batch']} |"
        )
    return "\n".join(lines) + "\n"


def throughput_block(folder: Path | None = None) -> str:
    """``bench throughput``: every manager, the same KV slots, the real engine on this CPU."""
    r = load("throughput", folder)
    s = r["setup"]
    order = [m for m in ("paged", "max", "pow2", "oracle", "static") if m in r["tokens_per_s"]]
    names = {"paged": "paged (blocks of 16)", "static": "static batching (Max, fixed batches)"}
    lines = [
        f"`python -m paged_attention bench throughput` ({where(r)}): the real engine and the embedded model, "
        f"{s['num_requests']} ShareGPT-like requests with lengths scaled by {s['max_model_len']}/2048 (mean "
        f"{s['mean_prompt']:.0f} in / {s['mean_output']:.0f} out, maximum length {s['max_model_len']}), all "
        f"waiting at the start, greedy with EOS ignored; every manager gets the same {s['kv_slots']:,} KV "
        f"slots; best of {s['repeats']} interleaved run(s):",
        "",
        "| manager | output tokens/s | mean batch | paged is | same tokens |",
        "|---|---|---|---|---|",
    ]
    for m in order:
        label = names.get(m, f"{LABELS[m]}, buddy")
        lines.append(
            f"| {label} | {r['tokens_per_s'][m]:,.0f} | {r['mean_batch'][m]:.1f} | "
            f"{r['paged_speedup'][m]:.2f}x | {'yes' if r['same_outputs'][m] else 'NO'} |"
        )
    steps = [row for row in step_time_by_batch(r) if row["steps"] >= 20]
    if len(steps) >= 2:
        low, high = steps[0], steps[-1]
        lines += [
            "",
            f"A CPU's step time grows with the batch (in this run {low['ms_per_step']:.1f} ms per step at "
            f"about {plural(round(low['mean_batch']), 'sequence')}, {high['ms_per_step']:.1f} ms at about "
            f"{round(high['mean_batch'])}), where an A100's decode step barely moves (notebook 07).",
        ]
    return "\n".join(lines) + "\n"


def kv_dtype_block(folder: Path | None = None) -> str:
    """``bench kv-dtype``: the 8-bit KV caches against the unquantized one in the demo's budget."""
    r = load("kv_dtype", folder)
    rows, ref = r["rows"], r["rows"][0]
    tokens = ref["error"]["tokens"]
    lines = [
        f"`python -m paged_attention bench kv-dtype` ({where(r)}): {r['model']} in {r['dtype']}, "
        f"the KV budget of `make demo` ({r['budget_bytes'] / 2**20:.1f} MiB: "
        f"{r['budget_blocks_of_reference']} {ref['format']} blocks of {r['block_size']} tokens; "
        f"float32 would hold {r['float32_blocks']}), "
        f"`max_model_len={r['max_model_len']}`; {r['num_requests']} chat questions, greedy, "
        f"{r['max_tokens']} tokens each (past an answer's end, so that every format does the same work; "
        f"answers compared up to where {ref['format']}'s ends), the formats alternating ({r['repeats']} "
        "rounds, the best kept); "
        f"the error per token of {tokens:,} tokens of text (this package's corpus, then Python's reference "
        f"manual), each position's next-token distribution against {ref['format']}'s:",
        "",
        "| format | blocks | max-length requests | running at once (most, mean) | output tokens/s | "
        "answers identical | KL mean | KL max | largest logprob change | top-1 same | perplexity (corpus) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        e, a = row["error"], row["agreement"]
        speed = row["tokens_per_s"] / ref["tokens_per_s"]
        lines.append(
            f"| {row['format']} | {row['blocks']} | {row['max_length_requests']} | {row['peak_running']}, "
            f"{row['mean_running']:.1f} | {row['tokens_per_s']:.1f} (**{speed:.2f}x**)"
            f" | {a['identical']}/{a['answers']} | {e['kl_mean']:.5f} | {e['kl_max']:.3f} | "
            f"{e['logprob_change_max']:.3f} | {e['top1_agreement']:.1%} | {e['corpus_perplexity']:.2f} |"
        )
    return "\n".join(lines) + "\n"
