"""The request bodies of OpenAI's API as vLLM serves them, checked by pydantic, and their engine form.

Types are checked strictly (``"temperature": "0.7"`` is refused, as a number is asked for); values
are checked where the offline API checks them, by :class:`~paged_attention.engine.params.SamplingParams`
and ``LLMEngine.add_request``, so that the server and ``LLM.generate`` accept and refuse the same
things. Fields the server does not know are ignored, as vLLM ignores them; the ones it knows but
cannot honour (``suffix``) are refused by name; ``tools`` as ``vllm serve`` takes them (:mod:`.tools`).

Structured outputs: vLLM's ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``,
``json_object`` and its options) on both endpoints, and OpenAI's ``response_format`` (``text``,
``json_object``, ``json_schema``), which overrides the constraint of ``structured_outputs`` as vLLM's
``structured_outputs_from_response_format`` does.

Defaults: a field left out takes the model's generation-config default (``LLMEngine.sampling_defaults``,
vLLM's ``generation_config="auto"``), then vLLM's. ``max_tokens`` left out is 16 for completions
(OpenAI's default) and the room left in ``max_model_len`` for chat (vLLM's).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..engine.params import RequestOutputKind, SamplingParams
from ..engine.structured_output.params import CONSTRAINTS, StructuredOutputsParams
from . import tools
from .errors import APIError, engine_error


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False  # a last chunk with the whole request's usage, its choices empty
    continuous_usage_stats: bool = False  # in every chunk, its choice's usage so far (vLLM's)


class _Generation(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's log-probability and top ones
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice, grammar, json_object
    response_format: dict[str, Any] | None = None  # OpenAI's: text, json_object, json_schema

    def sampling_params(
        self, defaults: dict[str, Any], max_tokens: int | None, logprobs: int | None, **extra: Any
    ) -> SamplingParams:
        """The engine's parameters (streamed as deltas); a bad value is a 400 naming its field."""
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true", 400, "stream_options")
        given = self.model_dump(
            include={
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
                "seed",
            },
            exclude_none=True,
        )
        # the generation config's max_new_tokens is not used: a request's max_tokens is its own
        kwargs = {**{k: v for k, v in defaults.items() if k != "max_tokens"}, **given}
        try:
            return SamplingParams(
                **kwargs,
                n=self.n,
                max_tokens=max_tokens,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logit_bias=_logit_bias(self.logit_bias),
                logprobs=logprobs,
                output_kind=RequestOutputKind.DELTA,
                **{"structured_outputs": self.constraint(), **extra},
            )
        except (ValueError, TypeError) as err:
            raise engine_error(err) from err

    def constraint(self) -> StructuredOutputsParams | None:
        """``structured_outputs`` with ``response_format`` applied (see the module docstring)."""
        fields = dict(self.structured_outputs or {})
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(StructuredOutputsParams)})
        if unknown:
            raise APIError(f"structured_outputs has no field {', '.join(unknown)}", 400, "structured_outputs")
        param = "structured_outputs"
        kind = (self.response_format or {}).get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            raise APIError(
                f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                400,
                "response_format",
            )
        if kind != "text":
            param, fields = "response_format", {k: v for k, v in fields.items() if k not in CONSTRAINTS}
            if kind == "json_object":
                fields["json_object"] = True
            else:
                spec = (self.response_format or {}).get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                    raise APIError(
                        "response_format of type 'json_schema' needs a json_schema object with a 'schema'",
                        400,
                        "response_format",
                    )
                fields["json"] = spec["schema"]
        if not fields:
            return None
        try:
            return StructuredOutputsParams(**fields)
        except (ValueError, TypeError) as err:
            raise APIError(str(err), 400, param) from err


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``{"token id as a string": bias}`` as the engine's ``{token_id: bias}``."""
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        if not key.isdigit():
            raise APIError(f"logit_bias keys must be token ids (digits), got {key!r}", 400, "logit_bias")
        out[int(key)] = value
    return out


class CompletionRequest(_Generation):
    """``POST /v1/completions``: one prompt (a string or token ids) or a list of them."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    best_of: int | None = None
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | dict[str, list[int]]]:
        """The engine prompts: strings, or ``{"prompt_token_ids": [...]}`` for token ids."""
        if self.suffix is not None:
            raise APIError("suffix is not supported by this server", 400, "suffix")
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise APIError("prompt must not be an empty list", 400, "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [{"prompt_token_ids": list(prompt)}]  # type: ignore[arg-type]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)  # type: ignore[arg-type]
        if all(isinstance(p, list) for p in prompt):
            return [{"prompt_token_ids": p} for p in prompt]  # type: ignore[misc]
        raise APIError(
            "prompt must be a string, a list of strings, token ids, or lists of token ids", 400, "prompt"
        )

    def to_sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        """vLLM's rules for ``echo``: its prompt tokens carry the ``logprobs`` asked for (unless
        ``prompt_logprobs`` says otherwise), and ``max_tokens: 0`` generates one token, not shown."""
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        max_tokens = 1 if self.echo_only else self.max_tokens
        return self.sampling_params(
            defaults, max_tokens, self.logprobs, best_of=self.best_of, prompt_logprobs=prompt_logprobs
        )

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt (and its logprobs) alone."""
        return self.echo and self.max_tokens == 0


class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions``: a conversation, answered by the assistant."""

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def tool_mode(self, parser: str | None) -> str | dict | None:
        """The ``tool_choice`` in force, checked (:func:`.tools.check`): a 400 if the server cannot."""
        return tools.check(self.tools, self.tool_choice, parser)

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template is given beside the messages: ``chat_template_kwargs``, and the tools."""
        return {**(self.chat_template_kwargs or {}), **({"tools": self.tools} if self.tools else {})}

    def to_sampling_params(self, defaults: dict[str, Any], parser: str | None = None) -> SamplingParams:
        """A forced tool choice (``"required"``, or a named tool) constrains the answer to one call
        (:func:`.tools.forced_grammar`), as vLLM forces it, whatever ``response_format`` said."""
        choice = self.tool_mode(parser)
        extra: dict[str, Any] = {}
        if choice == "required" or isinstance(choice, dict):
            grammar = tools.forced_grammar(self.tools or [], choice)
            extra["structured_outputs"] = StructuredOutputsParams(grammar=grammar)
        if self.top_logprobs and not self.logprobs:
            raise APIError("top_logprobs needs logprobs set to true", 400, "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        prompt_logprobs = self.prompt_logprobs
        return self.sampling_params(defaults, max_tokens, logprobs, prompt_logprobs=prompt_logprobs, **extra)


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a prompt, or a conversation rendered by the chat template."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    tokens: list[int]
