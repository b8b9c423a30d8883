"""``python -m paged_attention bench engine``: our engine against transformers' own generation loops.

Three ways to serve the same requests with the same model, timed in one run:

* ``paged-engine``: this package: continuous batching over paged KV memory;
* ``hf-static``: ``model.generate`` on padded batches of ``--batch-size`` requests, as one would
  without a serving engine. A batch runs until its longest request is done, so short requests
  keep their seat (and their padded KV cache) while producing nothing useful;
* ``hf-continuous``: transformers' own continuous batching (``generate_batch``'s manager), fed the
  same per-request output lengths.

Every request asks for its own number of tokens (EOS ignored), so the work is identical; the score is
*useful* output tokens per second. Memory is the same for the two batched contenders: the paged
engine gets exactly as many KV slots as one padded static batch holds (``batch_size x (longest
prompt + longest output)``), and fits as many sequences into them as their actual lengths allow.
That is the paper's argument in one number. It also reports how much of our engine's step time goes
to bookkeeping (scheduler, allocator, batch packing) rather than to the model, at 32+ running
sequences.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import torch

from ...engine.llm_engine import LLMEngine
from ...engine.models import load_model
from ...engine.pretrained import find_pretrained
from ...engine.sampling import RequestOutputKind, SamplingParams
from .._threads import set_threads

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


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m paged_attention bench engine", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--model", default=None, help="checkpoint folder, cached hub name or smollm2 (default: embedded)"
    )
    parser.add_argument("--requests", type=int, default=64, help="fewer for a quick run")
    parser.add_argument("--batch-size", type=int, default=None, help="static batch size (sets the KV budget)")
    parser.add_argument("--prompt-lens", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    parser.add_argument("--output-lens", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="the paged engine's running-sequence cap"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=None, help="runs per method; the fastest counts")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: 2, 1 if busy)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["hf-static", "hf-continuous"])
    opts = parser.parse_args(args)
    real = find_pretrained(opts.model) is not None  # a real model: the workload, one run each
    batch_size = opts.batch_size or (16 if real else 32)
    prompt_lens = tuple(opts.prompt_lens or ((16, 256) if real else (8, 64)))
    output_lens = tuple(opts.output_lens or ((16, 256) if real else (16, 128)))
    repeats = opts.repeats or (1 if real else 3)
    threads = set_threads(opts.threads)
    ours_model, tokenizer = load_model(opts.model)
    hf_model, _ = load_model(opts.model)  # a separate instance: our engine swaps the attention function
    if not hasattr(hf_model, "continuous_batching_context_manager") and "hf-continuous" not in opts.skip:
        print("this transformers has no continuous batching (generate_batch): hf-continuous skipped")
        opts.skip.append("hf-continuous")
    work = make_workload(opts.requests, ours_model.config.vocab_size, opts.seed, prompt_lens, output_lens)
    print(
        f"model {opts.model or 'embedded'}: {opts.requests} requests, "
        f"prompts {prompt_lens[0]}-{prompt_lens[1]} tokens, outputs {output_lens[0]}-{output_lens[1]} "
        f"tokens, EOS ignored ({work.useful_tokens} in all), "
        f"static batch size {batch_size}, torch threads {threads}"
    )
    kv_slots = static_batch_slots(work, batch_size)
    print(f"KV budget of both batched methods: {kv_slots} token slots (one padded static batch)")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    contenders = {
        "paged-engine": lambda: run_paged(ours_model, tokenizer, work, kv_slots, opts.max_num_seqs),
        "hf-static": lambda: run_hf_static(hf_model, pad, work, batch_size),
        "hf-continuous": lambda: run_hf_continuous(hf_model, work),
    }
    results = {}
    for _ in range(repeats):  # interleaved, so that a noisy moment hurts every method alike
        for name, run in contenders.items():
            if name in opts.skip:
                continue
            try:
                r = run()
            except Exception as err:  # report and go on: it is someone else's code on a CPU
                print(f"{name} failed: {type(err).__name__}: {err}")
                opts.skip.append(name)
                continue
            print(f"  {name}: {r['seconds']:.1f} s")
            if name not in results or r["seconds"] < results[name]["seconds"]:
                results[name] = r
    ours = results["paged-engine"]
    print(f"\n{'method':>14} {'seconds':>8} {'useful tok/s':>13} {'paged-engine is':>16} {'same tokens':>12}")
    for name, r in results.items():
        same = sum(a == b for a, b in zip(r["outputs"], ours["outputs"], strict=True))
        print(
            f"{name:>14} {r['seconds']:>8.1f} {work.useful_tokens / r['seconds']:>13.0f} "
            f"{r['seconds'] / ours['seconds']:>15.2f}x {same:>6}/{len(work.prompts)}"
        )
    print(
        f"\npaged-engine: up to {ours['peak_batch']} sequences per step in that KV memory, "
        f"{ours['preemptions']} preemptions; best of {repeats} run(s) each, torch threads {threads}"
    )
    print(
        f"paged-engine overhead over the {ours['overhead_steps']} steps with >= {ours['busy_batch']} "
        f"sequences "
        f"({ours['steps']} steps in all): {ours['outside_forward']:.1%} of step time outside the model "
        f"forward; bookkeeping {ours['overhead']:.1%} (scheduler + allocator {ours['schedule_share']:.1%}, "
        f"batch packing {ours['overhead'] - ours['schedule_share']:.1%})"
    )
