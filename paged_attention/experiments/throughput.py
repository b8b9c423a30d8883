"""Paging against contiguous memory, measured on this CPU (``bench throughput``, notebook 07).

The real engine serves the same requests with the real (embedded) model five times, with the same
KV bytes each time, changing only how that memory is managed:

* ``paged``: blocks of 16 on demand;
* ``max`` / ``pow2`` / ``oracle``: Orca's contiguous reservations (buddy placement), under the same
  continuous-batching scheduler;
* ``static``: max-length reservations and fixed batches that run until their longest member ends,
  the way ``model.generate`` serves a batch.

The requests are ShareGPT-like with every length scaled by ``max_model_len / 2048`` (OPT's
maximum), which keeps the proportions that decide how much a max-length reservation wastes; they
all wait from the start (an offline batch, as in vLLM's throughput benchmark). Decoding is greedy
with EOS ignored, so every manager does the same work and must produce the same tokens (checked).
The model runs in float32: in bfloat16, a different batch composition changes rounding enough to
flip near-tied greedy choices of the random-weight model, and the check would test rounding.
The default budget, 1,536 slots, fits three max-length reservations. How much of paging's larger
batch becomes a speedup depends on the machine: a CPU's step time grows with the batch, where a
GPU's decode step barely does (notebook 07; :func:`step_time_by_batch` measures it). With memory
for every request's max-length reservation, every manager runs the same batch at every step, and
what difference in tokens per second is left is the managers' own bookkeeping (and noise): at a
tight budget, the gain comes from the batch.
The score is output tokens per second of wall time, after one untimed warm-up run; each manager
runs ``repeats`` times, interleaved, and its fastest run counts. Run it on a quiet machine: with
two cores, any other busy process slows torch down several-fold. The figure:
:func:`paged_attention.viz.paper.throughput_figure`.
"""

from __future__ import annotations

import random
import time

import torch

from ..baselines.engines import baseline_engine
from ..engine.sample.sampling import RequestOutputKind, SamplingParams
from ..models import load_model
from . import paper
from .progress import progress as bar
from .traces import TraceRequest, synthetic_trace

FINAL_ONLY = RequestOutputKind.FINAL_ONLY  # one output per request, as LLM.generate

CONTENDERS = ("paged", "max", "pow2", "oracle", "static")


def scaled_trace(num_requests: int, max_model_len: int, seed: int) -> list[TraceRequest]:
    """ShareGPT-like requests with lengths scaled by ``max_model_len / 2048`` (OPT's maximum)."""
    scale = max_model_len / paper.MAX_MODEL_LEN
    trace = synthetic_trace("sharegpt", num_requests, None, seed)
    return [
        TraceRequest(max(1, round(r.prompt_len * scale)), max(1, round(r.output_len * scale))) for r in trace
    ]


def serve_once(
    model: torch.nn.Module, tokenizer: object, trace: list[TraceRequest], contender: str, kv_slots: int,
    max_model_len: int, seed: int,
) -> dict:  # fmt: skip
    """Run one contender over ``trace``; wall time, outputs and the running batch after each step."""
    engine = baseline_engine(
        model, tokenizer, num_kv_blocks=kv_slots // paper.BLOCK_SIZE, block_size=paper.BLOCK_SIZE,
        max_model_len=max_model_len, kv_manager="max" if contender == "static" else contender,
        static_batching=contender == "static",
    )  # fmt: skip
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    for i, r in enumerate(trace):
        prompt = [rng.randrange(3, vocab) for _ in range(r.prompt_len)]
        engine.add_request(
            str(i),
            prompt,
            SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True, output_kind=FINAL_ONLY),
        )
    outputs: dict[int, list[int]] = {}
    times, batch = [0.0], [0]
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[int(out.request_id)] = out.outputs[0].token_ids
        times.append(time.perf_counter() - start)
        batch.append(engine.last_step.num_scheduled_seqs)
    seconds = time.perf_counter() - start
    if engine.cache_manager.num_free_blocks != engine.cache_manager.num_blocks:
        raise RuntimeError(f"{contender}: KV memory was not all returned")
    return {
        "seconds": seconds,
        "outputs": [outputs[i] for i in range(len(trace))],
        "times": times,
        "batch": batch,
        "mean_batch": sum(batch[1:]) / max(1, len(batch) - 1),
        "steps": len(batch) - 1,
    }


def run(
    num_requests: int = 128,
    kv_slots: int = 1536,
    max_model_len: int = 512,
    repeats: int = 2,
    seed: int = 0,
    contenders: tuple[str, ...] = CONTENDERS,
    progress: bool = False,
    model_name: str | None = None,
    dtype: str = "float32",
) -> dict:
    """Output tokens/s per contender (best of ``repeats``), ratios to paged, and batch timelines."""
    model, tokenizer = load_model(model_name, dtype=dtype)
    trace = scaled_trace(num_requests, max_model_len, seed)
    output_tokens = sum(r.output_len for r in trace)
    serve_once(model, tokenizer, trace[:4], "paged", kv_slots, max_model_len, seed)  # warm-up, untimed
    best: dict[str, dict] = {}
    for _, contender in bar([(i, c) for i in range(repeats) for c in contenders], progress, "throughput"):
        r = serve_once(model, tokenizer, trace, contender, kv_slots, max_model_len, seed)
        if contender not in best or r["seconds"] < best[contender]["seconds"]:
            best[contender] = r
    reference = best[contenders[0]]["outputs"]
    return {
        "setup": {
            "num_requests": num_requests,
            "kv_slots": kv_slots,
            "max_model_len": max_model_len,
            "repeats": repeats,
            "seed": seed,
            "output_tokens": output_tokens,
            "mean_prompt": sum(r.prompt_len for r in trace) / len(trace),
            "mean_output": output_tokens / len(trace),
            "torch_threads": torch.get_num_threads(),
        },
        "tokens_per_s": {c: output_tokens / r["seconds"] for c, r in best.items()},
        "paged_speedup": {c: r["seconds"] / best["paged"]["seconds"] for c, r in best.items()}
        if "paged" in best
        else {},
        "mean_batch": {c: r["mean_batch"] for c, r in best.items()},
        "steps": {c: r["steps"] for c, r in best.items()},
        "same_outputs": {c: r["outputs"] == reference for c, r in best.items()},
        "timeline": {c: {"seconds": r["times"], "batch": r["batch"]} for c, r in best.items()},
    }


BATCH_BINS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, 1 << 30))


def step_time_by_batch(payload: dict, bins: tuple[tuple[int, int], ...] = BATCH_BINS) -> list[dict]:
    """Wall time per step against the running batch, pooled over every contender's timeline.

    One row per bin ``(lo, hi)`` of batch sizes that some step had: ``steps`` (how many),
    ``mean_batch``, ``ms_per_step`` and ``seqs_per_s`` (sequences served per second of those steps,
    ``mean_batch / step time``). Steps that prefill a prompt chunk are included, so they are not
    pure decode steps. Timings: as noisy as the run they come from.
    """
    pairs = []
    for timeline in payload["timeline"].values():
        times, batch = timeline["seconds"], timeline["batch"]
        pairs += [(batch[i], times[i] - times[i - 1]) for i in range(1, len(times)) if batch[i] > 0]
    rows = []
    for lo, hi in bins:
        inside = [(b, t) for b, t in pairs if lo <= b <= hi]
        if inside:
            mean_batch = sum(b for b, _ in inside) / len(inside)
            seconds = sum(t for _, t in inside) / len(inside)
            rows.append({"batch": (lo, hi), "steps": len(inside), "mean_batch": mean_batch,
                         "ms_per_step": 1000 * seconds, "seqs_per_s": mean_batch / seconds})  # fmt: skip
    return rows
