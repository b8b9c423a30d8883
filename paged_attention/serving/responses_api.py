"""OpenAI's Responses API for text, ``POST /v1/responses``, as ``vllm serve`` 0.32 answers it.

A request is a conversation in another shape: ``instructions`` become the system message, ``input``
is a string (one user message) or a list of messages (``{"role", "content"}``, the content a string
or a list of ``{"type": "input_text" | "output_text", "text"}`` parts). The answer is a ``response``
object whose ``output`` holds one ``message`` item with one ``output_text`` part; ``status`` is
``"completed"``, or ``"incomplete"`` with ``incomplete_details: {"reason": "max_output_tokens"}``
when ``max_output_tokens`` cut it. Streamed, it is vLLM's sequence of typed events, each sent as
``event: <type>`` and ``data: <json>`` and numbered by ``sequence_number``: ``response.created``,
``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``, one
``response.output_text.delta`` per piece of text, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, ``response.completed`` (even when
incomplete, as vLLM), and no ``[DONE]``.

``text: {"format": ...}`` asks for structured output as the chat endpoints' ``response_format`` does
(``json_schema`` with its ``schema``, or ``json_object``). A client that goes away mid-stream has
its request aborted; an engine that fails mid-stream ends the stream with an ``error`` event. Like
vLLM without ``VLLM_ENABLE_RESPONSES_API_STORE``, nothing is stored: ``previous_response_id`` is a
404. Tools other than ``tool_choice: "none"`` are refused here (a 400).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from ..engine.async_llm import AsyncLLM
from ..engine.params import RequestOutputKind, SamplingParams
from ..engine.structured_output.params import StructuredOutputsParams
from .errors import APIError, engine_error
from .streams import add_all, disconnected, merged, until_disconnect
from .tokenization import render


class ResponsesRequest(BaseModel):
    """The fields of ``POST /v1/responses`` that a text answer reads (others are ignored)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    metadata: dict[str, Any] | None = None
    user: str | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}

    def constraint(self) -> StructuredOutputsParams | None:
        """``text.format`` as a constraint (``None`` for plain text)."""
        fmt = (self.text or {}).get("format") or {"type": "text"}
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        try:
            if kind == "text":
                return None
            if kind == "json_object":
                return StructuredOutputsParams(json_object=True)
            if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
                return StructuredOutputsParams(json=fmt["schema"])
        except (ValueError, TypeError) as err:
            raise APIError(str(err), 400, "text") from err
        raise APIError(
            "text.format must be {'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', "
            "'schema': {...}}",
            400,
            "text",
        )

    def messages(self) -> list[dict[str, Any]]:
        """The conversation: ``instructions`` as the system message, then ``input``."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            content = item.get("content")
            if "role" not in item or not isinstance(content, (str, list)):
                raise APIError(f"input[{i}] must be a message with a 'role' and a 'content'", 400, "input")
            if isinstance(content, list):
                texts = [p.get("text") for p in content if isinstance(p, dict)]
                if len(texts) != len(content) or any(not isinstance(t, str) for t in texts):
                    raise APIError(f"input[{i}]: every content part must carry its 'text'", 400, "input")
                content = "\n".join(texts)  # type: ignore[arg-type]
            messages.append({"role": item["role"], "content": content})
        return messages

    def sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        if self.previous_response_id is not None:  # vLLM's answer when nothing is stored
            raise APIError(f"Response with id '{self.previous_response_id}' not found.", 404, "response_id")
        if self.tools and self.tool_choice != "none":
            raise APIError(
                "tools are not supported on /v1/responses here (tool_choice 'none' only)", 400, "tools"
            )
        given = {k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p)) if v is not None}
        try:
            return SamplingParams(
                **{**{k: v for k, v in defaults.items() if k != "max_tokens"}, **given},
                max_tokens=self.max_output_tokens,
                output_kind=RequestOutputKind.DELTA,
                structured_outputs=self.constraint(),
            )
        except (ValueError, TypeError) as err:
            raise engine_error(err) from err


def responses_routes(
    llm: AsyncLLM,
    tokenizer: Any,
    chat_template: str | None,
    model_name: str,
    defaults: dict[str, Any],
    check_model: Callable[[str | None], None],
) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        check_model(body.model)
        params = body.sampling_params(defaults)
        prompt = render(tokenizer, body.messages(), True, False, chat_template, None)
        response = Answer(body, model_name)
        streams = await add_all(llm, [prompt], params, response.id, "input")
        if body.stream:
            return StreamingResponse(response.events(streams, raw), media_type="text/event-stream")

        async def gather() -> None:
            async for _, output in merged(streams):
                response.add(output)

        if not await until_disconnect(raw, gather, streams):
            return Response(status_code=499)
        return JSONResponse(response.body("completed"))

    return router


class Answer:
    """One response as it is generated: its text, its token counts, its body and its events."""

    def __init__(self, request: ResponsesRequest, model_name: str) -> None:
        self.request, self.model = request, model_name
        self.id = f"resp_{secrets.token_hex(8)}"
        self.item_id = f"msg_{secrets.token_hex(8)}"
        self.created_at = int(time.time())
        self.text = ""
        self.input_tokens = self.output_tokens = 0
        self.finish_reason: str | None = None
        self.sequence = 0

    def add(self, output: Any) -> str:
        """Take one engine delta; returns its new text."""
        self.input_tokens = len(output.prompt_token_ids)
        delta = output.outputs[0]
        self.output_tokens += len(delta.token_ids)
        self.text += delta.text
        self.finish_reason = delta.finish_reason or self.finish_reason
        return delta.text

    def item(self, status: str) -> dict[str, Any]:
        content = [self.part()] if self.text and status != "in_progress" else []
        return {
            "type": "message",
            "id": self.item_id,
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def body(self, status: str) -> dict[str, Any]:
        """The ``response`` object (``status`` ``"completed"`` turns ``"incomplete"`` if cut short)."""
        request, done = self.request, status == "completed"
        incomplete = done and self.finish_reason == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": "incomplete" if incomplete else status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "tools": request.tools or [],
            "tool_choice": request.tool_choice,
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": None,
            "store": False,
            "text": request.text or {"format": {"type": "text"}},
            "truncation": "disabled",
            "metadata": request.metadata,
            "user": request.user,
            "output": [self.item("completed")] if done else [],
            "usage": self.usage() if done else None,
        }

    def usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens + self.output_tokens,
        }

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async def events(self, streams: list, raw: Request) -> AsyncIterator[str]:
        """vLLM's streamed events (see the module docstring); the stream is closed whatever ends it,
        a client that goes away included."""
        at = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        watcher = asyncio.ensure_future(disconnected(raw))
        watcher.add_done_callback(lambda w: w.cancelled() or [s.close() for s in streams])
        try:
            yield self.event("response.created", response=self.body("in_progress"))
            yield self.event("response.in_progress", response=self.body("in_progress"))
            yield self.event("response.output_item.added", output_index=0, item=self.item("in_progress"))
            empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield self.event("response.content_part.added", **at, part=empty)
            async for _, output in merged(streams):
                text = self.add(output)
                if text:
                    yield self.event("response.output_text.delta", **at, delta=text, logprobs=[])
            yield self.event("response.output_text.done", **at, text=self.text, logprobs=[])
            yield self.event("response.content_part.done", **at, part=self.part())
            yield self.event("response.output_item.done", output_index=0, item=self.item("completed"))
            yield self.event("response.completed", response=self.body("completed"))
        except (APIError, RuntimeError) as err:  # the engine failed mid-stream: say so in the stream
            yield self.event("error", code=str(getattr(err, "status", 500)), message=str(err), param=None)
        finally:
            watcher.cancel()
            for stream in streams:
                stream.close()
