"""A bounded load test of the OpenAI-compatible server: a few hundred concurrent clients at once.

One server over the tiny model (room for every request at once: 1024 blocks, 512 sequences, no
waiting limit) receives, all at the same moment, through ``openai.AsyncOpenAI``:

* 200 well-formed streaming requests (completions and chats; greedy and seeded; 8 to 16 tokens;
  some with a stop string): each must stream exactly the tokens ``LLM.generate`` gives for it on an
  engine built the same way;
* 24 streams whose clients leave after the first chunk (their tasks cancelled): each is aborted;
* 16 malformed requests: each refused with its error, without disturbing the others.

Then the engine must hold nothing, and /metrics must add up to what the clients saw: finished
requests by reason, aborts, prompt and generated tokens. The whole burst is bounded in time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest

from paged_attention.engine.chat import PLAIN_TEMPLATE, render_chat
from paged_attention.engine.llm import LLM
from paged_attention.engine.llm_engine import LLMEngine
from paged_attention.engine.params import SamplingParams

from .test_serving import MODEL, ErrorLog, Served, delta, metric, scrape, serve, success, wait_idle

NUM_KV_BLOCKS = 1024
MAX_NUM_SEQS = 512
NUM_GOOD, NUM_LEAVING, NUM_BAD = 200, 24, 16
WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "while",
    "paged",
    "blocks",
    "of",
    "memory",
    "hold",
    "keys",
    "and",
    "values",
    "for",
    "every",
    "token",
]


@dataclass
class Job:
    """One well-formed request: what is sent, and what the offline API answers for it."""

    chat: bool
    prompt: Any  # a string (completions) or a conversation (chat)
    params: dict[str, Any]  # the request's sampling fields, as the openai client sends them
    expected_tokens: list[str] = field(default_factory=list)
    expected_text: str = ""
    expected_finish: str | None = None
    prompt_tokens: int = 0


@dataclass
class Seen:
    """What one streaming client received."""

    text: str = ""
    tokens: list[str] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    usage: Any = None
    ids: set[str] = field(default_factory=set)


def make_jobs(rng: random.Random) -> list[Job]:
    jobs = []
    for i in range(NUM_GOOD):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
        params: dict[str, Any] = {"max_tokens": rng.randint(8, 16)}
        if i % 2:
            params |= {"temperature": 0.8, "seed": 1000 + i}
        else:
            params |= {"temperature": 0.0}
        if i % 5 == 4:
            params["stop"] = [rng.choice(["e", "a", " "])]  # often met before max_tokens: finish "stop"
        chat = i % 4 == 3
        prompt = [{"role": "user", "content": text}] if chat else text
        jobs.append(Job(chat, prompt, params))
    return jobs


def fill_expected(offline: LLM, jobs: list[Job]) -> None:
    """``LLM.generate`` over every job at once (a chat rendered as the server renders it)."""
    tokenizer = offline.get_tokenizer()
    prompts = [
        render_chat(tokenizer, j.prompt, True, False, PLAIN_TEMPLATE) if j.chat else j.prompt for j in jobs
    ]
    params = [SamplingParams(logprobs=0, **j.params) for j in jobs]
    for job, out in zip(jobs, offline.generate(prompts, params, use_tqdm=False), strict=True):
        [sample] = out.outputs
        job.expected_tokens = [
            lp[t].decoded_token for t, lp in zip(sample.token_ids, sample.logprobs, strict=True)
        ]
        job.expected_text, job.expected_finish = sample.text, sample.finish_reason
        job.prompt_tokens = len(out.prompt_token_ids)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Served, ErrorLog]]:
    engine = LLMEngine(None, num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=MAX_NUM_SEQS)
    with serve(engine, None) as served:
        yield served


async def stream_one(c: openai.AsyncOpenAI, job: Job) -> Seen:
    seen = Seen()
    opts = {"include_usage": True}
    if job.chat:
        stream = await c.chat.completions.create(
            model=MODEL, messages=job.prompt, stream=True, stream_options=opts, logprobs=True, **job.params
        )
    else:
        stream = await c.completions.create(
            model=MODEL, prompt=job.prompt, stream=True, stream_options=opts, logprobs=0, **job.params
        )
    async with stream:
        async for chunk in stream:
            seen.ids.add(chunk.id)
            if chunk.usage is not None:
                seen.usage = chunk.usage
            for choice in chunk.choices:
                assert choice.index == 0
                if job.chat:
                    seen.text += choice.delta.content or ""
                    seen.tokens += [t.token for t in (choice.logprobs.content if choice.logprobs else [])]
                else:
                    seen.text += choice.text
                    seen.tokens += choice.logprobs.tokens if choice.logprobs else []
                if choice.finish_reason is not None:
                    seen.finish_reasons.append(choice.finish_reason)
    return seen


async def leave_after_first_chunk(c: openai.AsyncOpenAI, i: int, first: asyncio.Event) -> None:
    stream = await c.completions.create(
        model=MODEL, prompt=f"{i} leaves early", max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    async with stream:  # closed (the connection dropped) when the task is cancelled
        async for _ in stream:
            first.set()
    raise AssertionError("a leaving client read its whole stream")


BAD = [
    ({"temperature": -1}, openai.BadRequestError, "temperature"),
    ({"n": 0}, openai.BadRequestError, "n"),
    ({"max_tokens": 0}, openai.BadRequestError, "max_tokens"),
    ({"top_p": 2.0}, openai.BadRequestError, "top_p"),
    ({"logprobs": 21}, openai.BadRequestError, "logprobs"),
    ({"max_tokens": 5000}, openai.BadRequestError, "max_tokens"),
    ({"model": "gpt-4"}, openai.NotFoundError, "model"),
    ({"extra_body": {"n": 1.5}}, openai.BadRequestError, "n"),
]


async def refused(c: openai.AsyncOpenAI, i: int) -> tuple[type, str | None]:
    fields, _, _ = BAD[i % len(BAD)]
    kw = {"model": MODEL, "prompt": f"bad {i}", "max_tokens": 4} | fields
    try:
        await c.completions.create(**kw)
    except openai.APIStatusError as err:
        return type(err), err.param
    raise AssertionError(f"{fields} was accepted")


def test_hundreds_of_concurrent_streams(server: tuple[Served, ErrorLog]) -> None:
    served, errors = server
    jobs = make_jobs(random.Random(0))
    fill_expected(LLM(model=None, num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=MAX_NUM_SEQS, seed=0), jobs)
    before = scrape(served.url)

    async def burst() -> tuple[list[Seen], list[BaseException | None], list[tuple[type, str | None]]]:
        async with openai.AsyncOpenAI(
            base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120
        ) as c:
            firsts = [asyncio.Event() for _ in range(NUM_LEAVING)]
            leaving = [asyncio.ensure_future(leave_after_first_chunk(c, i, e)) for i, e in enumerate(firsts)]
            good = asyncio.gather(*(stream_one(c, job) for job in jobs))
            bad = asyncio.gather(*(refused(c, i) for i in range(NUM_BAD)))

            async def cancel_after_first(task: asyncio.Future, first: asyncio.Event) -> BaseException | None:
                waiter = asyncio.ensure_future(first.wait())
                await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    return None  # left as planned
                except BaseException as err:
                    return err
                return AssertionError("a leaving client finished")

            left = asyncio.gather(*(cancel_after_first(t, e) for t, e in zip(leaving, firsts, strict=True)))
            return tuple(await asyncio.gather(good, left, bad))  # type: ignore[return-value]

    seen, left, bad = asyncio.run(asyncio.wait_for(burst(), timeout=180))

    # every well-formed request streamed exactly what the offline API generates for it
    assert left == [None] * NUM_LEAVING
    assert bad == [(kind, param) for _, kind, param in (BAD[i % len(BAD)] for i in range(NUM_BAD))]
    mismatched = [
        (i, s.tokens, job.expected_tokens)
        for i, (s, job) in enumerate(zip(seen, jobs, strict=True))
        if s.tokens != job.expected_tokens
    ]
    assert not mismatched, mismatched[:3]
    for s, job in zip(seen, jobs, strict=True):
        assert s.text == job.expected_text and s.finish_reasons == [job.expected_finish]
        assert len(s.ids) == 1
        assert (s.usage.prompt_tokens, s.usage.completion_tokens) == (
            job.prompt_tokens,
            len(job.expected_tokens),
        )
    reasons = [job.expected_finish for job in jobs]
    assert (
        0 < reasons.count("stop") < NUM_GOOD and reasons.count("stop") + reasons.count("length") == NUM_GOOD
    )

    # nothing is left behind, and the metrics add up to what the clients saw
    wait_idle(served, timeout=60)
    after = scrape(served.url)
    assert delta(success(before), success(after)) == {
        "stop": reasons.count("stop"),
        "length": reasons.count("length"),
        "abort": NUM_LEAVING,
    }
    moved = delta(before, after)
    generated = sum(s.usage.completion_tokens for s in seen)
    assert metric(moved, "vllm:request_generation_tokens_sum") == generated
    assert metric(moved, "vllm:request_generation_tokens_count") == NUM_GOOD
    assert metric(moved, "vllm:request_prompt_tokens_sum") == sum(s.usage.prompt_tokens for s in seen)
    assert metric(moved, "vllm:e2e_request_latency_seconds_count") == NUM_GOOD
    # the leaving ones generated something before they were aborted, far from their 200 tokens each
    assert (
        generated + NUM_LEAVING
        <= metric(moved, "vllm:generation_tokens_total")
        < generated + 200 * NUM_LEAVING
    )
    assert metric(moved, "vllm:num_preemptions_total") == 0
    assert metric(after, "vllm:num_requests_running") == metric(after, "vllm:num_requests_waiting") == 0
    assert metric(after, "vllm:kv_cache_usage_perc") == 0
    assert errors.take() == [], "the server logged errors"


def test_expected_outputs_do_not_depend_on_the_batch() -> None:
    """The premise of the load test: the offline API gives a request the same tokens whether it runs
    alone or among hundreds (so the server's batching, whatever it is, must too)."""
    jobs = make_jobs(random.Random(0))[:40]
    offline = LLM(model=None, num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=MAX_NUM_SEQS, seed=0)
    fill_expected(offline, jobs)
    alone = [dataclasses.replace(j) for j in jobs[::7]]
    for job in alone:
        fill_expected(offline, [job])
    assert [(j.expected_tokens, j.expected_finish) for j in alone] == [
        (j.expected_tokens, j.expected_finish) for j in jobs[::7]
    ]
