"""``python -m paged_attention bench sharing``: what sharing pages saves (the paper's Figures 15 and 16).

Two experiments through the real engine and the embedded model, on this machine:

* **Memory saved by sharing** (Figure 15's workload). Requests of the ShareGPT-like and Alpaca-like
  traces (:mod:`paged_attention.experiments.traces`, lengths capped at the model's 1024 positions)
  are served with parallel sampling (``n`` = 2, 4, 6) and with beam search (width 2, 4, 6), every
  output as long as the trace says (EOS ignored). After every step the memory report says how many
  blocks the page tables hold and how many more they would hold unshared; the saving is
  ``saved / (used + saved)`` summed over the run, a time average weighted by memory. The paper's
  ranges (OPT-13B, §6.3) are :data:`~paged_attention.experiments.paper.FIG15_ALPACA` and
  :data:`~paged_attention.experiments.paper.FIG15_SHAREGPT`, one per trace; our model is tiny and
  random and our traces synthetic, so only the shape is comparable.
* **A shared few-shot prefix** (Figure 16's workload). ``--prefix-requests`` prompts start with
  the same 80- or 341-token prefix (the paper's 1-shot and 5-shot lengths) followed by a sentence
  of their own, under a KV budget that holds ``--budget-requests`` of them unshared. With prefix
  caching the prefix is computed once and held once: we report the hit rate, the prompt tokens
  computed, every token run through the model, and requests per second with caching on and off
  (the outputs must be identical). The paper's prefixes were predefined by the service and their
  blocks reserved in advance (§4.4); ours are found by hashing (automatic prefix caching). The paper
  compares vLLM against Orca (Oracle) on an A100 with LLaMA-13B; here both sides are our engine on
  a CPU, where the prefill work saved counts more and the larger batch less, and the ratio varies
  from run to run.

Writes ``figures/sharing_memory.{png,json}`` and ``figures/sharing_prefix.{png,json}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from matplotlib.figure import Figure

from ... import viz
from ..._checks import cdiv
from ...engine.llm_engine import LLMEngine
from ...engine.models import load_model
from ...engine.sampling import BeamSearchParams, RequestOutputKind, SamplingParams
from ...experiments import paper
from ...experiments.traces import TRACE_SHAPES, synthetic_trace
from ._progress import progress as bar
from ._results import table, write_results

FINAL_ONLY = RequestOutputKind.FINAL_ONLY  # one output per request, as LLM.generate

TRACES = ("alpaca", "sharegpt")
WIDTHS = (2, 4, 6)
PREFIXES = dict(paper.FIG16_PREFIX_TOKENS)  # the paper's 1-shot and 5-shot prefix lengths (§6.4)
BLOCK_SIZE = 16
PAPER_FIG15 = {"alpaca": paper.FIG15_ALPACA, "sharegpt": paper.FIG15_SHAREGPT}  # §6.3, per trace


def trace_lengths(trace: str, num_requests: int, max_len: int, seed: int = 0) -> list[tuple[int, int]]:
    """``(prompt_len, output_len)`` of ``num_requests`` requests of a named trace, none over ``max_len``."""
    shape = dataclasses.replace(TRACE_SHAPES[trace], max_len=max_len)
    return [(r.prompt_len, r.output_len) for r in synthetic_trace(shape, num_requests, None, seed)]


def memory_saving(
    model: torch.nn.Module,
    tokenizer: object,
    lengths: Sequence[tuple[int, int]],
    mode: str,
    width: int,
    seed: int = 0,
    block_size: int = BLOCK_SIZE,
) -> float:
    """Fraction of KV blocks that sharing saves while serving ``lengths`` with ``n`` (``mode="parallel"``)
    or ``beam_width`` (``mode="beam"``) equal to ``width``, in blocks of ``block_size`` tokens.
    Memory is ample: nothing is preempted."""
    if mode not in ("parallel", "beam"):
        raise ValueError(f"mode must be 'parallel' or 'beam', got {mode!r}")
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    blocks = sum(width * (cdiv(p + o, block_size) + 1) for p, o in lengths)
    # Room for every sequence unshared, so no watermark is needed (it would keep blocks back)
    engine = LLMEngine(model, tokenizer, block_size=block_size, num_kv_blocks=blocks, watermark=0.0)
    for i, (prompt_len, output_len) in enumerate(lengths):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        params: SamplingParams | BeamSearchParams
        if mode == "parallel":
            params = SamplingParams(n=width, seed=seed + 100 * i, max_tokens=output_len, ignore_eos=True)
        else:
            params = BeamSearchParams(beam_width=width, max_tokens=output_len, ignore_eos=True)
        engine.add_request(str(i), prompt, params)
    saved = used = 0
    while engine.has_unfinished_requests():
        engine.step()
        report = engine.cache_manager.memory_report()
        saved += report.saved_blocks
        used += report.used_slots // block_size
    return saved / (saved + used) if saved + used else 0.0


def run_memory(
    traces: Sequence[str] = TRACES,
    widths: Sequence[int] = WIDTHS,
    num_requests: int = 8,
    seed: int = 0,
    model: torch.nn.Module | None = None,
    tokenizer: object | None = None,
    progress: bool = False,
    block_size: int = BLOCK_SIZE,
) -> dict:
    """Memory saved by sharing, ``savings[trace][mode][i]`` for ``widths[i]``; ``paper_fig15[trace][mode]``
    holds the paper's range for the traces it measured (§6.3: Alpaca and ShareGPT)."""
    if model is None:
        model, tokenizer = load_model(None)
    max_len = model.config.max_position_embeddings
    savings: dict[str, dict[str, list[float]]] = {}
    runs = [(t, m, w) for t in traces for m in ("parallel", "beam") for w in widths]
    for trace, mode, width in bar(runs, progress, "memory saved by sharing"):
        lengths = trace_lengths(trace, num_requests, max_len, seed)
        saving = memory_saving(model, tokenizer, lengths, mode, width, seed, block_size)
        savings.setdefault(trace, {}).setdefault(mode, []).append(saving)
    return {
        "setup": {
            "traces": list(traces),
            "widths": list(widths),
            "num_requests": num_requests,
            "seed": seed,
            "max_len": max_len,
            "block_size": block_size,
        },
        "savings": savings,
        "paper_fig15": {
            trace: {mode: list(r) for mode, r in ranges.items()}
            for trace, ranges in PAPER_FIG15.items()
            if trace in traces
        },
    }


def prefix_workload(
    prefix_len: int, num_requests: int, vocab_size: int, seed: int = 0
) -> list[tuple[list[int], int]]:
    """``(prompt, max_tokens)`` pairs: one shared prefix, then a 16-40 token sentence and 16-40 outputs."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab_size) for _ in range(prefix_len)]
    return [
        (prefix + [rng.randrange(3, vocab_size) for _ in range(rng.randint(16, 40))], rng.randint(16, 40))
        for _ in range(num_requests)
    ]


def serve_prefix(
    model: torch.nn.Module,
    tokenizer: object,
    work: list[tuple[list[int], int]],
    num_kv_blocks: int,
    prefix_caching: bool,
    block_size: int = BLOCK_SIZE,
) -> dict:
    """Serve ``work`` greedily (all requests waiting from the start); time it and count the work.

    ``model_tokens`` counts every token run through the model: prompt tokens computed (first
    admissions, less the prefix cache's hits), decode tokens (every output token but the last is
    fed back once) and the work preemption redid (``recomputed_tokens``, the rest)."""
    engine = LLMEngine(
        model,
        tokenizer,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        enable_prefix_caching=prefix_caching,
    )
    for i, (prompt, max_tokens) in enumerate(work):
        engine.add_request(
            str(i),
            prompt,
            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=FINAL_ONLY),
        )
    outputs: dict[int, list[int]] = {}
    model_tokens = steps = peak = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[int(out.request_id)] = out.outputs[0].token_ids
        model_tokens += engine.last_step.num_scheduled_tokens
        peak = max(peak, engine.last_step.num_scheduled_seqs)
        steps += 1
    seconds = time.perf_counter() - start
    stats = engine.cache_manager.prefix_cache_stats
    prompt_computed = stats.misses if prefix_caching else sum(len(p) for p, _ in work)
    decode_tokens = sum(n - 1 for _, n in work)  # ignore_eos: every request makes max_tokens
    return {
        "seconds": seconds,
        "requests_per_s": len(work) / seconds,
        "model_tokens": model_tokens,
        "prompt_tokens_computed": prompt_computed,
        "recomputed_tokens": model_tokens - prompt_computed - decode_tokens,
        "hit_rate": stats.hit_rate,
        "hit_tokens": stats.hits,
        "steps": steps,
        "peak_batch": peak,
        "preemptions": engine.scheduler.num_preemptions,
        "outputs": [outputs[i] for i in range(len(work))],
    }


def run_prefix(
    prefixes: dict[str, int] = PREFIXES,
    num_requests: int = 64,
    budget_requests: int = 8,
    repeats: int = 3,
    seed: int = 0,
    model: torch.nn.Module | None = None,
    tokenizer: object | None = None,
    progress: bool = False,
    block_size: int = BLOCK_SIZE,
) -> dict:
    """Prefix caching on and off for each shared prefix; the faster of ``repeats`` interleaved runs counts."""
    if model is None:
        model, tokenizer = load_model(None)
    results = {}
    for name, prefix_len in prefixes.items():
        work = prefix_workload(prefix_len, num_requests, model.config.vocab_size, seed)
        longest = max(len(p) + n for p, n in work)
        blocks = budget_requests * cdiv(longest, block_size)
        best: dict[str, dict] = {}
        for _ in bar(range(repeats), progress, f"{name} prefix"):
            for key, on in (("off", False), ("on", True)):
                r = serve_prefix(model, tokenizer, work, blocks, on, block_size)
                if key not in best or r["seconds"] < best[key]["seconds"]:
                    best[key] = r
        prompt_tokens = sum(len(p) for p, _ in work)
        results[name] = {
            "prefix_len": prefix_len,
            "num_kv_blocks": blocks,
            "prompt_tokens": prompt_tokens,
            "same_outputs": best["on"]["outputs"] == best["off"]["outputs"],
            "speedup": best["off"]["seconds"] / best["on"]["seconds"],
            **{key: {k: v for k, v in r.items() if k != "outputs"} for key, r in best.items()},
        }
    return {
        "setup": {
            "prefixes": dict(prefixes),
            "num_requests": num_requests,
            "budget_requests": budget_requests,
            "repeats": repeats,
            "seed": seed,
            "block_size": block_size,
            "torch_threads": torch.get_num_threads(),
        },
        "results": results,
        "paper_fig16_speedup_vs_orca_oracle": dict(paper.FIG16_SPEEDUP),
    }


TRACE_NAMES = {"alpaca": "Alpaca-like", "sharegpt": "ShareGPT-like"}


def memory_figure(payload: dict) -> Figure:
    """Our savings per trace, each beside the paper's range for the trace it imitates (a band)."""
    return viz.sharing.sharing_savings(
        payload["setup"]["widths"],
        {TRACE_NAMES.get(t, t): v for t, v in payload["savings"].items()},
        {
            TRACE_NAMES.get(t, t): {mode: (r[0], r[1]) for mode, r in ranges.items()}
            for t, ranges in payload["paper_fig15"].items()
        },
    )


def prefix_figure(payload: dict) -> Figure:
    results = {}
    for name, r in payload["results"].items():
        rates = {key: r[key]["requests_per_s"] for key in ("off", "on")}
        results[f"{name} ({r['prefix_len']} tokens)"] = {**rates, "hit_rate": r["on"]["hit_rate"]}
    paper_speedups = {
        f"{name} ({r['prefix_len']} tokens)": payload["paper_fig16_speedup_vs_orca_oracle"][name]
        for name, r in payload["results"].items()
        if name in payload["paper_fig16_speedup_vs_orca_oracle"]
    }
    return viz.sharing.prefix_caching_speedup(results, paper_speedups)


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


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m paged_attention bench sharing", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--requests", type=int, default=8, help="requests per trace in the memory runs")
    parser.add_argument("--traces", nargs="+", default=list(TRACES), choices=sorted(TRACE_SHAPES))
    parser.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS), help="n and beam widths")
    parser.add_argument("--prefix-requests", type=int, default=64)
    parser.add_argument(
        "--budget-requests", type=int, default=8, help="KV budget: this many prefix requests, unshared"
    )
    parser.add_argument("--repeats", type=int, default=3, help="prefix runs per setting; the fastest counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", nargs="*", default=[], choices=["memory", "prefix"])
    parser.add_argument("--out", type=Path, default=None, help="folder for the results (default figures/)")
    opts = parser.parse_args(args)
    model, tokenizer = load_model(None)
    if "memory" not in opts.skip:
        memory = run_memory(
            opts.traces, opts.widths, opts.requests, opts.seed, model, tokenizer, progress=True
        )
        print(f"KV memory saved by sharing ({opts.requests} requests per trace, time average):")
        print(memory_report_text(memory))
        print("paper: §6.3, Figure 15 (OPT-13B, real traces); ours: a tiny random model, synthetic traces\n")
        write_results("sharing_memory", memory, memory_figure(memory), opts.out)
    if "prefix" not in opts.skip:
        prefix = run_prefix(
            PREFIXES, opts.prefix_requests, opts.budget_requests, opts.repeats, opts.seed, model, tokenizer,
            progress=True,
        )  # fmt: skip
        print(
            f"\n{opts.prefix_requests} requests behind a shared prefix, KV budget of {opts.budget_requests} "
            f"unshared requests, best of {opts.repeats} runs, torch threads {torch.get_num_threads()}:"
        )
        print(prefix_report_text(prefix))
        print(
            f"paper (§6.4, Figure 16; LLaMA-13B vs Orca (Oracle), A100, prefixes reserved in advance): "
            f"1-shot {paper.FIG16_SPEEDUP['1-shot']}x, 5-shot {paper.FIG16_SPEEDUP['5-shot']}x"
        )
        print("ours: caching on vs off, on this CPU; the ratio varies from run to run")
        write_results("sharing_prefix", prefix, prefix_figure(prefix), opts.out)
