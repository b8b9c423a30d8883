"""The OpenAI-compatible server over the engine (what ``vllm serve`` is to vLLM).

    protocol   the request bodies (pydantic, strict types) and their SamplingParams
    async_llm  AsyncLLM: one thread drives step(); outputs fan out to per-request streams
    responses  engine deltas as OpenAI's responses and stream chunks
    errors     OpenAI's error body; which field an engine error is about
    metrics    GET /metrics: the engine's metrics in Prometheus' format, vLLM's names
    authentication  --api-key: the /v1 routes ask for a bearer key, as vLLM's
    api_server the FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /tokenize
    launch     running it: in the foreground, in a thread (tests), as a child process (notebooks)

Serving sits on the engine (``models <- engine <- serving``); it chooses nothing about memory:
the engine it is handed brings its cache manager (paged, or a contiguous baseline).
"""

from .api_server import build_app
from .async_llm import AsyncLLM, EngineDead, EngineOverloaded, RequestAborted, RequestStream
from .launch import ServerProcess, ServerThread, free_port

__all__ = [
    "AsyncLLM",
    "EngineDead",
    "EngineOverloaded",
    "RequestAborted",
    "RequestStream",
    "ServerProcess",
    "ServerThread",
    "build_app",
    "free_port",
]
