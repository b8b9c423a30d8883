"""``python -m paged_attention demo --model tiny``: the demo on the embedded tiny model, in seconds.

The embedded tiny Llama (random weights, so its text
is gibberish; the memory behaviour is what matters) serves a seeded batch of prompts through the
continuous-batching engine on paged KV memory deliberately too small for all of them at once.
It prints what an operator watches: output tokens per second, how many sequences ran at the same
time, how often the scheduler had to preempt, and how full the KV cache was.
"""

from __future__ import annotations

import random
import time

from ..engine.llm_engine import LLMEngine
from ..engine.sample.sampling import RequestOutputKind, SamplingParams
from ..models import DEFAULT_MODEL_NAME

SENTENCE = (
    "the page table maps each logical block of a sequence to a physical block of the cache so memory "
    "is taken one block at a time as tokens arrive and returned the moment a request finishes"
)


def demo_requests(num_requests: int, seed: int) -> list[tuple[str, SamplingParams]]:
    """Seeded prompts of 4-40 words, each asking for 16-128 tokens."""
    rng = random.Random(seed)
    words = SENTENCE.split()
    requests = []
    for i in range(num_requests):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(4, 40)))
        params = SamplingParams(
            temperature=0.8, top_p=0.95, max_tokens=rng.randint(16, 128), seed=seed + i,
            output_kind=RequestOutputKind.FINAL_ONLY,  # a batch job: one output per request
        )  # fmt: skip
        requests.append((prompt, params))
    return requests


def run_tiny_demo(
    num_requests: int = 48, num_kv_blocks: int = 96, block_size: int = 16, seed: int = 0
) -> dict:
    from tqdm.auto import tqdm

    engine = LLMEngine(DEFAULT_MODEL_NAME, block_size=block_size, num_kv_blocks=num_kv_blocks, seed=seed)
    slots = num_kv_blocks * block_size
    mib = num_kv_blocks * engine.spec.bytes_per_block(block_size) / 2**20
    print(
        f"model: {DEFAULT_MODEL_NAME} (random weights), KV cache: {num_kv_blocks} blocks x {block_size} "
        f"slots = {slots} token slots ({mib:.1f} MiB)"
    )
    requests = demo_requests(num_requests, seed)
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    peak_running, usage, outputs = 0, [], {}
    start = time.perf_counter()
    with tqdm(total=num_requests, desc="requests", unit="req") as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = out
                bar.update(1)
            stats = engine.last_step
            peak_running = max(peak_running, stats.num_scheduled_seqs)
            usage.append(stats.kv_usage)
    seconds = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs.values())
    needed = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outputs.values())
    summary = {
        "requests": len(outputs),
        "output_tokens": out_tokens,
        "seconds": seconds,
        "output_tokens_per_second": out_tokens / seconds,
        "peak_running": peak_running,
        "preemptions": engine.scheduler.num_preemptions,
        "mean_kv_usage": sum(usage) / len(usage),
        "peak_kv_usage": max(usage),
        "steps": len(usage),
    }
    print(
        f"served {summary['requests']} requests, {out_tokens} output tokens in {seconds:.1f} s "
        f"({summary['output_tokens_per_second']:.0f} tokens/s on this machine) over {len(usage)} steps"
    )
    print(f"all of them at once would need {needed} token slots; the cache has {slots}")
    print(f"peak concurrent sequences: {peak_running}   preemptions: {summary['preemptions']}")
    print(f"KV cache blocks in use: mean {summary['mean_kv_usage']:.0%}, peak {summary['peak_kv_usage']:.0%}")
    print(f"every block is free again: {engine.cache_manager.num_free_blocks == num_kv_blocks}")
    first = outputs["0"]
    print(f"\nrequest 0: {first.prompt!r}\n  -> {first.outputs[0].text!r} ({first.outputs[0].finish_reason})")
    print("\nNext: `python -m paged_attention walkthrough` shows the page tables step by step.")
    return summary
