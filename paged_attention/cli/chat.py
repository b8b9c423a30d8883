"""``python -m paged_attention chat``: talk to the real model in a terminal, watching its KV blocks.

Each line you type is a user message; the whole conversation so far is rendered by the model's chat
template and served by :class:`~paged_attention.engine.llm_engine.LLMEngine`, whose public streaming
``step()`` hands back only the new text each step (``RequestOutputKind.DELTA``), printed as it comes.
After each answer a status line shows the KV blocks the conversation held (its page table) and how
many of the cache's blocks were in use. With automatic prefix caching the next turn finds the
earlier turns' full blocks already computed, and prefills only what is new: the line says how many.
Reads stdin, so it also runs non-interactively: ``printf 'Hi\\n' | python -m paged_attention chat``.
An empty line or ``/exit`` ends it; ``/reset`` starts a new conversation.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

from ..engine.chat import render_chat
from ..engine.llm_engine import LLMEngine
from ..engine.sampling import RequestOutputKind, SamplingParams
from ._threads import set_threads


def chat_turn(
    engine: LLMEngine, conversation: list[dict[str, str]], params: SamplingParams, out: TextIO
) -> str:
    """Serve one turn, streaming its text to ``out``; returns the answer and prints the status line."""
    prompt = render_chat(engine.tokenizer, conversation)
    request_id = engine.add_request(None, prompt, params)
    seq = engine.sequences(request_id)[0]
    manager = engine.cache_manager
    text, num_tokens, blocks, peak_used, cached = [], 0, 0, 0, None
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            completion = output.outputs[0]
            out.write(completion.text)
            out.flush()
            text.append(completion.text)
            num_tokens += len(completion.token_ids)
            if cached is None:
                cached = output.num_cached_tokens if hasattr(output, "num_cached_tokens") else None
        if not seq.is_finished:  # its page table, while it still holds one
            blocks = len(manager.block_table(seq.seq_id))
        peak_used = max(peak_used, manager.num_blocks - manager.num_free_blocks)
    seconds = time.perf_counter() - start
    prompt_len = len(prompt["prompt_token_ids"])
    out.write(
        f"\n  [{num_tokens} tokens, {num_tokens / seconds:.1f} tokens/s | prompt {prompt_len} tokens | "
        f"KV: this conversation held {blocks} blocks of {manager.block_size} slots "
        f"({prompt_len + num_tokens} token states), cache {peak_used}/{manager.num_blocks} blocks in use]\n"
    )
    return "".join(text)


def run_chat(opts: argparse.Namespace, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout) -> None:
    threads = set_threads(opts.threads)
    engine = LLMEngine(opts.model, num_kv_blocks=opts.num_kv_blocks, seed=opts.seed)
    params = SamplingParams(
        temperature=opts.temperature, top_p=opts.top_p, max_tokens=opts.max_tokens, seed=opts.seed,
        output_kind=RequestOutputKind.DELTA,
    )  # fmt: skip
    interactive = stdin.isatty()
    out.write(
        f"chat with {opts.model} ({engine.cache_manager.num_blocks} KV blocks, torch threads "
        f"{threads}); empty line or /exit ends, /reset forgets\n"
    )
    system = [{"role": "system", "content": opts.system}] if opts.system else []
    conversation = list(system)
    while True:
        if interactive:
            out.write("you> ")
            out.flush()
        line = stdin.readline()
        if not line or not line.strip() or line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            conversation = list(system)
            out.write("  [new conversation]\n")
            continue
        if not interactive:
            out.write(f"you> {line.strip()}\n")
        conversation.append({"role": "user", "content": line.strip()})
        out.write("bot> ")
        answer = chat_turn(engine, conversation, params, out)
        conversation.append({"role": "assistant", "content": answer})
