"""Our engine against transformers' own generation loops (``python -m paged_attention bench engine``).

Three ways to serve the same requests with the same model, timed in one run:

* ``paged-engine``: this package: continuous batching over paged KV memory;
* ``hf-static``: ``model.generate`` on padded batches of ``batch_size`` requests, as one would
  without a serving engine. A batch runs until its longest request is done, so short requests
  keep their seat (and their padded KV cache) while producing nothing useful;
* ``hf-continuous``: transformers' own continuous batching (``generate_batch``'s manager), fed the
  same per-request output lengths.

Every request asks for its own number of tokens (EOS ignored), so the work is identical; the score
is *useful* output tokens per second (:func:`compare` runs them). Memory is the same for the two
batched contenders: the paged engine gets exactly as many KV slots as one padded static batch holds
(``batch_size x (longest prompt + longest output)``), and fits as many sequences into them as their
actual lengths allow. That is the paper's argument in one number. :func:`run_paged` also measures
how much of our engine's step time goes to bookkeeping (scheduler, allocator, batch packing) rather
than to the model, at 32+ running sequences.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..engine.llm_engine import LLMEngine
from ..engine.sample.sampling import RequestOutputKind, SamplingParams
from ..models import load_model
from ..models.pretrained import find_pretrained

FINAL_ONLY = RequestOutputKind.FINAL_ONLY  # one output per request, as LLM.generate


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    num_requests: int,
    vocab_size: int,
    seed: int,
    prompt_lens: tuple[int, int] = (8, 64),
    output_lens: tuple[int, int] = (16, 128),
) -> Workload:
    """Seeded random-token prompts and output lengths, each uniform over its inclusive range."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, vocab_size) for _ in range(rng.randint(*prompt_lens))] for _ in range(num_requests)
    ]
    return Workload(prompts, [rng.randint(*output_lens) for _ in range(num_requests)])


def static_batch_slots(work: Workload, batch_size: int) -> int:
    """KV slots a padded static batch holds: every row as long as the longest prompt + longest output."""
    return batch_size * (max(map(len, work.prompts)) + max(work.output_lens))


def run_paged(
    model: torch.nn.Module, tokenizer: object, work: Workload, kv_slots: int, max_num_seqs: int
) -> dict:
    block_size = 16
    engine = LLMEngine(
        model,
        tokenizer,
        max_num_seqs=max_num_seqs,
        num_kv_blocks=kv_slots // block_size,
        block_size=block_size,
    )
    for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens, strict=True)):
        engine.add_request(
            str(i),
            prompt,
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, output_kind=FINAL_ONLY),
        )
    outputs, steps = {}, []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[int(out.request_id)] = out.outputs[0].token_ids
        steps.append(engine.last_step)
    seconds = time.perf_counter() - start
    peak = max(s.num_scheduled_seqs for s in steps)
    busy = [s for s in steps if s.num_scheduled_seqs >= min(32, peak)] or steps
    total = sum(s.seconds for s in busy)
    overhead = sum(s.schedule_seconds + s.prepare_seconds for s in busy) / total
    outside_forward = 1 - sum(s.forward_seconds for s in busy) / total
    return {
        "seconds": seconds,
        "outputs": [outputs[i] for i in range(len(work.prompts))],
        "overhead": overhead,
        "outside_forward": outside_forward,
        "busy_batch": min(s.num_scheduled_seqs for s in busy),
        "schedule_share": sum(s.schedule_seconds for s in busy) / total,
        "overhead_steps": len(busy),
        "steps": len(steps),
        "peak_batch": peak,
        "preemptions": engine.scheduler.num_preemptions,
    }


def run_hf_static(model: torch.nn.Module, pad_id: int, work: Workload, batch_size: int) -> dict:
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for first in range(0, len(work.prompts), batch_size):
        prompts = work.prompts[first : first + batch_size]
        lens = work.output_lens[first : first + batch_size]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        longest = max(lens)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad_id,
            )
        outputs += [row[width : width + n].tolist() for row, n in zip(out, lens, strict=True)]
    return {"seconds": time.perf_counter() - start, "outputs": outputs}


def run_hf_continuous(model: torch.nn.Module, work: Workload) -> dict:
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(work.output_lens), eos_token_id=-1)
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=config, warmup=False) as manager:
        for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens, strict=True)):
            manager.add_request(prompt, request_id=str(i), max_new_tokens=n, eos_token_id=-1)
        while len(outputs) < len(work.prompts):
            result = manager.get_result(timeout=60)
            if result is None:
                raise RuntimeError("transformers' continuous batching stopped answering")
            if result.is_finished():
                outputs[result.request_id] = list(result.generated_tokens)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "outputs": [outputs[str(i)] for i in range(len(work.prompts))]}


CONTENDERS = ("paged-engine", "hf-static", "hf-continuous")


def default_setup(model_name: str | None) -> dict:
    """Batch size, prompt and output length ranges and repeats: the issue's workload (one run each)
    for a real model, a smaller and repeated one for the embedded model."""
    real = find_pretrained(model_name) is not None
    return {
        "batch_size": 16 if real else 32,
        "prompt_lens": (16, 256) if real else (8, 64),
        "output_lens": (16, 256) if real else (16, 128),
        "repeats": 1 if real else 3,
    }


def load_models(
    model_name: str | None, dtype: str | None = None
) -> tuple[torch.nn.Module, object, torch.nn.Module]:
    """Our engine's model, its tokenizer, and a separate instance for transformers (our engine swaps
    the attention function of the one it serves), both in ``dtype`` (default: ``auto``)."""
    ours, tokenizer = load_model(model_name, dtype)
    theirs, _ = load_model(model_name, dtype)
    return ours, tokenizer, theirs


def has_continuous_batching(model: torch.nn.Module) -> bool:
    """Whether this transformers has continuous batching (``generate_batch``'s manager)."""
    return hasattr(model, "continuous_batching_context_manager")


def compare(
    ours: torch.nn.Module,
    tokenizer: object,
    theirs: torch.nn.Module,
    work: Workload,
    batch_size: int,
    max_num_seqs: int = 256,
    repeats: int = 1,
    skip: Sequence[str] = (),
    on_run: Callable[[str, dict | Exception], None] | None = None,
) -> dict[str, dict]:
    """Each contender not in ``skip`` over ``work``, ``repeats`` times interleaved (so that a noisy
    moment hurts every method alike); the fastest run of each counts.

    The paged engine gets the KV slots of one padded static batch (:func:`static_batch_slots`). A
    contender that raises is reported and dropped (it is someone else's code on a CPU).
    ``on_run(name, result or exception)`` is called after every run.
    """
    kv_slots = static_batch_slots(work, batch_size)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    contenders = {
        "paged-engine": lambda: run_paged(ours, tokenizer, work, kv_slots, max_num_seqs),
        "hf-static": lambda: run_hf_static(theirs, pad, work, batch_size),
        "hf-continuous": lambda: run_hf_continuous(theirs, work),
    }
    skipped = set(skip)
    results: dict[str, dict] = {}
    for _ in range(repeats):
        for name, run in contenders.items():
            if name in skipped:
                continue
            try:
                r = run()
            except Exception as err:
                skipped.add(name)
                if on_run:
                    on_run(name, err)
                continue
            if on_run:
                on_run(name, r)
            if name not in results or r["seconds"] < results[name]["seconds"]:
                results[name] = r
    return results


def same_outputs(result: dict, reference: dict) -> int:
    """How many requests got exactly the reference's tokens."""
    return sum(a == b for a, b in zip(result["outputs"], reference["outputs"], strict=True))
