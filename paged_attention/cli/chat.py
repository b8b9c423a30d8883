"""``python -m paged_attention chat``: talk to the real model in a terminal, watching its KV blocks.

Each line you type is a user message; the whole conversation so far is rendered by the model's chat
template (a plain ``role: content`` one, said so on screen, for a model without one, such as the
embedded ``paged-attention/tiny-llama``) and served by :class:`~paged_attention.engine.llm_engine.LLMEngine`,
whose public streaming ``step()`` hands back only the new text each step (``RequestOutputKind.DELTA``),
printed as it comes. After each answer a status line shows the KV blocks the conversation held (its
page table), how many of the cache's blocks were in use, and how many prompt tokens came from the
prefix cache (``RequestOutput.num_cached_tokens``): with automatic prefix caching the next turn finds
the earlier turns' full blocks already computed, and prefills only what is new.

What a chat UI does at the edges, so nothing is lost and nothing crashes:

* too long: when the rendered prompt plus ``--max-tokens`` would pass ``engine.max_model_len``, the
  oldest turns (a user message and its answer) are dropped, the system message kept, and the screen
  says how many; a message that cannot fit even alone is refused, and the conversation stays as it was.
* bytes that are not UTF-8 are read as U+FFFD (``errors="replace"``), with a notice.
* Ctrl-C while an answer streams cancels it: the request is aborted (its blocks freed; a step is a
  transaction, so the engine stays usable), and neither the half answer nor the message that asked
  for it joins the conversation. Ctrl-C at the prompt, an empty line, ``/exit`` or EOF end the chat.

Reads stdin, so it also runs non-interactively: ``printf 'Hi\\n' | python -m paged_attention chat``.
``/reset`` starts a new conversation.
"""

from __future__ import annotations

import argparse
import io
import re
import sys
import time
from typing import Any, TextIO

from ..engine.chat import PLAIN_TEMPLATE, render_chat
from ..engine.engine_core import kv_description
from ..engine.llm_engine import LLMEngine
from ..engine.sample.sampling import RequestOutputKind, SamplingParams
from ._threads import set_threads

Message = dict[str, str]

_SURROGATES = re.compile("[\ud800-\udfff]")  # undecodable bytes read with errors="surrogateescape"


def fit_prompt(
    engine: LLMEngine,
    system: list[Message],
    history: list[Message],
    message: Message,
    max_tokens: int,
    template: str | None = None,
) -> tuple[dict[str, Any] | None, int]:
    """Render ``system + history + [message]``, dropping the oldest turns (user message and answer)
    of ``history`` until the prompt plus ``max_tokens`` fits ``engine.max_model_len``.

    Returns ``(prompt, turns dropped)``, or ``(None, prompt tokens)`` when even the system message
    and ``message`` alone are too long."""
    for start in range(0, len(history) + 1, 2):
        prompt = render_chat(engine.tokenizer, [*system, *history[start:], message], chat_template=template)
        if len(prompt["prompt_token_ids"]) + max_tokens <= engine.max_model_len:
            return prompt, start // 2
    return None, len(prompt["prompt_token_ids"])


def chat_turn(engine: LLMEngine, prompt: dict[str, Any], params: SamplingParams, out: TextIO) -> str | None:
    """Serve one turn, streaming its text to ``out`` and printing the status line; returns the answer,
    or ``None`` if the engine refused the request. An exception while it streams (Ctrl-C) aborts
    the request, freeing its blocks, and reaches the caller."""
    try:
        request_id = engine.add_request(None, prompt, params)
    except ValueError as err:  # e.g. it could never fit the KV cache: said, and nothing sent
        out.write(f"\n  [not sent: {err}]\n")
        return None
    seq = engine.sequences(request_id)[0]
    manager = engine.cache_manager
    text: list[str] = []
    num_tokens, blocks, peak_used = 0, 0, 0
    cached: int | None = None  # RequestOutput.num_cached_tokens: prompt tokens from the prefix cache
    start = time.perf_counter()
    try:
        while request_id in engine.request_ids:
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                completion = output.outputs[0]
                out.write(completion.text)
                out.flush()
                text.append(completion.text)
                num_tokens += len(completion.token_ids)
                cached = output.num_cached_tokens
            if not seq.is_finished:  # its page table, while it still holds one
                blocks = len(manager.block_table(seq.seq_id))
            peak_used = max(peak_used, manager.num_blocks - manager.num_free_blocks)
    except BaseException:  # Ctrl-C (KeyboardInterrupt) above all: the request must not stay behind
        if request_id in engine.request_ids:  # not finished by the step that was interrupted
            engine.abort_request(request_id)
        raise
    seconds = time.perf_counter() - start
    prompt_len, from_cache = len(prompt["prompt_token_ids"]), "?" if cached is None else cached
    out.write(
        f"\n  [{num_tokens} tokens, {num_tokens / seconds:.1f} tokens/s | prompt {prompt_len} tokens, "
        f"{from_cache} prompt tokens from the prefix cache | KV: this conversation held {blocks} blocks "
        f"of {manager.block_size} slots ({prompt_len + num_tokens} token states), cache "
        f"{peak_used}/{manager.num_blocks} blocks in use]\n"
    )
    return "".join(text)


def _read_line(stdin: TextIO) -> str:
    """The next line, stripped (``""`` at EOF), undecodable bytes (surrogate escapes) as U+FFFD."""
    return _SURROGATES.sub("\ufffd", stdin.readline()).strip()


def run_chat(
    opts: argparse.Namespace,
    stdin: TextIO | None = None,
    out: TextIO | None = None,
    engine: LLMEngine | None = None,
) -> None:
    """The chat loop over ``stdin`` (default ``sys.stdin``) and ``out`` (``sys.stdout``); ``engine``,
    if given, is used instead of building one from ``opts``."""
    stdin = sys.stdin if stdin is None else stdin
    out = sys.stdout if out is None else out
    for stream in (stdin, out):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="replace")
    threads = set_threads(opts.threads)
    if engine is None:
        engine = LLMEngine(opts.model, num_kv_blocks=opts.num_kv_blocks, seed=opts.seed,
                           max_model_len=opts.max_model_len, dtype=getattr(opts, "dtype", None))  # fmt: skip
    params = SamplingParams(
        temperature=opts.temperature, top_p=opts.top_p, max_tokens=opts.max_tokens, seed=opts.seed,
        output_kind=RequestOutputKind.DELTA,
    )  # fmt: skip
    template = None if getattr(engine.tokenizer, "chat_template", None) else PLAIN_TEMPLATE
    interactive = stdin.isatty()
    out.write(
        f"chat with {opts.model or 'the embedded model'} ({engine.cache_manager.num_blocks} KV blocks, "
        f"max_model_len={engine.max_model_len}, {kv_description(engine)}, "
        f"torch threads {threads}); empty line or /exit ends, "
        "/reset forgets\n"
    )
    if template is not None:
        out.write("  [this model has no chat template: each message is sent as 'role: content']\n")
    system: list[Message] = [{"role": "system", "content": opts.system}] if opts.system else []
    history: list[Message] = []  # user message, answer, user message, answer, ...
    while True:
        if interactive:
            out.write("you> ")
            out.flush()
        try:
            line = _read_line(stdin)
        except KeyboardInterrupt:  # Ctrl-C at the prompt: quit
            out.write("\n")
            break
        if not line or line == "/exit":
            break
        if line == "/reset":
            history = []
            out.write("  [new conversation]\n")
            continue
        if not interactive:
            out.write(f"you> {line}\n")
        if "\ufffd" in line:
            out.write("  [your input was not valid UTF-8: undecodable bytes were replaced with U+FFFD]\n")
        message = {"role": "user", "content": line}
        try:
            history = _turn(engine, system, history, message, params, template, out)
        except KeyboardInterrupt:  # the request is aborted; the conversation stays as it was
            out.write("\n  [answer cancelled]\n")


def _turn(
    engine: LLMEngine,
    system: list[Message],
    history: list[Message],
    message: Message,
    params: SamplingParams,
    template: str | None,
    out: TextIO,
) -> list[Message]:
    """Fit, serve and print one turn; the history after it (unchanged if it was not answered)."""
    assert params.max_tokens is not None
    prompt, dropped = fit_prompt(engine, system, history, message, params.max_tokens, template)
    if prompt is None:
        out.write(
            f"  [not sent: this message is {dropped} prompt tokens (with the system message), which with "
            f"max_tokens={params.max_tokens} exceeds max_model_len={engine.max_model_len}; the "
            "conversation is kept as it was]\n"
        )
        return history
    if dropped:
        out.write(f"  [dropped the {dropped} oldest turns to fit max_model_len={engine.max_model_len}]\n")
    out.write("bot> ")
    answer = chat_turn(engine, prompt, params, out)
    if answer is None:  # refused by the engine, said
        return history
    return [*history[2 * dropped :], message, {"role": "assistant", "content": answer}]
