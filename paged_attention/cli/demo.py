"""``python -m paged_attention demo``: the main job: paged against contiguous KV memory on a real model.

SmolLM2-135M-Instruct (fetched and converted at install) answers a batch of real questions twice,
with the same model, the same prompts, greedy decoding and the *same KV-cache bytes*:

* **contiguous**: each request reserves its whole range up front, the model's maximum length
  (``--max-model-len``), as serving systems did before PagedAttention (the paper's "Max" Orca);
* **paged**: each request takes 16-token blocks as its tokens arrive (this package's engine).

The budget is chosen so that the choice matters: it holds only a few max-length reservations, but
many requests' actual tokens. The demo prints, side by side, how many requests ran at once, output
tokens per second, how much of the KV memory held token states (rather than reserved or free slots),
preemptions, and whether the two runs wrote the same tokens; then a few of the answers. Prefix
caching is off in both, so the memory layout is the only difference. ``--model tiny`` runs the old
demo on the embedded random model instead (seconds; gibberish text, real memory behaviour).

The model runs in what ``dtype="auto"`` picks (printed): bfloat16 on a CPU that multiplies it
faster, else float32 (:mod:`paged_attention.models.cpu_dtype`). The two runs batch requests
differently, and a product's rounding can depend on how many rows it multiplies: in bfloat16 a
near-tie between two tokens can then flip, and the runs part ways. So the demo runs both engines
batch-invariant (:mod:`paged_attention.models.invariant`): a token's result does not depend on what
shares its step, and the two runs must write the same tokens. ``--no-batch-invariant`` runs the
engines' fast default, in which a few bfloat16 answers may differ.
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from ..baselines.engines import baseline_engine
from ..engine.chat import render_chat
from ..engine.sample.sampling import RequestOutputKind, SamplingParams
from ..experiments.prompts import QUESTIONS
from ..experiments.provenance import provenance
from ..models import explain_dtype, load_model
from ..models.pretrained import SMOLLM2, find_pretrained
from ..viz.readme_results import DEMO_ROWS
from ._threads import set_threads
from .bench._results import write_results


def _serve(engine, prompts: list[dict], params: SamplingParams, label: str) -> dict:
    """Serve every prompt to the end through the public streaming step; measure as it goes."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outputs, batch, token_share = {}, [], []
    start = time.perf_counter()
    with tqdm(total=len(prompts), desc=f"{label:>10}", unit="req", leave=True) as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[int(out.request_id)] = out
                    bar.update(1)
            step = engine.last_step
            if step.num_scheduled_seqs:
                batch.append(step.num_scheduled_seqs)
                report = engine.cache_manager.memory_report()
                token_share.append(report.token_slots / report.total_slots)
    seconds = time.perf_counter() - start
    ordered = [outputs[i] for i in range(len(prompts))]
    tokens = sum(len(o.outputs[0].token_ids) for o in ordered)
    return {
        "outputs": ordered,
        "seconds": seconds,
        "output_tokens": tokens,
        "tokens_per_second": tokens / seconds,
        "peak_running": max(batch),
        "mean_running": sum(batch) / len(batch),
        "token_share": sum(token_share) / len(token_share),
        "preemptions": engine.scheduler.num_preemptions,
        "steps": len(batch),
        "all_free": engine.cache_manager.num_free_blocks == engine.cache_manager.num_blocks,
    }


def run_demo(
    num_requests: int = 16,
    num_kv_blocks: int = 64,
    block_size: int = 16,
    max_model_len: int = 256,
    max_tokens: int = 48,
    threads: int | None = None,
    model: str = SMOLLM2.name,
    show: int = 3,
    dtype: str = "auto",
    save: bool = False,
    batch_invariant: bool = True,
) -> dict:
    """Run the comparison (see the module docstring) and print it; returns both runs' numbers."""
    if not 1 <= num_requests <= len(QUESTIONS):
        raise ValueError(f"num_requests must be 1..{len(QUESTIONS)}, got {num_requests}")
    threads = set_threads(threads)
    model = find_pretrained(model).name if find_pretrained(model) else model
    start = time.perf_counter()
    hf_model, tokenizer = load_model(model, dtype)
    loaded = time.perf_counter() - start
    served = next(hf_model.parameters()).dtype
    prompts = [render_chat(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS[:num_requests]]
    slots = num_kv_blocks * block_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.FINAL_ONLY)
    print(
        f"model: {model} ({sum(p.numel() for p in hf_model.parameters()) / 1e6:.0f}M parameters, "
        f"loaded in {loaded:.1f} s), torch threads: {threads}\ndtype: {explain_dtype(model, dtype)}\n"
        f"{num_requests} chat prompts ({min(len(p['prompt_token_ids']) for p in prompts)}-"
        f"{max(len(p['prompt_token_ids']) for p in prompts)} tokens), greedy, up to {max_tokens} "
        f"output tokens each\nKV budget for both: {slots} token slots ({num_kv_blocks} blocks x "
        f"{block_size}); contiguous reserves max_model_len={max_model_len} slots per request\n"
        + (
            "batch-invariant: on (a token's sums do not depend on what shares its step: both runs must "
            "write the same tokens)"
            if batch_invariant
            else "batch-invariant: off (faster; a product's rounding may depend on how many rows it has)"
        )
    )
    runs = {}
    for label, manager in (("contiguous", "max"), ("paged", "paged")):
        engine = baseline_engine(
            hf_model, tokenizer, kv_manager=manager, num_kv_blocks=num_kv_blocks, block_size=block_size,
            max_model_len=max_model_len, enable_prefix_caching=False, batch_invariant=batch_invariant,
        )  # fmt: skip
        runs[label] = _serve(engine, prompts, params, label)
    contiguous, paged = runs["contiguous"], runs["paged"]
    same = sum(
        a.outputs[0].token_ids == b.outputs[0].token_ids
        for a, b in zip(contiguous["outputs"], paged["outputs"], strict=True)
    )
    rows = DEMO_ROWS
    print(f"\n{'':34}{'contiguous':>12}{'paged':>10}")
    for name, key, fmt in rows:
        print(f"{name:34}{fmt.format(contiguous[key]):>12}{fmt.format(paged[key]):>10}")
    print(f"{'identical outputs':34}{f'{same}/{num_requests}':>22}")
    if same < num_requests and not batch_invariant and served in (torch.bfloat16, torch.float16):
        print(
            f"  (in {str(served).removeprefix('torch.')} a step's sums round differently when the batch\n"
            "   differs, so a near-tie between two tokens can flip; batch-invariant runs are identical)"
        )
    speedup = paged["tokens_per_second"] / contiguous["tokens_per_second"]
    print(f"\npaged: {speedup:.2f}x the throughput in the same KV memory; every block free again: "
          f"{paged['all_free'] and contiguous['all_free']}")  # fmt: skip
    for i in range(min(show, num_requests)):
        answer = paged["outputs"][i].outputs[0]
        print(f"\n> {QUESTIONS[i]}\n  {answer.text.strip()}  [{answer.finish_reason}]")
    print(
        "\nNext: `python -m paged_attention chat` to talk to it; `demo --model tiny` for the "
        "embedded model; `walkthrough` for the page tables step by step."
    )
    result = {"contiguous": contiguous, "paged": paged, "identical": same, "threads": threads}
    if save:
        numbers = [key for _, key, _ in rows] + ["output_tokens", "all_free"]
        payload = {
            "model": model, "dtype": explain_dtype(model, dtype), "threads": threads,
            "num_requests": num_requests, "max_tokens": max_tokens, "num_kv_blocks": num_kv_blocks,
            "block_size": block_size, "max_model_len": max_model_len, "load_seconds": loaded,
            "batch_invariant": batch_invariant,
            "prompt_tokens": [min(len(p["prompt_token_ids"]) for p in prompts),
                              max(len(p["prompt_token_ids"]) for p in prompts)],
            "runs": {label: {k: run[k] for k in numbers} for label, run in runs.items()},
            "identical": same, "speedup": speedup,
            "answers": [{"question": QUESTIONS[i], "text": paged["outputs"][i].outputs[0].text.strip(),
                         "finish_reason": paged["outputs"][i].outputs[0].finish_reason}
                        for i in range(min(show, num_requests))],
            **provenance(),
        }  # fmt: skip
        write_results("demo", payload, None)
    return result
