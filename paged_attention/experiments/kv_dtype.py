"""Quantized pages measured: what an 8-bit KV cache buys (room, speed) and what it costs (error).

Every format (:mod:`~paged_attention.kernels.quantization`) runs the same real model (SmolLM2 in
bfloat16 by default) in one process, side by side:

* **capacity**: the KV budget of the demo (``python -m paged_attention demo``: 64 bfloat16 blocks of
  16 tokens) converted to each format's blocks, scales included, and the requests of the model's
  serving length (``max_model_len``) that fit at once;
* **throughput at that budget**: the demo's workload (its chat questions, greedy, ``max_tokens``
  each, past the end of an answer too, so that every format does the same work) served by an engine
  holding exactly that budget: output tokens/s, the most and the mean requests running together,
  preemptions; the formats alternate, ``repeats`` rounds, best kept;
* **greedy agreement** of those answers with the bfloat16 cache's, each cut where the reference's
  answer ends (its end-of-sequence token): answers identical token for token, and where the others
  first part ways;
* **error over text**: windows of shipped text (this package's own corpus, then the Python
  reference manual that every Python ships, ``pydoc_data``) go through the model as prompts, each
  position's next-token distribution read from the output layer; against the bfloat16 cache's: the
  KL divergence per token (mean, largest), the change of the log-probability of the text's actual
  next token (mean, largest), the top-1 agreement, and perplexity on the corpus.

A prompt's keys and values are stored before attention reads them, so every position of a window
already reads 8-bit pages. (A window's int8 blocks are each written in one store, one scale from
all their tokens; during decode a block fills token by token and its scale grows, with one more
rounding each time.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..engine.llm import LLM
from ..engine.params import SamplingParams
from ..engine.worker.kv_cache import KVCacheSpec
from ..models import load_model
from ..models.corpus import CORPUS
from . import dtypes


@dataclass(frozen=True)
class Format:
    """One way to keep the cache: a label and the engine keywords that choose it."""

    label: str
    kv_cache_dtype: str
    calculate_kv_scales: bool = False


FORMATS = (
    Format("bfloat16", "auto"),
    Format("fp8 (e4m3, scale 1.0)", "fp8"),
    Format("fp8 (e4m3, calculated scales)", "fp8", True),
    Format("fp8_e5m2", "fp8_e5m2"),
    Format("int8 (per block and head)", "int8"),
)


def texts(tokenizer: object, num_tokens: int) -> list[tuple[str, list[int]]]:
    """(source, tokens): the corpus, then reference-manual topics in a fixed order, to ``num_tokens``."""
    import pydoc_data.topics

    ids = tokenizer(CORPUS).input_ids[:num_tokens]  # type: ignore[operator]
    out = [("corpus", ids)]
    total = len(ids)
    for name in sorted(pydoc_data.topics.topics):
        if total >= num_tokens:
            break
        more = tokenizer(pydoc_data.topics.topics[name]).input_ids[: num_tokens - total]  # type: ignore[operator]
        out.append((f"pydoc:{name}", more))
        total += len(more)
    return out


def windows(tokens: list[int], size: int) -> list[list[int]]:
    return [tokens[i : i + size] for i in range(0, len(tokens) - 1, size) if len(tokens[i : i + size]) > 1]


class Logits:
    """Catches the rows a model's output layer computes (a forward hook), as log-probabilities."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.rows: list[torch.Tensor] = []
        self._handle = model.get_output_embeddings().register_forward_hook(self._keep)

    def _keep(self, module: object, args: object, output: torch.Tensor) -> None:
        self.rows.append(torch.log_softmax(output.float(), dim=-1))

    def take(self) -> torch.Tensor:
        rows, self.rows = torch.cat(self.rows), []
        return rows

    def close(self) -> None:
        self._handle.remove()


def scored(llm: LLM, logits: Logits, window: list[int]) -> torch.Tensor:
    """Log-probabilities ``[len(window) - 1, vocab]``: position ``p`` predicting ``window[p + 1]``."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    llm.generate([{"prompt_token_ids": window}], params, use_tqdm=False)
    return logits.take()[: len(window) - 1]


def text_error(
    engines: dict[str, LLM], model: torch.nn.Module, tokenizer: object, num_tokens: int, window: int
) -> dict[str, dict]:
    """The error-over-text measures of each format against the first (see the module docstring)."""
    logits = Logits(model)
    labels = list(engines)
    sums = {label: {"kl": [], "delta": [], "top1": [], "nll": [], "corpus_nll": []} for label in labels}
    try:
        for source, tokens in texts(tokenizer, num_tokens):
            for piece in windows(tokens, window):
                target = torch.tensor(piece[1:])
                base = scored(engines[labels[0]], logits, piece)
                base_actual = base.gather(1, target[:, None])[:, 0]
                for label in labels:
                    lp = base if label == labels[0] else scored(engines[label], logits, piece)
                    actual = lp.gather(1, target[:, None])[:, 0]
                    s = sums[label]
                    s["kl"].append((base.exp() * (base - lp)).sum(-1).clamp(min=0))
                    s["delta"].append((actual - base_actual).abs())
                    s["top1"].append(lp.argmax(-1) == base.argmax(-1))
                    s["nll"].append(-actual)
                    if source == "corpus":
                        s["corpus_nll"].append(-actual)
    finally:
        logits.close()
    out = {}
    for label, s in sums.items():
        kl, delta, top1 = (torch.cat(s[k]) for k in ("kl", "delta", "top1"))
        out[label] = {
            "tokens": int(kl.numel()),
            "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()),
            "logprob_change_mean": float(delta.mean()),
            "logprob_change_max": float(delta.max()),
            "top1_agreement": float(top1.float().mean()),
            "perplexity": float(torch.cat(s["nll"]).mean().exp()),
            "corpus_perplexity": float(torch.cat(s["corpus_nll"]).mean().exp()),
        }
    return out


def serve(llm: LLM, prompts: list[dict], max_tokens: int) -> dict:
    """The demo's workload through the public step loop: tokens/s, requests at once, the answers."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)  # the same work for all
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    answers: dict[int, list[int]] = {}
    running: list[int] = []
    preempted = engine.scheduler.num_preemptions
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                answers[int(out.request_id)] = list(out.outputs[0].token_ids)
        if engine.last_step and engine.last_step.num_scheduled_seqs:
            running.append(engine.last_step.num_scheduled_seqs)
    seconds = time.perf_counter() - start
    tokens = sum(len(a) for a in answers.values())
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "peak_running": max(running),
        "mean_running": sum(running) / len(running),
        "preemptions": engine.scheduler.num_preemptions - preempted,
        "answers": [answers[i] for i in range(len(prompts))],
    }


def agreement(reference: list[list[int]], other: list[list[int]], stop_ids: set[int]) -> dict:
    """:func:`.dtypes.agreement` of the answers, each cut after the reference's first stop token: how
    many are identical, and the mean position of the others' first difference."""
    cut = [next((i + 1 for i, t in enumerate(x) if t in stop_ids), len(x)) for x in reference]
    pairs = list(zip(reference, other, cut, strict=True))
    found = dtypes.agreement([x[:n] for x, _, n in pairs], [y[:n] for _, y, n in pairs])
    first = found["first_difference"]
    return {
        "identical": found["identical"],
        "answers": found["prompts"],
        "mean_first_difference": sum(first) / len(first) if first else None,
    }


def compare(
    model_name: str,
    dtype: str = "bfloat16",
    num_kv_blocks: int = 64,
    block_size: int = 16,
    max_model_len: int = 256,
    num_requests: int = 48,
    max_tokens: int = 48,
    repeats: int = 2,
    text_tokens: int = 3000,
    window: int = 512,
    formats: tuple[Format, ...] = FORMATS,
) -> dict:
    """Every measure of the module docstring, for each of ``formats`` (the first is the reference)."""
    model, tokenizer = load_model(model_name, dtype)
    model_dtype = next(model.parameters()).dtype

    def make(f: Format, length: int = max_model_len, **memory: int) -> LLM:
        return LLM(
            model,
            tokenizer=tokenizer,
            block_size=block_size,
            max_model_len=length,
            kv_cache_dtype=f.kv_cache_dtype,
            calculate_kv_scales=f.calculate_kv_scales,
            enable_prefix_caching=False,
            **memory,
        )

    reference_spec = make(formats[0], num_kv_blocks=2 * max_model_len // block_size).llm_engine.spec
    budget = num_kv_blocks * reference_spec.bytes_per_block(block_size)
    prompts = dtypes.chat_prompts(tokenizer, num_requests)  # the demo's questions, cycled
    engines = {f.label: make(f, kv_cache_memory=budget) for f in formats}
    for llm in engines.values():  # first calls load and compile kernels: not timed
        llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
        llm.llm_engine.kv_cache.restart_calibration()  # calculated scales come from the workload
    runs: dict[str, list[dict]] = {f.label: [] for f in formats}
    for _ in range(repeats):  # alternate the formats, so that a busy moment costs all of them alike
        for f in formats:
            runs[f.label].append(serve(engines[f.label], prompts, max_tokens))
    rows = []
    reference_answers = runs[formats[0].label][0]["answers"]
    stop_ids = set(engines[formats[0].label].llm_engine.stop_rules.eos_token_ids)
    for f in formats:
        spec = engines[f.label].llm_engine.spec
        best = max(runs[f.label], key=lambda r: r["tokens_per_s"])
        blocks = engines[f.label].llm_engine.cache_manager.num_blocks
        rows.append(
            {
                "format": f.label,
                "kv_cache_dtype": f.kv_cache_dtype,
                "calculate_kv_scales": f.calculate_kv_scales,
                "storage": str(spec.dtype).removeprefix("torch."),
                "bytes_per_token": spec.bytes_per_token,
                "bytes_per_block": spec.bytes_per_block(block_size),
                "blocks": blocks,
                "max_length_requests": blocks // -(-max_model_len // block_size),
                **{k: v for k, v in best.items() if k != "answers"},
                "tokens_per_s_runs": [r["tokens_per_s"] for r in runs[f.label]],
                "agreement": agreement(reference_answers, best["answers"], stop_ids),
            }
        )
    s = reference_spec
    f32_blocks = KVCacheSpec(s.num_layers, s.num_kv_heads, s.head_dim, torch.float32).num_blocks_for_budget(
        budget, block_size
    )
    scoring = {f.label: make(f, window + 1, num_kv_blocks=2 * window // block_size + 2) for f in formats}
    error = text_error(scoring, model, tokenizer, text_tokens, window)
    for row in rows:
        row["error"] = error[row["format"]]
    return {
        "model": model_name,
        "dtype": str(model_dtype).removeprefix("torch."),
        "block_size": block_size,
        "budget_bytes": budget,
        "budget_blocks_of_reference": num_kv_blocks,
        "max_model_len": max_model_len,
        "num_requests": num_requests,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "window": window,
        "float32_blocks": f32_blocks,
        "rows": rows,
    }
