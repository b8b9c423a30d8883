"""Speculative decoding measured: output tokens/s with and without n-gram drafts, side by side.

Two workloads on the real model: *grounded* work, where the answer copies from the prompt (repeat
or edit code, extract from a passage, answer by quoting it), which n-gram drafts live on, and
open-ended *chat* (:data:`~.prompts.QUESTIONS`), where drafts rarely match. Each at batch 1 (one
request at a time, the latency case) and at a larger batch. Every pair runs the same requests
greedily in the same process, one after the other, and must give identical tokens.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..engine.llm import LLM
from ..engine.params import SamplingParams
from .prompts import QUESTIONS

PASSAGE = (
    "PagedAttention stores the keys and values of each sequence in fixed-size blocks that need not "
    "be contiguous in memory. A block table maps each sequence's logical blocks to physical blocks, "
    "much as an operating system's page table maps virtual pages to frames. Because blocks are "
    "allocated on demand, a sequence wastes at most one partly filled block, and blocks can be "
    "shared between sequences: parallel samples and beams share their prompt, and a shared block is "
    "copied only when one of its owners writes into it."
)


def grounded_prompts() -> list[str]:
    """Requests whose answers copy from the prompt: code to repeat or edit, a passage to quote."""
    source = (Path(__file__).resolve().parents[1] / "engine" / "spec_decode" / "ngram.py").read_text()
    code = source[source.index("def propose") :]
    return [
        f"Repeat this Python function exactly, with no comment before or after it:\n\n{code}",
        f"Rewrite this function with `tokens` renamed to `ids`, changing nothing else:\n\n{code}",
        f"Copy the sentences of this passage that mention blocks, word for word:\n\n{PASSAGE}",
        f"Read this passage:\n\n{PASSAGE}\n\nHow does a block table work? Answer by quoting the passage.",
    ]


WORKLOADS = {"grounded": grounded_prompts, "chat": lambda: list(QUESTIONS[:8])}


def run(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy chat completions of ``prompts``; their tokens and the seconds they took."""
    messages = [[{"role": "user", "content": p}] for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    outputs = llm.chat(messages, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], time.perf_counter() - start


def compare(
    model: str,
    config: dict,
    batch_sizes: tuple[int, ...],
    max_tokens: int,
    num_kv_blocks: int = 256,
    dtype: str = "float32",
) -> list[dict]:
    """For each workload and batch size, the same requests with and without drafts: tokens/s of
    each, their ratio, identical outputs, and the drafts' acceptance. float32 by default, where the
    outputs must be identical: in bfloat16 the verification step's kernel (the prefill path) rounds
    near-ties differently from plain decoding, so outputs may part ways without any error."""
    common = {"max_model_len": 1024, "num_kv_blocks": num_kv_blocks, "dtype": dtype}
    engines = {
        batch: {
            "plain": LLM(model, max_num_seqs=batch, **common),
            "ngram": LLM(model, max_num_seqs=batch, speculative_config=config, **common),
        }
        for batch in batch_sizes
    }
    rows = []
    for workload, make in WORKLOADS.items():
        prompts = make()
        for batch in batch_sizes:
            plain, spec = engines[batch]["plain"], engines[batch]["ngram"]
            run(plain, prompts[:1], 4)  # warm both up (first forward, kernels, allocator)
            run(spec, prompts[:1], 4)
            before = spec.llm_engine.speculator.stats.copy()
            want, plain_seconds = run(plain, prompts, max_tokens)
            got, spec_seconds = run(spec, prompts, max_tokens)
            stats = spec.llm_engine.speculator.stats
            drafted = stats.num_draft_tokens - before.num_draft_tokens
            accepted = stats.num_accepted_tokens - before.num_accepted_tokens
            verifications = stats.num_drafts - before.num_drafts
            tokens = sum(len(t) for t in want)
            rows.append(
                {
                    "workload": workload,
                    "batch": batch,
                    "requests": len(prompts),
                    "output_tokens": tokens,
                    "plain_tokens_per_s": tokens / plain_seconds,
                    "ngram_tokens_per_s": sum(len(t) for t in got) / spec_seconds,
                    "speedup": plain_seconds / spec_seconds,
                    "identical": sum(a == b for a, b in zip(want, got, strict=True)),
                    "draft_tokens": drafted,
                    "accepted_tokens": accepted,
                    "acceptance_rate": accepted / drafted if drafted else None,
                    "mean_acceptance_length": 1 + accepted / verifications if verifications else None,
                }
            )
    return rows
