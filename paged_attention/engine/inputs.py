"""Prompts as users write them (vLLM's forms) turned into token ids.

A prompt is a string, a list of token ids, or a dict with ``"prompt"`` or ``"prompt_token_ids"``
(both: the ids are served and the text is reported, as for ``LLM.chat``)
(and optionally ``"cache_salt"``: only requests with the same salt share prefix-cache blocks).
``LLM.generate`` takes one prompt or a list of them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from .params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Prompt = str | list[int] | dict[str, Any]


class TextPrompt(TypedDict, total=False):
    """vLLM's ``TextPrompt``: ``{"prompt": text}`` (a plain dict works the same; ``prompt`` is required)."""

    prompt: str
    cache_salt: str


class TokensPrompt(TypedDict, total=False):
    """vLLM's ``TokensPrompt``: ``{"prompt_token_ids": ids}`` (required), optionally with their text."""

    prompt_token_ids: list[int]
    prompt: str
    cache_salt: str


def as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a string, a dict, a list of token ids) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
    ):
        return [prompts]  # type: ignore[list-item]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (str, bytes)):
        raise TypeError(
            f"prompts must be a string, a list of token ids, or a list of those, got {type(prompts)}"
        )
    return list(prompts)


def tokenize(prompt: Prompt, tokenizer: PreTrainedTokenizerBase) -> tuple[str | None, list[int], str | None]:
    """``(text, token_ids, cache_salt)`` of one prompt; ``text`` is ``None`` for token ids."""
    cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    if isinstance(prompt, dict):
        text = prompt.get("prompt")
        if "prompt_token_ids" in prompt and isinstance(text, str):  # both (LLM.chat): keep the text
            _, ids, _ = tokenize(prompt["prompt_token_ids"], tokenizer)
            return text, ids, cache_salt
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise TypeError("a dict prompt needs a 'prompt' or 'prompt_token_ids' key")
    if isinstance(prompt, str):
        if not prompt:
            return prompt, [], cache_salt  # rejected by the caller, even if the tokenizer would add a BOS
        return prompt, list(tokenizer(prompt, add_special_tokens=True)["input_ids"]), cache_salt
    if isinstance(prompt, (list, tuple)) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return None, list(prompt), cache_salt
    raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")


def check_arrival_time(arrival_time: object) -> None:
    """``None`` (now) or a finite number of seconds."""
    if arrival_time is not None and (
        isinstance(arrival_time, bool)
        or not isinstance(arrival_time, (int, float))
        or not math.isfinite(arrival_time)
    ):
        raise TypeError(f"arrival_time must be a finite number of seconds or None, got {arrival_time!r}")


def check_prompt(
    token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> SamplingParams:
    """Reject what cannot be served; ``max_tokens=None`` becomes the room left (vLLM's rule)."""
    if not token_ids:
        raise ValueError("the prompt is empty: a request needs at least one prompt token")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got one out of range")
    for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
        ids = getattr(params, name) or ()
        if any(t >= vocab_size for t in ids):
            raise ValueError(f"{name} must be in [0, {vocab_size}) (token ids), got {sorted(ids)}")
    room = max_model_len - len(token_ids)
    if room < 1:
        raise ValueError(
            f"prompt of {len(token_ids)} tokens leaves no room to generate (max_model_len={max_model_len})"
        )
    if params.max_tokens is None:
        return dataclasses.replace(params, max_tokens=room)
    if params.max_tokens > room:
        raise ValueError(
            f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"max_model_len={max_model_len}"
        )
    return params


def check_logprobs(params: SamplingParams, max_logprobs: int) -> None:
    """``logprobs`` and ``prompt_logprobs`` may ask for at most the engine's ``max_logprobs`` top
    tokens (vLLM's rule; ``max_logprobs=-1`` allows the whole vocabulary, as does asking for -1 then)."""
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is None or max_logprobs == -1:
            continue
        if k == -1 or k > max_logprobs:
            raise ValueError(
                f"{name}={k} asks for more than max_logprobs={max_logprobs} tokens per position: "
                "ask for fewer, or build the engine with a larger max_logprobs (-1: no limit)"
            )
