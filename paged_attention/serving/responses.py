"""Engine outputs as OpenAI's response bodies and stream chunks (vLLM's shapes).

The engine streams each request as deltas (``RequestOutputKind.DELTA``): every step, the new text
and tokens of each of its samples. A :class:`Choice` gathers one sample's deltas and turns each into
what OpenAI's API sends: a ``text_completion`` / ``chat.completion.chunk`` choice while streaming,
or, at the end, the whole choice of a ``text_completion`` / ``chat.completion``. Choices are numbered
``prompt_index * n + sample_index``, as vLLM numbers them for a list of prompts.

A :class:`Prompt` per prompt holds what its request's first output said about the prompt, for all
its choices: vLLM's ``prompt_logprobs`` field, and ``echo`` (completions): a choice shows its
prompt before its output, and with ``logprobs`` the prompt's tokens carry theirs too (the first one
``None``: nothing predicts it), as vLLM answers lm-evaluation-harness's log-likelihood requests;
with ``max_tokens: 0`` only the prompt is shown.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine.outputs import CompletionOutput, RequestOutput
from ..engine.sample.logprobs import Logprob
from .tools import holding, parse_hermes

#: JSON has no -inf: a token the filters removed gets this log-probability (vLLM's value).
MIN_LOGPROB = -9999.0


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _value(logprob: Logprob) -> float:
    return max(logprob.logprob, MIN_LOGPROB)


def _token(token_id: int, logprob: Logprob) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else f"token_id:{token_id}"


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None] | None) -> list | None:
    """A request's prompt log-probabilities as vLLM's response field ``prompt_logprobs``."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": _value(lp), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items()
        }
        for entry in entries
    ]


@dataclass
class Prompt:
    """One prompt as its choices report it (see the module docstring), filled in from the outputs
    of its request (:meth:`see`)."""

    decode: Callable[[list[int]], str]  # the front's tokenizer: the first token's text
    show: bool = False  # echo: the choices show the prompt before their output
    only: bool = False  # echo with max_tokens 0: the prompt alone, the token generated for it hidden
    text: str | None = None
    token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def see(self, output: RequestOutput) -> None:
        if self.text is None:  # a token-id prompt has no text of its own: its tokens decoded
            self.token_ids = list(output.prompt_token_ids or [])
            self.text = output.prompt if output.prompt is not None else self.decode(self.token_ids)
        if output.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = output.prompt_logprobs

    @property
    def first_token(self) -> str:
        return self.decode(self.token_ids[:1])


@dataclass
class Choice:
    """One sample's progress: what was sent, what is new (see the module docstring)."""

    index: int
    chat: bool
    top_logprobs: int | None  # None: no logprobs asked for
    prompt: Prompt | None = None  # its prompt's record (shown first with echo)
    text: str = ""  # what the client was sent
    token_ids: list[int] = field(default_factory=list)  # generated (the usage counts them)
    shown_ids: list[int] = field(default_factory=list)  # the tokens of `text`: echoed prompt, output
    logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)  # one per shown token
    echoed: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    tools: bool = False  # parse Hermes tool calls from the answer (:mod:`.tools`)
    one_call: bool = False  # parallel_tool_calls false: only the first call is kept
    sent: int = 0  # with tools, streaming: the characters of `text` sent as content so far

    def add(self, delta: CompletionOutput, output: RequestOutput | None = None) -> dict[str, Any] | None:
        """Take one delta; return the stream chunk's choice for it (``None`` if it adds nothing:
        no text, no token and no finish). A token without text yet (part of a character, or text
        held back while it may begin a stop string) still gets its chunk, as in vLLM: its logprobs."""
        if self.prompt is not None and output is not None:
            self.prompt.see(output)
        first_text_offset = len(self.text)
        self.token_ids += delta.token_ids
        text, ids, new_logprobs = delta.text, list(delta.token_ids), list(delta.logprobs or [])
        echo = self.prompt if self.prompt is not None and self.prompt.show else None
        if echo is not None:
            if echo.only:
                text, ids, new_logprobs = "", [], []
            if not self.echoed:  # the prompt, with this choice's first output
                self.echoed = True
                prompt_entries = echo.prompt_logprobs or [None] * len(echo.token_ids)
                text = (echo.text or "") + text
                ids, new_logprobs = [*echo.token_ids, *ids], [*prompt_entries, *new_logprobs]
        self.text += text
        self.shown_ids += ids
        self.logprobs += new_logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        if not text and not ids and delta.finish_reason is None:
            return None
        logprobs = self._logprobs(ids, new_logprobs, first_text_offset)
        if self.chat and self.tools:
            return self._tool_chunk(delta, logprobs)
        if self.chat:
            return {
                "index": self.index,
                "delta": {"content": text} if text else {},
                "logprobs": logprobs,
                "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason,
            }
        return {
            "index": self.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }

    def whole(self) -> dict[str, Any]:
        """The finished choice of a non-streamed response."""
        logprobs = self._logprobs(self.shown_ids, self.logprobs, 0)
        base = {
            "index": self.index,
            "logprobs": logprobs,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }
        if self.chat and self.tools:
            content, calls = parse_hermes(self.text)
            calls = calls[:1] if self.one_call else calls
            if calls:  # vLLM: an empty string beside the calls, and the reason says so
                message = {"role": "assistant", "content": content or "", "tool_calls": calls}
                return {**base, "finish_reason": "tool_calls", "message": message}
        if self.chat:
            return {**base, "message": {"role": "assistant", "content": self.text}}
        prompt = self.prompt.prompt_logprobs if self.prompt is not None else None
        return {**base, "text": self.text, "prompt_logprobs": prompt_logprobs_json(prompt)}

    def _tool_chunk(self, delta: CompletionOutput, logprobs: Any) -> dict[str, Any]:
        """A streamed chunk when the answer may hold tool calls: text up to a ``<tool_call>`` is sent
        as content; the calls, whole, with the last chunk (``finish_reason`` ``"tool_calls"``); an
        answer whose calls do not parse sends the rest of its text as content instead."""
        reason = delta.finish_reason
        part: dict[str, Any] = {"index": self.index, "delta": {}, "logprobs": logprobs,
                                "finish_reason": reason, "stop_reason": delta.stop_reason}  # fmt: skip
        calls: list[dict] = []
        if delta.finish_reason is not None:
            _, calls = parse_hermes(self.text)
            calls = calls[:1] if self.one_call else calls
        end = holding(self.text) if delta.finish_reason is None or calls else len(self.text)
        if end > self.sent:
            part["delta"]["content"] = self.text[self.sent : end]
            self.sent = end
        if calls:
            part["delta"]["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            part["finish_reason"] = "tool_calls"
        return part

    def _logprobs(
        self, token_ids: list[int], entries: list[dict[int, Logprob] | None], text_offset: int
    ) -> Any:
        if self.top_logprobs is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(t, e) for t, e in zip(token_ids, entries, strict=True)]}
        tokens, values, tops, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries, strict=True):
            if entry is None:  # an echoed prompt's first token: nothing predicts it
                token = self.prompt.first_token if self.prompt is not None else f"token_id:{token_id}"
                tokens.append(token)
                values.append(None)
                tops.append(None)
                offsets.append(text_offset)
                text_offset += len(token)
                continue
            chosen = entry[token_id]
            tokens.append(_token(token_id, chosen))
            values.append(_value(chosen))
            # vLLM's rule for completions: the entry's first top_logprobs + 1 tokens, the chosen one first
            n = self.top_logprobs
            tops.append(
                {_token(t, lp): _value(lp) for i, (t, lp) in enumerate(entry.items()) if n < 0 or i <= n}
            )
            offsets.append(text_offset)
            text_offset += len(chosen.decoded_token or "")
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _top(self, entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
        """The ``top_logprobs`` most likely tokens of a position, most likely first."""
        ranked = sorted(entry.items(), key=lambda item: item[1].rank or 0)
        return [(t, lp) for t, lp in ranked if lp.rank is not None and lp.rank <= (self.top_logprobs or 0)]

    def _chat_entry(self, token_id: int, entry: dict[int, Logprob]) -> dict[str, Any]:
        def one(t: int, lp: Logprob) -> dict[str, Any]:
            text = _token(t, lp)
            return {"token": text, "logprob": _value(lp), "bytes": list(text.encode("utf-8"))}

        return {**one(token_id, entry[token_id]), "top_logprobs": [one(t, lp) for t, lp in self._top(entry)]}


def envelope(kind: str, response_id: str, model: str, created: int | None = None) -> dict[str, Any]:
    """The fields every response and chunk starts with."""
    return {"id": response_id, "object": kind, "created": created or int(time.time()), "model": model}
