"""``python -m paged_attention bench sharing``: what sharing pages saves (the paper's Figures 15 and 17).

Two experiments through the real engine and the embedded model, on this machine:

* **Memory saved by sharing** (Figure 15). Requests of the ShareGPT-like and Alpaca-like traces
  (:mod:`paged_attention.experiments.traces`, lengths capped at the model's 1024 positions) are served with
  parallel sampling (``n`` = 2, 4, 6) and with beam search (width 2, 4, 6), every output as long as
  the trace says (EOS ignored). After every step the memory report says how many blocks the page
  tables hold and how many more they would hold unshared; the saving is
  ``saved / (used + saved)`` summed over the run, a time average weighted by memory. The paper
  measures 6.1-9.8% (parallel sampling) and 37.6-55.2% (beam search) on Alpaca with OPT-13B; our
  model is tiny and random, so its beams agree (and share) more than a real model's.
* **A shared few-shot prefix** (Figure 16's setup). ``--prefix-requests`` prompts start with the
  same 80- or 341-token prefix (the paper's 1-shot and 5-shot examples) followed by a sentence of
  their own, under a KV budget that holds ``--budget-requests`` of them unshared. With prefix
  caching the prefix is computed once and held once: we report the hit rate, the prompt tokens not
  recomputed, and requests per second with caching on and off (the outputs must be identical). The
  paper compares against Orca (Oracle) on an A100 (1.67x and 3.58x); here both sides are our engine
  on a CPU, where the prefill work saved counts more and the larger batch less.

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
PREFIXES = {"1-shot": 80, "5-shot": 341}
BLOCK_SIZE = 16


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
) -> float:
    """Fraction of KV blocks that sharing saves while serving ``lengths`` with ``n`` (``mode="parallel"``)
    or ``beam_width`` (``mode="beam"``) equal to ``width``. Memory is ample: nothing is preempted."""
    if mode not in ("parallel", "beam"):
        raise ValueError(f"mode must be 'parallel' or 'beam', got {mode!r}")
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    blocks = sum(width * (cdiv(p + o, BLOCK_SIZE) + 1) for p, o in lengths)
    engine = LLMEngine(model, tokenizer, block_size=BLOCK_SIZE, num_kv_blocks=blocks)
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
        used += report.used_slots // BLOCK_SIZE
    return saved / (saved + used) if saved + used else 0.0


def run_memory(
    traces: Sequence[str] = TRACES,
    widths: Sequence[int] = WIDTHS,
    num_requests: int = 8,
    seed: int = 0,
    model: torch.nn.Module | None = None,
    tokenizer: object | None = None,
    progress: bool = False,
) -> dict:
    """Memory saved by sharing, ``savings[trace][mode][i]`` for ``widths[i]``."""
    if model is None:
        model, tokenizer = load_model(None)
    max_len = model.config.max_position_embeddings
    savings: dict[str, dict[str, list[float]]] = {}
    runs = [(t, m, w) for t in traces for m in ("parallel", "beam") for w in widths]
    for trace, mode, width in bar(runs, progress, "memory saved by sharing"):
        lengths = trace_lengths(trace, num_requests, max_len, seed)
        saving = memory_saving(model, tokenizer, lengths, mode, width, seed)
        savings.setdefault(trace, {}).setdefault(mode, []).append(saving)
    return {
        "setup": {
            "traces": list(traces),
            "widths": list(widths),
            "num_requests": num_requests,
            "seed": seed,
            "max_len": max_len,
            "block_size": BLOCK_SIZE,
        },
        "savings": savings,
        "paper_alpaca": {mode: list(r) for mode, r in paper.FIG15_ALPACA.items()},
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
) -> dict:
    """Serve ``work`` greedily (all requests waiting from the start); time it and count the work."""
    engine = LLMEngine(
        model,
        tokenizer,
        block_size=BLOCK_SIZE,
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
    computed = steps = peak = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[int(out.request_id)] = out.outputs[0].token_ids
        computed += engine.last_step.num_scheduled_tokens
        peak = max(peak, engine.last_step.num_scheduled_seqs)
        steps += 1
    seconds = time.perf_counter() - start
    stats = engine.cache_manager.prefix_cache_stats
    return {
        "seconds": seconds,
        "requests_per_s": len(work) / seconds,
        "computed_tokens": computed,
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
) -> dict:
    """Prefix caching on and off for each shared prefix; the faster of ``repeats`` interleaved runs counts."""
    if model is None:
        model, tokenizer = load_model(None)
    results = {}
    for name, prefix_len in prefixes.items():
        work = prefix_workload(prefix_len, num_requests, model.config.vocab_size, seed)
        longest = max(len(p) + n for p, n in work)
        blocks = budget_requests * cdiv(longest, BLOCK_SIZE)
        best: dict[str, dict] = {}
        for _ in bar(range(repeats), progress, f"{name} prefix"):
            for key, on in (("off", False), ("on", True)):
                r = serve_prefix(model, tokenizer, work, blocks, on)
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
            "torch_threads": torch.get_num_threads(),
        },
        "results": results,
        "paper_speedup_vs_orca_oracle": dict(paper.FIG16_SPEEDUP),
    }


def memory_figure(payload: dict) -> Figure:
    names = {"alpaca": "Alpaca-like", "sharegpt": "ShareGPT-like"}
    return viz.sharing.sharing_savings(
        payload["setup"]["widths"],
        {names.get(t, t): v for t, v in payload["savings"].items()},
        {mode: tuple(r) for mode, r in payload["paper_alpaca"].items()},
    )


def prefix_figure(payload: dict) -> Figure:
    results = {}
    for name, r in payload["results"].items():
        rates = {key: r[key]["requests_per_s"] for key in ("off", "on")}
        results[f"{name} ({r['prefix_len']} tokens)"] = {**rates, "hit_rate": r["on"]["hit_rate"]}
    paper_speedups = {
        f"{name} ({r['prefix_len']} tokens)": payload["paper_speedup_vs_orca_oracle"][name]
        for name, r in payload["results"].items()
        if name in payload["paper_speedup_vs_orca_oracle"]
    }
    return viz.sharing.prefix_caching_speedup(results, paper_speedups)


def memory_report_text(payload: dict) -> str:
    rows = []
    for trace, by_mode in payload["savings"].items():
        for mode, values in by_mode.items():
            rows.append([trace, mode, *[f"{100 * v:.1f}%" for v in values]])
    header = ["trace", "sharing", *[f"width {w}" for w in payload["setup"]["widths"]]]
    return table(rows, header)


def prefix_report_text(payload: dict) -> str:
    rows = []
    for name, r in payload["results"].items():
        saved = r["on"]["hit_tokens"] / r["prompt_tokens"]
        rows.append([
            f"{name} ({r['prefix_len']})", f"{100 * r['on']['hit_rate']:.0f}%", f"{100 * saved:.0f}%",
            r["off"]["computed_tokens"], r["on"]["computed_tokens"], r["off"]["requests_per_s"],
            r["on"]["requests_per_s"], f"{r['speedup']:.2f}x", r["off"]["peak_batch"], r["on"]["peak_batch"],
            "yes" if r["same_outputs"] else "NO",
        ])  # fmt: skip
    header = ["prefix", "hit rate", "prompt saved", "tokens off", "tokens on", "req/s off", "req/s on",
              "speedup", "batch off", "batch on", "same tokens"]  # fmt: skip
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
        low, high = paper.FIG15_ALPACA["parallel"]
        blow, bhigh = paper.FIG15_ALPACA["beam"]
        print(f"paper (OPT-13B, Alpaca): parallel sampling {low}-{high}%, beam search {blow}-{bhigh}%\n")
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
        print(f"paper (LLaMA-13B vs Orca (Oracle), A100): 1-shot {paper.FIG16_SPEEDUP['1-shot']}x, "
              f"5-shot {paper.FIG16_SPEEDUP['5-shot']}x")  # fmt: skip
        write_results("sharing_prefix", prefix, prefix_figure(prefix), opts.out)
