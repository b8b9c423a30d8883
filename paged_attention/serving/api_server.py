"""The OpenAI-compatible HTTP server (FastAPI + uvicorn, the stack of ``vllm serve``).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream with server-sent
events when ``"stream": true``, ending with ``data: [DONE]``), ``POST /v1/responses``
(:mod:`.responses_api`), ``GET /v1/models``, ``GET /health``,
``POST /tokenize`` and ``POST /detokenize`` (:mod:`.tokenization`), ``GET /metrics`` (Prometheus),
``GET /version``.

The path of one request: the body is checked (:mod:`.protocol`); a chat is rendered by the chat
template with the front's own tokenizer (vLLM's front process has its own too); each prompt is
added to the engine through :class:`~..engine.async_llm.AsyncLLM` (one engine request per prompt, ``n``
samples each); the engine's deltas become OpenAI chunks (:mod:`.responses`). A client that goes
away mid-request (streaming or not) has its requests aborted before the next step. Every refusal
is OpenAI's error body (:mod:`.errors`): 400 for a bad field (named in ``param``), 404 for an
unknown model or route, 503 when ``max_waiting`` requests are already waiting.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .. import __version__
from ..engine.async_llm import AsyncLLM, RequestStream
from ..engine.params import SamplingParams
from .authentication import AuthenticationMiddleware
from .errors import APIError, error_body
from .metrics import CONTENT_TYPE, prometheus_text
from .protocol import ChatCompletionRequest, CompletionRequest
from .responses import Choice, Prompt, envelope, new_id, prompt_logprobs_json, usage
from .responses_api import responses_routes
from .streams import add_all, disconnected, merged, sse, until_disconnect
from .tokenization import render, tokenizer_routes

log = logging.getLogger("paged_attention.serving")


def build_app(
    llm: AsyncLLM,
    model_name: str,
    chat_template: str | None = None,
    api_keys: Sequence[str] = (),
    tool_parser: str | None = None,
) -> FastAPI:
    """The server's app over ``llm`` (started and stopped with the app's lifespan), answering to
    ``model_name``; ``chat_template`` replaces the tokenizer's own (needed by models without one);
    with ``api_keys``, the ``/v1`` routes ask for one of them (:mod:`.authentication`); with
    ``tool_parser`` (``"hermes"``), chats with ``tools`` are answered with tool calls (:mod:`.tools`)."""
    tokenizer = copy.deepcopy(llm.tokenizer)  # the front's own (a core on a thread uses its copy)
    defaults = dict(llm.sampling_defaults)
    max_model_len = llm.max_model_len

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await llm.start()
        try:
            yield
        finally:
            await llm.shutdown()

    app = FastAPI(title="paged-attention", version=__version__, lifespan=lifespan)
    if api_keys:
        app.add_middleware(AuthenticationMiddleware, keys=list(api_keys))
    app.state.llm = llm
    app.state.model_name = model_name

    # -- errors: always OpenAI's body ----------------------------------------------------------------
    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        return JSONResponse(_validation_body(err), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, err: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(err.detail), err.status_code), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def internal(_: Request, err: Exception) -> JSONResponse:  # pragma: no cover - a bug
        log.exception("internal error")
        return JSONResponse(error_body(f"internal error: {type(err).__name__}: {err}", 500), status_code=500)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(
                f"The model `{name}` does not exist (this server serves `{model_name}`).", 404, "model"
            )

    # -- the OpenAI routes ------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "paged-attention",
            "root": model_name,
            "parent": None,
            "max_model_len": max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        params = body.to_sampling_params(defaults)
        prompts: list[Any] = body.prompts()
        records = [Prompt(tokenizer.decode, body.echo, body.echo_only) for _ in prompts]
        return await _serve(raw, llm, prompts, params, body, "cmpl", "text_completion", model_name, records)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        params = body.to_sampling_params(defaults, tool_parser)
        prompt = render(
            tokenizer,
            body.messages,
            body.add_generation_prompt,
            body.continue_final_message,
            chat_template,
            body.template_kwargs(),
        )
        records = [Prompt(tokenizer.decode)]
        calls = tool_parser is not None and body.tool_mode(tool_parser) not in (None, "none")
        return await _serve(
            raw, llm, [prompt], params, body, "chatcmpl", "chat.completion", model_name, records, calls
        )

    # -- vLLM's extra routes -------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if llm.is_running else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        records = await llm.call_utility("get_metrics")
        return Response(prometheus_text(records, model_name), media_type=CONTENT_TYPE)

    app.include_router(tokenizer_routes(tokenizer, chat_template, max_model_len, check_model))
    app.include_router(responses_routes(llm, tokenizer, chat_template, model_name, defaults, check_model))
    return app


def _validation_body(err: RequestValidationError) -> dict:
    """Pydantic's first complaint as OpenAI's error: the field (``param``) and what was wrong."""
    first = err.errors()[0] if err.errors() else {}
    if first.get("type") == "json_invalid":
        return error_body(f"the request body is not valid JSON: {first.get('msg', '')}", 400)
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # a union reports each branch it tried ("prompt.str", "prompt.list[int].0"): name the field
    field = loc[0] if loc else None
    given = first.get("input")
    shown = json.dumps(given)[:80] if given is not None else "nothing"
    where = ".".join(p for p in loc if not p.startswith(("str", "list[", "dict[", "int", "float", "bool")))
    return error_body(f"{where or 'the body'}: {first.get('msg', 'invalid')} (got {shown})", 400, field)


async def _serve(
    raw: Request,
    llm: AsyncLLM,
    prompts: list[Any],
    params: SamplingParams,
    body: CompletionRequest | ChatCompletionRequest,
    prefix: str,
    kind: str,
    model_name: str,
    records: list[Prompt],
    tool_calls: bool = False,
) -> Response:
    """Add every prompt, then stream or gather their outputs (see the module docstring);
    ``tool_calls``: parse each chat answer for tool calls (:mod:`.tools`)."""
    response_id = new_id(prefix)
    chat = kind == "chat.completion"
    streams = await add_all(llm, prompts, params, response_id, "messages" if chat else "prompt")
    choices = [
        Choice(
            i * params.n + j,
            chat,
            params.logprobs,
            records[i],
            tools=tool_calls,
            one_call=getattr(body, "parallel_tool_calls", None) is False,
        )
        for i in range(len(prompts))
        for j in range(params.n)
    ]
    prompt_tokens = [0] * len(prompts)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        events = _events(
            raw,
            streams,
            choices,
            prompt_tokens,
            params.n,
            response_id,
            kind + (".chunk" if chat else ""),
            model_name,
            include_usage,
            continuous,
        )
        return StreamingResponse(events, media_type="text/event-stream")

    async def gather() -> None:
        async for index, output in merged(streams):
            prompt_tokens[index] = len(output.prompt_token_ids)
            for delta in output.outputs:
                choices[index * params.n + delta.index].add(delta, output)

    if not await until_disconnect(raw, gather, streams):
        return Response(status_code=499)  # nginx's "client closed request": never sent, nobody reads it
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return JSONResponse(
        {
            **envelope(kind, response_id, model_name),
            "choices": [c.whole() for c in choices],
            "usage": usage(sum(prompt_tokens), completion_tokens),
            **({"prompt_logprobs": prompt_logprobs_json(records[0].prompt_logprobs)} if chat else {}),
        }
    )


async def _events(
    raw: Request,
    streams: list[RequestStream],
    choices: list[Choice],
    prompt_tokens: list[int],
    n: int,
    response_id: str,
    kind: str,
    model_name: str,
    include_usage: bool,
    continuous: bool,
) -> AsyncIterator[str]:
    """The server-sent events of a streamed response; the streams are closed (aborted if
    unfinished) whatever ends it, a client disconnect included."""
    head = envelope(kind, response_id, model_name)
    chat = kind.startswith("chat")
    watcher = asyncio.ensure_future(disconnected(raw))
    watcher.add_done_callback(lambda w: w.cancelled() or [s.close() for s in streams])
    role_due = chat
    try:
        async for index, output in merged(streams):
            if role_due:  # the assistant's role, one chunk per choice, with the first output (as vLLM)
                role_due = False
                for choice in choices:
                    role = {
                        "index": choice.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    yield sse({**head, "choices": [role]})
            prompt_tokens[index] = len(output.prompt_token_ids)
            for delta in output.outputs:
                choice = choices[index * n + delta.index]
                part = choice.add(delta, output)
                if part is None:
                    continue
                chunk = {**head, "choices": [part]}
                if continuous:  # vLLM's: the usage so far of this chunk's choice (its prompt, its tokens)
                    chunk["usage"] = usage(prompt_tokens[index], len(choice.token_ids))
                yield sse(chunk)
        if include_usage:
            yield sse(
                {
                    **head,
                    "choices": [],
                    "usage": usage(sum(prompt_tokens), sum(len(c.token_ids) for c in choices)),
                }
            )
    except (APIError, RuntimeError) as err:  # the engine failed mid-stream: say so in the stream
        yield sse(error_body(str(err), getattr(err, "status", 500)))
    finally:
        watcher.cancel()
        for stream in streams:
            stream.close()
    yield "data: [DONE]\n\n"
