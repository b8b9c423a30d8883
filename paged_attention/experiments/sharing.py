"""What sharing pages saves, through the real engine and the embedded model (the paper's Figures 15, 16).

Two experiments, on this machine; ``python -m paged_attention bench sharing`` runs both and notebook
08 runs them small:

* **Memory saved by sharing** (§6.3's workload, :func:`run_memory`). Requests of the
  ShareGPT-like and Alpaca-like traces (:mod:`paged_attention.experiments.traces`, lengths capped at
  the model's 1024 positions) are served with parallel sampling (``n`` = 2, 4, 6) and with beam
  search (width 2, 4, 6), every output as long as the trace says (EOS ignored). After every step the
  memory report says how many blocks the page tables hold and how many more they would hold
  unshared; the saving is ``saved / (used + saved)`` summed over the run, a time average weighted by
  memory. The paper's ranges (OPT-13B, §6.3) are
  :data:`~paged_attention.experiments.paper.FIG15_ALPACA` (Figure 15) and
  :data:`~paged_attention.experiments.paper.SEC63_SHAREGPT` (§6.3's text), one per trace; our model
  is tiny and random and our traces synthetic, so only the shape is comparable.
* **A shared few-shot prefix** (Figure 16's workload, :func:`run_prefix`). Prompts start with the
  same 80- or 341-token prefix (the paper's 1-shot and 5-shot lengths) followed by a sentence of
  their own, under a KV budget that holds ``budget_requests`` of them unshared. With prefix caching
  the prefix is computed once and held once: we report the hit rate, the prompt tokens computed,
  every token run through the model, and requests per second with caching on and off (the outputs
  must be identical). The paper's prefixes were predefined by the service and their blocks reserved
  in advance (§4.4); ours are found by hashing (automatic prefix caching). The paper compares vLLM
  against Orca (Oracle) on an A100 with LLaMA-13B; here both sides are our engine on a CPU, where the
  prefill work saved counts more and the larger batch less, and the ratio varies from run to run.

Their figures and tables: :mod:`paged_attention.viz.sharing`.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Sequence

import torch

from .._checks import cdiv
from ..engine.llm_engine import LLMEngine
from ..engine.sample.sampling import BeamSearchParams, RequestOutputKind, SamplingParams
from ..models import load_model
from . import paper
from .progress import progress as bar
from .traces import TRACE_SHAPES, synthetic_trace

FINAL_ONLY = RequestOutputKind.FINAL_ONLY  # one output per request, as LLM.generate

TRACES = ("alpaca", "sharegpt")
WIDTHS = (2, 4, 6)
PREFIXES = dict(paper.FIG16_PREFIX_TOKENS)  # the paper's 1-shot and 5-shot prefix lengths (§6.4)
BLOCK_SIZE = 16
PAPER_FIG15 = {"alpaca": paper.FIG15_ALPACA, "sharegpt": paper.SEC63_SHAREGPT}  # §6.3, per trace


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
