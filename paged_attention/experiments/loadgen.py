"""A load generator in the shape of ``vllm bench serve``: requests arrive, stream, and are timed.

It speaks HTTP only (OpenAI's ``/v1/completions`` or ``/v1/chat/completions``, streamed, plus
``/tokenize`` and ``/v1/models``, which ``vllm serve`` has too), so the same run measures this
package's server or a ``vllm serve`` on a GPU machine.

* **Arrivals** (:func:`arrival_times`): gaps drawn from a gamma distribution with shape
  ``burstiness`` and mean ``1 / rate``: ``burstiness=1`` is a Poisson process, smaller is burstier
  (coefficient of variation ``1 / sqrt(burstiness)``), larger is more regular; ``rate=inf`` sends
  everything at once.
* **Workloads**: ``sharegpt``, the project's ShareGPT-like lengths (:mod:`.traces`, scaled by
  ``length_scale`` for a CPU), with prompts of exactly that many tokens (slices of real text's token
  ids, from the server's own ``/tokenize``) and outputs of exactly that many tokens
  (``ignore_eos``); ``chat``, real questions answered by the model in its own words (``max_tokens``
  caps them).
* **Clients** (:func:`run_load`): one asyncio task per request, streaming, each timing its chunks
  (:mod:`.latency_stats`); ``max_concurrency`` caps how many are in flight.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ..models.corpus import CORPUS
from .latency_stats import RequestResult, stream_metrics
from .prompts import QUESTIONS
from .traces import synthetic_trace

WORKLOADS = ("sharegpt", "chat")


@dataclass(frozen=True)
class LoadRequest:
    """One request of a workload: a completion prompt (text or token ids) or chat messages."""

    max_tokens: int
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    ignore_eos: bool = False

    @property
    def endpoint(self) -> str:
        return "/v1/chat/completions" if self.messages is not None else "/v1/completions"


def arrival_times(num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of ``num_requests`` requests: gamma gaps with shape
    ``burstiness`` and mean ``1 / rate`` (see the module docstring); all 0 if ``rate`` is inf."""
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be a positive int, got {num_requests!r}")
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not rate > 0:
        raise ValueError(f"rate must be a positive number of requests per second, or inf; got {rate!r}")
    if not isinstance(burstiness, (int, float)) or not burstiness > 0 or math.isinf(burstiness):
        raise ValueError(f"burstiness must be a positive finite number (1 = Poisson), got {burstiness!r}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)  # gamma(shape k, scale theta) has mean k * theta = 1 / rate
    times, now = [], 0.0
    for _ in range(num_requests):
        now += rng.gammavariate(burstiness, theta)
        times.append(now)
    return times


def sharegpt_workload(
    num_requests: int, token_pool: Sequence[int], max_model_len: int, length_scale: float = 1.0, seed: int = 0
) -> list[LoadRequest]:
    """ShareGPT-like requests (see the module docstring): prompts of ``token_pool`` slices, outputs
    of a fixed length; lengths scaled by ``length_scale`` and capped so each fits ``max_model_len``."""
    if not token_pool:
        raise ValueError("token_pool is empty: it is where prompt tokens are cut from")
    if not 0 < length_scale <= 1:
        raise ValueError(f"length_scale must be in (0, 1], got {length_scale}")
    rng = random.Random(seed)
    requests = []
    for r in synthetic_trace("sharegpt", num_requests, seed=seed):
        prompt_len = max(1, round(r.prompt_len * length_scale))
        output_len = max(1, round(r.output_len * length_scale))
        prompt_len = min(prompt_len, max_model_len - 1)
        output_len = min(output_len, max_model_len - prompt_len)
        start = rng.randrange(len(token_pool))
        prompt = [token_pool[(start + i) % len(token_pool)] for i in range(prompt_len)]
        requests.append(LoadRequest(output_len, prompt=prompt, ignore_eos=True))
    return requests


def chat_workload(num_requests: int, max_tokens: int = 64, seed: int = 0) -> list[LoadRequest]:
    """Real questions (:data:`.prompts.QUESTIONS`, drawn with replacement), answered freely up to
    ``max_tokens``."""
    rng = random.Random(seed)
    return [
        LoadRequest(max_tokens, messages=[{"role": "user", "content": rng.choice(QUESTIONS)}])
        for _ in range(num_requests)
    ]


async def workload_from_server(
    url: str, workload: str, num_requests: int, length_scale: float = 1.0, max_tokens: int = 64, seed: int = 0
) -> tuple[list[LoadRequest], str]:
    """A workload (``"sharegpt"`` or ``"chat"``) sized for the server at ``url`` (its model's name and
    ``max_model_len``, its tokenizer's ids of real text), and the served model's name."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        model, max_model_len = await server_info(client)
        if workload == "chat":
            return chat_workload(num_requests, max_tokens, seed), model
        pool = await token_pool(client, model)
    return sharegpt_workload(num_requests, pool, max_model_len, length_scale, seed), model


async def server_info(client: httpx.AsyncClient) -> tuple[str, int]:
    """The served model's name and ``max_model_len`` (``GET /v1/models``)."""
    answer = await client.get("/v1/models")
    answer.raise_for_status()
    card = answer.json()["data"][0]
    return card["id"], int(card.get("max_model_len") or 2048)


def parse_metrics(text: str) -> dict[str, float]:
    """A Prometheus text page (``GET /metrics``) as ``{sample: value}``: a sample is its name,
    then its labels other than ``model_name`` in braces, as in
    ``vllm:request_success_total{finished_reason=stop}``; a histogram gives ``..._count``,
    ``..._sum`` and ``..._bucket{le=...}`` samples."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


async def token_pool(client: httpx.AsyncClient, model: str, text: str = CORPUS) -> list[int]:
    """Token ids of real text, from the server's tokenizer (``POST /tokenize``)."""
    answer = await client.post(
        "/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False}
    )
    answer.raise_for_status()
    return list(answer.json()["tokens"])


def _body(request: LoadRequest, model: str, temperature: float) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.max_tokens,
        "temperature": temperature,
        "stream": True,
        # the usage so far in every chunk: a chunk carries output when its token count grows, even
        # one whose text is still held back (a partial character, a possible stop string)
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if request.ignore_eos:
        body["ignore_eos"] = True
    if request.messages is not None:
        body["messages"] = request.messages
    else:
        body["prompt"] = request.prompt
    return body


async def send(
    client: httpx.AsyncClient,
    request: LoadRequest,
    model: str,
    temperature: float = 0.0,
    started: float = 0.0,
    stream: bool = True,
) -> RequestResult:
    """Send one request, streaming; time every chunk that has a choice, as ``vllm bench serve`` does,
    its text empty or not (the end-of-sequence token has none; a chat stream's role chunk, which
    carries no token, is left out). See :mod:`.latency_stats`. ``stream=False`` asks for the whole
    answer at once (no latencies then, only the tokens)."""
    send_time = time.perf_counter()
    result = RequestResult(ok=False, send_time=send_time - started)
    if not stream:
        return await _send_whole(client, request, model, temperature, result)
    chunk_times: list[float] = []
    texts: list[str] = []
    try:
        async with client.stream("POST", request.endpoint, json=_body(request, model, temperature)) as answer:
            if answer.status_code != 200:
                body = await answer.aread()
                result.status, result.error = answer.status_code, _error_message(body)
                return result
            async for line in answer.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error in stream")
                    return result
                if chunk.get("usage") and not chunk.get("choices"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                arrived = time.perf_counter()
                for choice in chunk.get("choices", []):
                    if "role" in choice.get("delta", {}):
                        continue  # the assistant's role, sent with the first token's chunk
                    text = choice.get("text") if "text" in choice else choice.get("delta", {}).get("content")
                    texts.append(text or "")
                    chunk_times.append(arrived)
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
    except httpx.HTTPError as err:
        result.error = f"{type(err).__name__}: {err}"
        return result
    result.text = "".join(texts)
    result.chunk_times = [t - started for t in chunk_times]
    if chunk_times and result.output_tokens:
        result.metrics = stream_metrics(send_time, chunk_times, max(result.output_tokens, len(chunk_times)))
        result.ok = True
    else:
        result.error = "no output (or no usage) in the stream"
    return result


async def _send_whole(
    client: httpx.AsyncClient, request: LoadRequest, model: str, temperature: float, result: RequestResult
) -> RequestResult:
    body = {**_body(request, model, temperature), "stream": False}
    del body["stream_options"]
    try:
        answer = await client.post(request.endpoint, json=body)
    except httpx.HTTPError as err:
        result.error = f"{type(err).__name__}: {err}"
        return result
    if answer.status_code != 200:
        result.status, result.error = answer.status_code, _error_message(answer.content)
        return result
    data = answer.json()
    choice = data["choices"][0]
    result.text = choice["text"] if "text" in choice else choice["message"]["content"] or ""
    result.finish_reason = choice.get("finish_reason")
    result.prompt_tokens = data["usage"]["prompt_tokens"]
    result.output_tokens = data["usage"]["completion_tokens"]
    result.ok = True
    return result


def _error_message(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:200]


async def run_load(
    base_url: str,
    requests: Sequence[LoadRequest],
    rate: float,
    burstiness: float = 1.0,
    seed: int = 0,
    model: str | None = None,
    max_concurrency: int | None = None,
    temperature: float = 0.0,
    timeout: float = 600.0,
    stream: bool = True,
) -> tuple[list[RequestResult], float]:
    """Send ``requests`` at ``rate`` (see :func:`arrival_times`); returns what each client saw, in
    the order of ``requests``, and the run's duration (first send to last answer, seconds)."""
    times = arrival_times(len(requests), rate, burstiness, seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        if model is None:
            model, _ = await server_info(client)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        started = time.perf_counter()

        async def one(request: LoadRequest, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - started)))
            if gate is None:
                return await send(client, request, model, temperature, started, stream)
            async with gate:
                return await send(client, request, model, temperature, started, stream)

        results = await asyncio.gather(*(one(r, t) for r, t in zip(requests, times, strict=True)))
        duration = time.perf_counter() - started
    return list(results), duration
