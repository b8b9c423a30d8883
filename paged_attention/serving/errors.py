"""OpenAI's error body, and which request field an engine error is about.

Every refusal the server gives is ``{"error": {"message", "type", "param", "code"}}`` with a 4xx or
5xx status (vLLM's shape: ``type`` is the name the ``openai`` client raises, ``code`` the status),
so a client sees *which* field was wrong and what is allowed, never a traceback.
"""

from __future__ import annotations

import re
from http import HTTPStatus

#: The exception names of the ``openai`` client, by status (vLLM's ``type`` values).
ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    413: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """A refusal with its HTTP status and the request field it is about (``param``, or ``None``)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param)


def error_body(message: str, status: int, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


_FIELD = re.compile(r"^(?:prompt \d+: )?([a-z_]+)")


def engine_error(err: ValueError | TypeError, prompt_field: str = "prompt") -> APIError:
    """A 400 for an error the engine raised while checking a request: ``param`` is the field its
    message starts with (the engine's errors name their argument first), or the prompt's field for
    errors about the prompt's length or tokens, or the cache (``max_tokens``/``n`` too large)."""
    message = str(err)
    found = _FIELD.match(message)
    word = found.group(1) if found else ""
    if word == "prompt" and "max_tokens" in message:  # prompt + max_tokens past max_model_len
        param: str | None = "max_tokens"
    elif word in {"the", "prompt"}:
        param = prompt_field
    elif word == "request" and "can never fit" in message:
        param = "max_tokens"
    elif word and word in _SAMPLING_FIELDS:
        param = word
    else:
        param = None
    return APIError(message, 400, param)


_SAMPLING_FIELDS = {
    "n",
    "best_of",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "bad_words",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "allowed_token_ids",
    "structured_outputs",
}
