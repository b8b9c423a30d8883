"""``--api-key``: the OpenAI routes answer only requests that carry one of the server's keys.

As vLLM's ``serve --api-key`` (read at 0.32.0): a request to a path under ``/v1`` must send
``Authorization: Bearer <key>`` with one of the keys, or it gets ``401 {"error": "Unauthorized"}``
and never reaches the engine. ``/health``, ``/version``, ``/tokenize`` and ``/metrics`` stay open
(a load balancer's probe and a Prometheus scrape carry no key), and so do CORS preflights
(``OPTIONS``). Without ``--api-key`` the environment variable ``VLLM_API_KEY`` is read, as vLLM does;
with neither, every route is open.

The keys are kept as SHA-256 digests and compared with :func:`secrets.compare_digest` against the
digest of what a request sends, every key each time, so the time an answer takes says nothing about
how much of a key a guess got right.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

#: the paths a key guards (vLLM guards ``/v1`` and the prefixes of APIs this server does not have)
GUARDED_PREFIX = "/v1"
ENV_VAR = "VLLM_API_KEY"

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]


def api_keys(given: Sequence[str] | None) -> list[str]:
    """The keys a server checks: those given (``--api-key``), else ``$VLLM_API_KEY``; empty ones
    dropped. An empty list means no check."""
    keys = list(given) if given else [os.environ.get(ENV_VAR, "")]
    for key in keys:
        if not isinstance(key, str):
            raise TypeError(f"api keys must be strings, got {type(key).__name__}")
    return [key for key in keys if key]


class AuthenticationMiddleware:
    """ASGI middleware in front of the app: see the module docstring."""

    def __init__(self, app: ASGIApp, keys: Sequence[str]) -> None:
        if not keys:
            raise ValueError("AuthenticationMiddleware needs at least one non-empty key")
        self.app = app
        self.digests = [_digest(key) for key in keys]

    def accepts(self, headers: Headers) -> bool:
        scheme, _, credential = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        sent = _digest(credential)
        matched = False
        for digest in self.digests:  # every key, whatever matched before: constant time
            matched |= secrets.compare_digest(sent, digest)
        return matched

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        guarded = (
            scope["type"] in ("http", "websocket")
            and scope.get("method") != "OPTIONS"
            and scope["path"].removeprefix(scope.get("root_path", "")).startswith(GUARDED_PREFIX)
        )
        if guarded and not self.accepts(Headers(scope=scope)):
            await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()
