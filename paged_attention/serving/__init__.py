"""The OpenAI-compatible server over the engine (what ``vllm serve`` is to vLLM).

    protocol   the request bodies (pydantic, strict types) and their SamplingParams
    responses  engine deltas as OpenAI's responses and stream chunks
    errors     OpenAI's error body; which field an engine error is about
    metrics    GET /metrics: the engine's metrics in Prometheus' format, vLLM's names
    authentication  --api-key: the /v1 routes ask for a bearer key, as vLLM's
    tools      tool_choice checked as vLLM checks it; Hermes tool calls parsed, or forced by a grammar
    responses_api  POST /v1/responses for text: the response object and its typed stream events
    streams    a request's prompts added, their streams merged, aborted when the client goes away
    api_server the FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /tokenize
    launch     running it: in the foreground, in a thread (tests), as a child process (notebooks)

The front it serves through, :class:`~paged_attention.engine.async_llm.AsyncLLM`, is the
engine's (vLLM's ``vllm/v1/engine/async_llm.py``).

Serving sits on the engine (``models <- engine <- serving``); it chooses nothing about memory:
the engine it is handed brings its cache manager (paged, or a contiguous baseline).
"""

from ..engine.async_llm import AsyncLLM, EngineOverloaded, RequestAborted, RequestStream
from ..engine.core_client import EngineDeadError
from .api_server import build_app
from .launch import ServerProcess, ServerThread, free_port

__all__ = [
    "AsyncLLM",
    "EngineDeadError",
    "EngineOverloaded",
    "RequestAborted",
    "RequestStream",
    "ServerProcess",
    "ServerThread",
    "build_app",
    "free_port",
]
