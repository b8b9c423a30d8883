"""vLLM's tokenizer routes, with the front's own tokenizer: ``POST /tokenize`` (a prompt, or a
conversation rendered by the chat template, to token ids) and ``POST /detokenize`` (token ids back
to text); and :func:`render`, the chat template as the chat route uses it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter

from ..engine.chat import as_conversations, render_chat
from .errors import APIError
from .protocol import DetokenizeRequest, TokenizeRequest


def render(
    tokenizer: Any,
    messages: list,
    add_generation_prompt: bool,
    continue_final: bool,
    chat_template: str | None,
    kwargs: dict | None,
) -> dict:
    """A conversation as an engine prompt (text and ids), or a 400 naming ``messages``."""
    try:
        [conversation] = as_conversations(messages)
        return render_chat(
            tokenizer, conversation, add_generation_prompt, continue_final, chat_template, kwargs
        )
    except (ValueError, TypeError) as err:
        raise APIError(str(err), 400, "messages") from err


def tokenizer_routes(
    tokenizer: Any, chat_template: str | None, max_model_len: int, check_model: Callable[[str | None], None]
) -> APIRouter:
    """The two routes over ``tokenizer``; ``check_model`` refuses a request for another model."""
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", 400, "prompt")
        if body.messages is not None:
            rendered = render(
                tokenizer, body.messages, body.add_generation_prompt, False, chat_template, None
            )
            ids = rendered["prompt_token_ids"]
        else:
            ids = list(tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
        out = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
        return out

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(body.model)
        vocab = len(tokenizer)
        outside = [t for t in body.tokens if not 0 <= t < vocab]
        if outside:
            raise APIError(f"tokens must be ids in [0, {vocab}), got {outside[:5]}", 400, "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    return router
