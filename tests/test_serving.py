"""The OpenAI-compatible server (:mod:`paged_attention.serving`), end to end over HTTP on 127.0.0.1.

One engine and one :class:`ServerThread` serve the whole module: the embedded tiny model with a KV
cache of 16 blocks of 16 tokens (so that the cache, not the model's 1024 positions, sets
``max_model_len``: 257), 4 running sequences and 4 waiting requests at most. An offline ``LLM`` built
the same way gives the expected outputs. Clients: the official ``openai`` client (sync and async) and
raw ``httpx`` where the bytes matter. The engine is read only on its own loop (:func:`on_engine`) or
once the traffic has stopped: a test whose requests may still be ending (a client gone, a refusal, a
burst) waits until the engine holds no request and no block (:func:`wait_idle`); conftest checks
the blocks after every test. No test may make the server log an error (the :func:`served` fixture).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import pathlib
import re
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import paged_attention
from paged_attention.engine.chat import PLAIN_TEMPLATE
from paged_attention.engine.llm import LLM
from paged_attention.engine.llm_engine import LLMEngine
from paged_attention.engine.params import SamplingParams
from paged_attention.serving import AsyncLLM, ServerProcess, ServerThread, build_app, free_port

MODEL = "tiny"
NUM_KV_BLOCKS = 16  # x 16 tokens: max_model_len 257, where the model itself has 1024 positions
MAX_NUM_SEQS = 4
MAX_WAITING = 4
PROMPT = "The cat sat on"
CHAT = [{"role": "user", "content": "hello"}]
CHAT_TEXT = "<|bos|>user: hello\nassistant:"  # CHAT rendered by PLAIN_TEMPLATE, written out by hand


# -- shared helpers (test_serving_load.py uses them too) -----------------------------------------------
@dataclass
class Served:
    engine: LLMEngine
    llm: AsyncLLM
    url: str


class ErrorLog(logging.Handler):
    """Collects the ERROR records of the server's loggers (uvicorn's do not reach the root logger)."""

    LOGGERS = ("paged_attention", "uvicorn.error")

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> ErrorLog:
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *_: object) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)

    def take(self) -> list[str]:
        found, self.records = self.records, []
        return [
            f"{r.name}: {r.getMessage()} {r.exc_info[1]!r}" if r.exc_info else r.getMessage() for r in found
        ]


@contextlib.contextmanager
def serve(engine: LLMEngine, max_waiting: int | None) -> Iterator[tuple[Served, ErrorLog]]:
    """``engine`` served on 127.0.0.1 and a free port until the block ends; the server's errors logged."""
    llm = AsyncLLM(engine, max_waiting=max_waiting)
    server = ServerThread(build_app(llm, MODEL, PLAIN_TEMPLATE))  # configures uvicorn's logging: first
    with ErrorLog() as errors:
        server.start()
        try:
            yield Served(engine, llm, server.url), errors
        finally:
            server.stop()
    assert not server.thread.is_alive(), "the server thread did not stop"
    assert not llm.is_running, "the engine loop did not stop"


def on_engine(llm: AsyncLLM, fn: Callable[[LLMEngine], Any], timeout: float = 30) -> Any:
    """``fn(engine)`` run by the engine loop between two steps, from a test thread (``llm.call`` must be
    awaited on the server's event loop, which runs in the server's thread)."""
    return llm.call_soon(fn, timeout)


def _engine_state(engine: LLMEngine) -> tuple[list[str], bool, int, int]:
    manager = engine.cache_manager
    return engine.request_ids, engine.has_unfinished_requests(), manager.num_free_blocks, manager.num_blocks


def wait_idle(served: Served, timeout: float = 30) -> None:
    """Wait until the engine holds no request and no block, and the front no stream; fail if it never does."""
    deadline = time.monotonic() + timeout
    while True:
        ids, busy, free, total = on_engine(served.llm, _engine_state)
        if not ids and not busy and free == total and served.llm.num_unfinished == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"the engine did not go idle: requests {ids}, {total - free} of {total} blocks held, "
                f"{served.llm.num_unfinished} streams open"
            )
        time.sleep(0.02)


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """GET /metrics, parsed by prometheus_client: ``(sample name, labels but model_name) -> value``."""
    answer = httpx.get(url + "/metrics", timeout=30)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == MODEL
            samples[(sample.name, frozenset(labels.items()))] = sample.value
    return samples


def metric(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def success(samples: dict[tuple[str, frozenset], float]) -> dict[str, float]:
    """``vllm:request_success_total`` by finish reason."""
    return {
        r: metric(samples, "vllm:request_success_total", finished_reason=r)
        for r in ("stop", "length", "abort")
    }


def delta(before: dict, after: dict) -> dict:
    return {key: after[key] - before.get(key, 0) for key in after}


@dataclass
class Expected:
    text: str
    tokens: list[str]  # each token's text, as the server's logprobs name them
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None


def expected(offline: LLM, prompts: list, params: SamplingParams) -> list[list[Expected]]:
    """What ``LLM.generate`` answers: per prompt, per sample."""
    outputs = offline.generate(prompts, dataclasses.replace(params, logprobs=0), use_tqdm=False)
    return [
        [
            Expected(
                c.text,
                [lp[t].decoded_token for t, lp in zip(c.token_ids, c.logprobs, strict=True)],
                list(c.token_ids),
                [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)],
                c.finish_reason,
            )
            for c in out.outputs
        ]
        for out in outputs
    ]


def sse_payloads(lines: list[str]) -> list[dict]:
    """The JSON payloads of a raw event stream, checked to be ``data:`` lines ending with ``[DONE]``."""
    events = [line for line in lines if line]
    assert all(line.startswith("data: ") for line in events), events
    assert events[-1] == "data: [DONE]", events[-3:]
    assert events.count("data: [DONE]") == 1
    return [json.loads(line[len("data: ") :]) for line in events[:-1]]


# -- the module's server ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Served, ErrorLog]]:
    engine = LLMEngine(None, num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=MAX_NUM_SEQS)
    with serve(engine, MAX_WAITING) as served:
        yield served


@pytest.fixture
def served(server: tuple[Served, ErrorLog]) -> Iterator[Served]:
    """The module's server; the test fails if the server logged an error while it ran."""
    served, errors = server
    errors.take()
    yield served
    assert errors.take() == [], "the server logged errors"


@pytest.fixture(scope="module")
def offline() -> LLM:
    """The offline API over an engine built the same way as the server's."""
    return LLM(model=None, num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=MAX_NUM_SEQS, seed=0)


@pytest.fixture(scope="module")
def client(server: tuple[Served, ErrorLog]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def http(server: tuple[Served, ErrorLog]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0].url, timeout=60) as c:
        yield c


def async_client(served: Served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def run(coro: Any, timeout: float = 60) -> Any:
    """Run a coroutine on a fresh event loop, bounded in time."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def prompt_tokens(http: httpx.Client, **body: Any) -> int:
    answer = http.post("/tokenize", json=body).json()
    assert answer["count"] == len(answer["tokens"])
    return answer["count"]


# -- the routes ------------------------------------------------------------------------------------------
def test_models_health_version(served: Served, client: openai.OpenAI, http: httpx.Client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    body = http.get("/v1/models").json()
    assert body["object"] == "list" and [card["object"] for card in body["data"]] == ["model"]
    # the cache (16 blocks of 16 tokens) sets the length, well under the model's own
    assert body["data"][0]["max_model_len"] == served.engine.max_model_len == NUM_KV_BLOCKS * 16 + 1
    assert served.engine.max_model_len < served.engine.model.config.max_position_embeddings
    assert http.get("/health").status_code == 200
    assert http.get("/version").json() == {"version": paged_attention.__version__}


def test_tokenize_prompt_and_messages(served: Served, http: httpx.Client) -> None:
    tokenizer = served.engine.tokenizer
    answer = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert (
        answer["tokens"] == tokenizer(PROMPT)["input_ids"] and answer["tokens"][0] == tokenizer.bos_token_id
    )
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == served.engine.max_model_len
    bare = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert bare["tokens"] == answer["tokens"][1:]
    chat = http.post("/tokenize", json={"messages": CHAT, "return_token_strs": True}).json()
    assert chat["tokens"] == tokenizer(CHAT_TEXT, add_special_tokens=False)["input_ids"]
    assert chat["token_strs"] == tokenizer.convert_ids_to_tokens(chat["tokens"])
    open_end = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert (
        open_end["tokens"]
        == tokenizer(CHAT_TEXT.removesuffix("assistant:"), add_special_tokens=False)["input_ids"]
    )


def test_detokenize_gives_back_the_text(served: Served, http: httpx.Client) -> None:
    ids = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": PROMPT}
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    outside = http.post("/detokenize", json={"tokens": [1, 10**6]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"
    other = http.post("/detokenize", json={"model": "another", "tokens": [1]})
    assert other.status_code == 404


# -- completions and chat: shapes, usage, finish reasons, the offline outputs ------------------------------
def test_completion_matches_offline(
    served: Served, client: openai.OpenAI, http: httpx.Client, offline: LLM
) -> None:
    started = time.time()
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert answer.object == "text_completion" and answer.id.startswith("cmpl-") and answer.model == MODEL
    assert int(started) <= answer.created <= time.time() + 1
    [choice] = answer.choices
    [[want]] = expected(offline, [PROMPT], SamplingParams(temperature=0, max_tokens=8))
    assert (choice.index, choice.text, choice.finish_reason) == (0, want.text, "length") and want.text
    count = prompt_tokens(http, prompt=PROMPT)
    assert count == len(served.engine.tokenizer(PROMPT)["input_ids"])
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (
        count,
        8,
        count + 8,
    )
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert again.choices[0].text == choice.text and again.id != answer.id


def test_chat_matches_offline(
    served: Served, client: openai.OpenAI, http: httpx.Client, offline: LLM
) -> None:
    started = time.time()
    answer = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-") and answer.model == MODEL
    assert int(started) <= answer.created <= time.time() + 1
    [choice] = answer.choices
    [want] = offline.chat(
        CHAT, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False, chat_template=PLAIN_TEMPLATE
    )
    assert choice.message.role == "assistant" and choice.message.content == want.outputs[0].text
    assert choice.finish_reason == "length" and choice.index == 0
    count = prompt_tokens(http, messages=CHAT)
    assert count == len(served.engine.tokenizer(CHAT_TEXT, add_special_tokens=False)["input_ids"])
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (count, 6)
    # max_completion_tokens (OpenAI's newer name) wins over max_tokens
    newer = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=9, max_completion_tokens=3, temperature=0
    )
    assert (
        newer.usage.completion_tokens == 3
        and newer.choices[0].message.content == want.outputs[0].text[: len(newer.choices[0].message.content)]
    )
    # without max_tokens a chat may run to the end of max_model_len (vLLM's default)
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0)
    room = served.engine.max_model_len - count
    finish, used = whole.choices[0].finish_reason, whole.usage.completion_tokens
    assert (finish == "length" and used == room) or (finish == "stop" and used < room), (finish, used, room)
    assert whole.choices[0].message.content.startswith(choice.message.content)


def test_async_client_streams_what_it_answers(served: Served) -> None:
    """AsyncOpenAI, streamed and not, completions and chat: the chunks' shapes, their text adds up to
    the whole answer, one finish reason at the end, and include_usage's last chunk."""

    async def main() -> tuple:
        async with async_client(served) as c:
            kw: dict[str, Any] = {"model": MODEL, "max_tokens": 10, "temperature": 0}
            whole = await c.completions.create(prompt=PROMPT, **kw)
            opts = {"include_usage": True}
            chunks = [
                x
                async for x in await c.completions.create(
                    prompt=PROMPT, stream=True, stream_options=opts, **kw
                )
            ]
            chat = await c.chat.completions.create(messages=CHAT, **kw)
            stream = await c.chat.completions.create(messages=CHAT, stream=True, stream_options=opts, **kw)
            chat_chunks = [x async for x in stream]
        return whole, chunks, chat, chat_chunks

    whole, chunks, chat, chat_chunks = run(main())
    *parts, last = chunks
    assert {c.object for c in chunks} == {"text_completion"} and {c.model for c in chunks} == {MODEL}
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-") and chunks[0].id != whole.id
    assert all(len(c.choices) == 1 and c.choices[0].index == 0 and c.usage is None for c in parts)
    assert "".join(c.choices[0].text for c in parts) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in parts] == [None] * (len(parts) - 1) + ["length"]
    assert last.choices == [] and last.usage == whole.usage and whole.usage.completion_tokens == 10

    *parts, last = chat_chunks
    assert {c.object for c in chat_chunks} == {"chat.completion.chunk"} and len(
        {c.id for c in chat_chunks}
    ) == 1
    assert chat_chunks[0].id.startswith("chatcmpl-")
    assert parts[0].choices[0].delta.role == "assistant" and parts[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in parts) == chat.choices[0].message.content
    assert [c.choices[0].finish_reason for c in parts] == [None] * (len(parts) - 1) + ["length"]
    assert last.choices == [] and last.usage == chat.usage and chat.usage.completion_tokens == 10


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_raw_event_stream_and_continuous_usage(served: Served, http: httpx.Client, route: str) -> None:
    """The bytes: ``data:`` events, ``data: [DONE]`` last; continuous_usage_stats gives each chunk its
    choice's usage so far (vLLM's), and include_usage the whole request's at the end."""
    chat = route.endswith("chat/completions")
    body: dict[str, Any] = {"messages": CHAT} if chat else {"prompt": PROMPT}
    body |= {"n": 2, "temperature": 0.8, "seed": 1, "max_tokens": 5, "stream": True}
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    with http.stream("POST", route, json=body) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(list(answer.iter_lines()))
    count = prompt_tokens(http, **({"messages": CHAT} if chat else {"prompt": PROMPT}))
    *chunks, final = payloads
    assert final["choices"] == [] and final["usage"] == {
        "prompt_tokens": count,
        "completion_tokens": 10,
        "total_tokens": count + 10,
    }
    so_far: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks:
        [choice] = chunk["choices"]
        if chat and choice["delta"].get("role"):
            continue  # the assistant's role, before any token
        assert chunk["usage"]["prompt_tokens"] == count
        assert chunk["usage"]["total_tokens"] == count + chunk["usage"]["completion_tokens"]
        so_far[choice["index"]].append(chunk["usage"]["completion_tokens"])
    for counts in so_far.values():  # each choice's own count: rising to its 5 tokens
        assert counts == sorted(counts) and counts[-1] == 5 and len(set(counts)) == len(counts)


# -- stop strings and stop tokens ----------------------------------------------------------------------
def test_stop_string_across_two_tokens(served: Served, client: openai.OpenAI) -> None:
    """A stop string made of the end of one generated token and the start of the next: the text ends
    right before it, streamed or not, and the streamed deltas add up to the whole text."""
    kw: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    probe = client.completions.create(logprobs=0, **kw).choices[0]
    tokens, text = probe.logprobs.tokens, probe.text
    assert "".join(tokens) == text
    starts = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
    for k in range(1, len(tokens) - 2):  # the stop string: token k's last character + token k+1's first two
        if len(tokens[k]) >= 1 and len(tokens[k + 1]) >= 2:
            stop = tokens[k][-1] + tokens[k + 1][:2]
            at = starts[k + 1] - 1
            if text.find(stop) == at:
                break
    else:
        pytest.fail(f"no stop string spans two tokens of {tokens}")

    cut = client.completions.create(stop=[stop], **kw)
    [choice] = cut.choices
    assert (choice.text, choice.finish_reason, choice.stop_reason) == (text[:at], "stop", stop)
    assert cut.usage.completion_tokens == k + 2  # the token that completed the stop string counts

    chunks = list(
        client.completions.create(stop=stop, stream=True, stream_options={"include_usage": True}, **kw)
    )
    deltas = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(deltas) == text[:at]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == k + 2

    kept = client.completions.create(stop=[stop], extra_body={"include_stop_str_in_output": True}, **kw)
    assert kept.choices[0].text == text[: at + len(stop)]

    # a long stop string that never comes: the text is held back (the first deltas have tokens but no
    # text), yet every token is streamed with its logprobs, and the held text comes with the finish
    never = "\u2603" * 8
    streamed = list(client.completions.create(stop=never, stream=True, logprobs=0, **kw))
    assert streamed[0].choices[0].text == "" and streamed[0].choices[0].logprobs.tokens == tokens[:1]
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == tokens
    assert "".join(c.choices[0].text for c in streamed) == text
    assert streamed[-1].choices[0].finish_reason == "length"

    chat_kw = {"model": MODEL, "messages": CHAT, "max_tokens": 16, "temperature": 0}
    chat_text = client.chat.completions.create(**chat_kw).choices[0].message.content
    chat_stop = chat_text[3:6]
    chat_at = chat_text.find(chat_stop)
    streamed = client.chat.completions.create(stop=chat_stop, stream=True, **chat_kw)
    parts = [c.choices[0] for c in streamed]
    assert "".join(p.delta.content or "" for p in parts) == chat_text[:chat_at]
    assert parts[-1].finish_reason == "stop"


def test_stop_token(served: Served, client: openai.OpenAI, offline: LLM) -> None:
    [[want]] = expected(offline, [PROMPT], SamplingParams(temperature=0, max_tokens=12))
    j = next(j for j in range(2, 12) if want.token_ids[j] not in want.token_ids[:j])
    stop_id = want.token_ids[j]
    kw: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    answer = client.completions.create(extra_body={"stop_token_ids": [stop_id]}, **kw)
    [choice] = answer.choices
    assert (choice.finish_reason, choice.stop_reason) == ("stop", stop_id)
    assert choice.text == "".join(want.tokens[:j])  # the stop token's own text is left out
    assert answer.usage.completion_tokens == j + 1
    chunks = list(client.completions.create(extra_body={"stop_token_ids": [stop_id]}, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "stop"


# -- n, lists of prompts, seeds, token-id prompts: the offline API's tokens --------------------------------
def test_n_and_a_list_of_prompts_match_offline(
    served: Served, client: openai.OpenAI, http: httpx.Client, offline: LLM
) -> None:
    prompts = ["The cat", "Paged blocks hold"]
    params = {"n": 2, "temperature": 0.8, "seed": 7, "max_tokens": 6}
    answer = client.completions.create(model=MODEL, prompt=prompts, logprobs=0, **params)
    want = expected(offline, prompts, SamplingParams(**params))
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]  # prompt_index * n + sample index
    for i in range(2):
        for j in range(2):
            choice = answer.choices[i * 2 + j]
            assert (choice.text, choice.logprobs.tokens) == (want[i][j].text, want[i][j].tokens), (i, j)
            assert choice.finish_reason == "length"
    assert want[0][0].tokens != want[0][1].tokens  # the samples differ, so the order above is checked
    counts = [prompt_tokens(http, prompt=p) for p in prompts]
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (sum(counts), 4 * 6)

    again = client.completions.create(model=MODEL, prompt=prompts, logprobs=0, **params)
    assert [c.text for c in again.choices] == [c.text for c in answer.choices]

    texts = ["", "", "", ""]
    for chunk in client.completions.create(model=MODEL, prompt=prompts, stream=True, **params):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in answer.choices]

    chat = client.chat.completions.create(model=MODEL, messages=CHAT, **params)
    [want_chat] = offline.chat(CHAT, SamplingParams(**params), use_tqdm=False, chat_template=PLAIN_TEMPLATE)
    assert [c.index for c in chat.choices] == [0, 1]
    assert [c.message.content for c in chat.choices] == [o.text for o in want_chat.outputs]


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_token_id_prompts_match_offline(
    served: Served, client: openai.OpenAI, offline: LLM, sampling: str
) -> None:
    params = {"temperature": 0.0} if sampling == "greedy" else {"temperature": 0.8, "seed": 11}
    params["max_tokens"] = 8
    prompts = ["hello", "a b c d e f g", PROMPT]
    want = expected(offline, prompts, SamplingParams(**params))
    by_text = client.completions.create(model=MODEL, prompt=prompts, logprobs=0, **params)
    ids = [served.engine.tokenizer(p)["input_ids"] for p in prompts]
    by_ids = client.completions.create(model=MODEL, prompt=ids, logprobs=0, **params)
    one = client.completions.create(model=MODEL, prompt=ids[0], logprobs=0, **params)
    for answer in (by_text, by_ids):
        got = [(c.text, c.logprobs.tokens) for c in answer.choices]
        assert got == [(w[0].text, w[0].tokens) for w in want]
        assert answer.usage.prompt_tokens == sum(map(len, ids))
        for c, w in zip(answer.choices, want, strict=True):
            assert c.logprobs.token_logprobs == pytest.approx(w[0].logprobs, abs=1e-3)
    assert (one.choices[0].text, one.usage.prompt_tokens) == (want[0][0].text, len(ids[0]))


def test_n_beyond_the_cache_is_served_by_preemption(
    served: Served, client: openai.OpenAI, offline: LLM
) -> None:
    """Two samples of 3 + 135 tokens (9 blocks each) cannot both sit in 16 blocks: as in vLLM, the
    request is taken and served by preempting a sample (not refused: each sample alone fits)."""
    params = {"n": 2, "temperature": 0.8, "seed": 5, "max_tokens": 135}
    before = scrape(served.url)
    answer = client.completions.create(model=MODEL, prompt="hi", extra_body={"ignore_eos": True}, **params)
    after = scrape(served.url)
    want = expected(offline, ["hi"], SamplingParams(ignore_eos=True, **params))[0]
    assert [c.text for c in answer.choices] == [w.text for w in want]
    assert answer.usage.completion_tokens == 270
    assert metric(after, "vllm:num_preemptions_total") > metric(before, "vllm:num_preemptions_total")


# -- refusals: OpenAI's error body, the field named, the server unharmed ------------------------------------
LONG_IDS = list(range(3, 3 + 300))  # longer than max_model_len (257)
BAD_REQUESTS: list[tuple[str, str, Any, int, str | None]] = [
    # (case, route, body: JSON, or bytes sent as they are, or None for a GET; status, param)
    ("malformed json", "/v1/completions", b'{"prompt": "hi",', 400, None),
    ("body not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    (
        "unknown model chat",
        "/v1/chat/completions",
        {"model": "gpt-4", "messages": CHAT},
        404,
        "model",
    ),
    ("unknown model tokenize", "/tokenize", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    (
        "temperature a string",
        "/v1/completions",
        {"prompt": "hi", "temperature": "hot"},
        400,
        "temperature",
    ),
    ("n a float", "/v1/completions", {"prompt": "hi", "n": 1.5}, 400, "n"),
    ("max_tokens a bool", "/v1/completions", {"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ("seed a string", "/v1/completions", {"prompt": "hi", "seed": "x"}, 400, "seed"),
    ("stop a number", "/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("top_p 2", "/v1/completions", {"prompt": "hi", "top_p": 2}, 400, "top_p"),
    ("temperature -1", "/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("n 0", "/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("max_tokens 0", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("logprobs 21", "/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    (
        "top_logprobs 21",
        "/v1/chat/completions",
        {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    (
        "top_logprobs alone",
        "/v1/chat/completions",
        {"messages": CHAT, "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    ("prompt too long", "/v1/completions", {"prompt": LONG_IDS}, 400, "prompt"),
    (
        "chat too long",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a " * 300}]},
        400,
        "messages",
    ),
    # 3 + 1000 tokens fit the model's 1024 positions, not the cache's 257
    (
        "max_tokens past the cache",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 1000},
        400,
        "max_tokens",
    ),
    (
        "max_tokens past the model",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 5000},
        400,
        "max_tokens",
    ),
    (
        "chat max_tokens past the cache",
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 250},
        400,
        "max_tokens",
    ),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("an empty prompt in a list", "/v1/completions", {"prompt": ["a", ""]}, 400, "prompt"),
    ("token id out of range", "/v1/completions", {"prompt": [600]}, 400, "prompt"),
    ("mixed prompt list", "/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("no prompt", "/v1/completions", {}, 400, "prompt"),
    (
        "stream_options without stream",
        "/v1/completions",
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    (
        "logit_bias key",
        "/v1/completions",
        {"prompt": "hi", "logit_bias": {"x": 1.0}},
        400,
        "logit_bias",
    ),
    (
        "message without role",
        "/v1/chat/completions",
        {"messages": [{"content": "hi"}]},
        400,
        "messages",
    ),
    (
        "content not a string",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": 5}]},
        400,
        "messages",
    ),
    ("no messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("messages a string", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    (
        "tools",
        "/v1/chat/completions",
        {"messages": CHAT, "tools": [{"type": "function"}]},
        400,
        "tools",
    ),
    ("tokenize neither", "/tokenize", {}, 400, "prompt"),
    ("unknown route", "/v1/nothing", {"prompt": "hi"}, 404, None),
    ("unknown route get", "/v1/embeddings", None, 404, None),
    ("wrong method", "/v1/completions", None, 405, None),
]


@pytest.mark.parametrize(
    ("route", "body", "status", "param"),
    [c[1:] for c in BAD_REQUESTS],
    ids=[c[0] for c in BAD_REQUESTS],
)
def test_bad_request_is_refused_with_openai_error(
    served: Served, http: httpx.Client, route: str, body: Any, status: int, param: str | None
) -> None:
    before = success(scrape(served.url))
    if body is None:
        answer = http.get(route)
    else:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        answer = http.post(route, content=content, headers={"content-type": "application/json"})
    assert answer.status_code == status, answer.text
    error = answer.json()
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}, error
    names = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError"}
    assert error["error"]["type"] == names[status] and error["error"]["code"] == status
    assert error["error"]["param"] == param, error
    assert isinstance(error["error"]["message"], str) and error["error"]["message"]
    # the server is unharmed: healthy, serving, and holding nothing of the refused request
    assert http.get("/health").status_code == 200
    good = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "temperature": 0})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 1
    wait_idle(served)
    after = success(scrape(served.url))
    # nothing was generated for it (a list refused at its second prompt aborts the first it had added)
    aborted = 1 if body == {"prompt": ["a", ""]} else 0
    assert delta(before, after) == {"stop": 0, "length": 1, "abort": aborted}


def test_openai_client_sees_typed_errors(served: Served, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert (bad.value.status_code, bad.value.param, bad.value.type) == (400, "temperature", "BadRequestError")
    assert "temperature" in bad.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4", messages=CHAT)
    assert (missing.value.status_code, missing.value.param) == (404, "model")
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1000)
    assert long.value.param == "max_tokens" and "max_model_len" in long.value.message
    good = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
    assert good.usage.completion_tokens == 2


def test_full_queue_answers_503_and_recovers(served: Served) -> None:
    """More requests at once than max_num_seqs + max_waiting: the excess get 503 at once (none hangs),
    the admitted ones complete, and afterwards nothing is left running, waiting or holding blocks."""
    before = scrape(served.url)

    async def one(c: openai.AsyncOpenAI, i: int) -> Any:
        try:
            return await c.completions.create(
                model=MODEL,
                prompt=f"request {i}",
                max_tokens=64,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
        except openai.APIStatusError as err:
            return err

    async def burst() -> list:
        async with async_client(served) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    results = run(burst(), timeout=120)
    done = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, Exception)]
    assert all(isinstance(r, openai.InternalServerError) and r.status_code == 503 for r in refused), refused
    assert all(
        r.type == "ServiceUnavailableError" and r.code == "503" and "max_waiting" in r.message
        for r in refused
    )
    assert refused and len(done) >= MAX_WAITING
    assert all(r.usage.completion_tokens == 64 and r.choices[0].finish_reason == "length" for r in done)
    wait_idle(served)
    after = scrape(served.url)
    assert metric(after, "vllm:num_requests_running") == metric(after, "vllm:num_requests_waiting") == 0
    assert metric(after, "vllm:kv_cache_usage_perc") == 0
    assert delta(success(before), success(after)) == {"stop": 0, "length": len(done), "abort": 0}
    assert httpx.get(served.url + "/health").status_code == 200


# -- clients that go away -----------------------------------------------------------------------------------
def test_disconnect_mid_stream_aborts(served: Served, http: httpx.Client) -> None:
    """Two streams left after their first chunk (raw httpx, and the async openai client closing its
    stream): both requests are aborted, long before their 200 tokens, and every block comes back."""
    before = scrape(served.url)
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as answer:
        first = next(line for line in answer.iter_lines() if line)
    assert json.loads(first.removeprefix("data: "))["object"] == "text_completion"

    async def chat_and_leave() -> str:
        async with async_client(served) as c:
            stream = await c.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=200, stream=True, extra_body={"ignore_eos": True}
            )
            async for chunk in stream:
                await stream.close()
                return chunk.object
        raise AssertionError("no chunk")

    assert run(chat_and_leave()) == "chat.completion.chunk"
    wait_idle(served)
    after = scrape(served.url)
    assert delta(success(before), success(after)) == {"stop": 0, "length": 0, "abort": 2}
    generated = metric(after, "vllm:generation_tokens_total") - metric(before, "vllm:generation_tokens_total")
    assert 2 <= generated < 400


def test_disconnect_mid_request_aborts(served: Served) -> None:
    """A non-streamed request whose client leaves while it runs is aborted (nobody is left to answer,
    and no error is logged: the :func:`served` fixture checks), and its blocks come back."""
    before = scrape(served.url)

    async def leave_while_running() -> None:
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as c:
            body = {"prompt": PROMPT, "max_tokens": 240, "ignore_eos": True}
            request = asyncio.ensure_future(c.post("/v1/completions", json=body))
            for _ in range(1000):  # until the engine runs it and has generated for it
                await asyncio.sleep(0.01)
                assert not request.done(), "the request finished before the client could leave"
                now = scrape(served.url)
                generated = metric(now, "vllm:generation_tokens_total") - metric(
                    before, "vllm:generation_tokens_total"
                )
                if generated and metric(now, "vllm:num_requests_running") == 1:
                    break
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request

    run(leave_while_running())
    wait_idle(served)
    after = scrape(served.url)
    assert delta(success(before), success(after)) == {"stop": 0, "length": 0, "abort": 1}
    generated = metric(after, "vllm:generation_tokens_total") - metric(before, "vllm:generation_tokens_total")
    assert 1 <= generated < 240
    good = httpx.post(served.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert good.status_code == 200


# -- /metrics ----------------------------------------------------------------------------------------------
COUNTERS = [
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:num_preemptions",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:request_success",
]
GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
HISTOGRAMS = [
    "vllm:time_to_first_token_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
]


def test_metrics_names_and_exact_counts(served: Served, http: httpx.Client) -> None:
    text = http.get("/metrics").text
    kinds = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert {name: kinds.get(name) for name in COUNTERS} == dict.fromkeys(COUNTERS, "counter")
    assert {name: kinds.get(name) for name in GAUGES} == dict.fromkeys(GAUGES, "gauge")
    assert {name: kinds.get(name) for name in HISTOGRAMS} == dict.fromkeys(HISTOGRAMS, "histogram")
    samples = scrape(served.url)
    for name in HISTOGRAMS:  # cumulative buckets, +Inf the count
        buckets = sorted(
            (float(dict(labels)["le"]), value)
            for (n, labels), value in samples.items()
            if n == name + "_bucket"
        )
        assert [v for _, v in buckets] == sorted(v for _, v in buckets)
        assert buckets[-1] == (float("inf"), metric(samples, name + "_count"))

    ids = list(range(300, 340))  # 40 tokens no other test sends: 2 full blocks to cache, 8 tokens past them
    body = {"prompt": ids, "max_tokens": 5, "temperature": 0}
    moves = []
    for _ in range(2):
        before = scrape(served.url)
        assert http.post("/v1/completions", json=body).json()["usage"] == {
            "prompt_tokens": 40,
            "completion_tokens": 5,
            "total_tokens": 45,
        }
        after = scrape(served.url)
        moves.append(delta(before, after))
        assert metric(after, "vllm:num_requests_running") == metric(after, "vllm:num_requests_waiting") == 0
        assert metric(after, "vllm:kv_cache_usage_perc") == 0
    for i, move in enumerate(moves):
        hits = 32 * i  # the second time, the first 2 blocks come from the prefix cache
        assert metric(move, "vllm:prompt_tokens_total") == 40 - hits
        assert metric(move, "vllm:prefix_cache_queries_total") == 40
        assert metric(move, "vllm:prefix_cache_hits_total") == hits
        assert metric(move, "vllm:generation_tokens_total") == 5
        assert metric(move, "vllm:num_preemptions_total") == 0
        assert success(move) == {"stop": 0, "length": 1, "abort": 0}
        for name in HISTOGRAMS:
            assert metric(move, name + "_count") == 1, name
        assert metric(move, "vllm:request_prompt_tokens_sum") == 40
        assert metric(move, "vllm:request_generation_tokens_sum") == 5
        for name in HISTOGRAMS[:4]:
            assert 0 <= metric(move, name + "_sum") < 30, name


# -- the serve command as a child process -------------------------------------------------------------------
def test_free_ports_lie_below_the_outgoing_range() -> None:
    """:func:`free_port` (for servers that cannot take a socket, as the real vLLM): a port bindable
    now, below the range the OS hands to outgoing connections, which could otherwise take it first."""
    low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(8)}
    assert all(1024 <= port < low for port in ports) and len(ports) > 1
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))


def test_serve_command_stops_on_sigterm_and_sigint(tmp_path) -> None:
    """``python -m paged_attention serve --model tiny``: two servers started side by side (each start
    is mostly imports), one request each, then SIGTERM to one and SIGINT (``stop()``) to the other:
    both exit 0, promptly, and their engine cores (processes of their own) are gone."""
    args = ["--model", "tiny", "--num-kv-blocks", "64", "--threads", "1", "--log-level", "warning"]
    servers = [ServerProcess(args, log=tmp_path / f"serve-{i}.log") for i in range(2)]
    for s in servers:  # each port is bound before its child starts (handed over: serve --fd)
        assert "--fd" in s.args
        with pytest.raises(OSError), socket.socket() as sock:
            sock.bind(("127.0.0.1", s.port))
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(ServerProcess.start, servers))
        for s in servers:
            assert s.url.startswith("http://127.0.0.1:")
            with openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
                assert [m.id for m in c.models.list().data] == ["tiny"]
                answer = c.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
                assert answer.usage.completion_tokens == 4
                # the tiny model has no chat template: the plain one stands in
                chat = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, temperature=0)
                assert chat.usage.completion_tokens == 2
        term, interrupt = servers
        assert term.process is not None
        started = time.monotonic()
        term.process.send_signal(signal.SIGTERM)  # both shut down at once
        assert interrupt.stop(timeout=20) == 0
        assert term.process.wait(timeout=20) == 0
        assert time.monotonic() - started < 20
    finally:
        for s in servers:
            s.stop(timeout=5)
    log = (tmp_path / "serve-0.log").read_text()
    assert f"serving tiny on http://127.0.0.1:{servers[0].port}" in log
    for i in range(2):  # each server's engine core (its own process, by default) ended with it
        pid = re.search(r"in its own process [(]pid (\d+)[)]", (tmp_path / f"serve-{i}.log").read_text())[1]
        stat = pathlib.Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split()[2] == "Z", f"core {pid} outlived its server"
    for s in servers:  # nobody holds the ports any more (neither this process nor an engine core)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", s.port))
