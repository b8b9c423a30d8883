"""``echo`` and ``prompt_logprobs`` on the server, as vLLM answers them (lm-evaluation-harness's
log-likelihood requests are ``{"prompt": ids, "max_tokens": 1, "logprobs": 1, "echo": true}``):
checked against the offline engine's own prompt and output log-probabilities, number for number."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from paged_attention.engine.llm import LLM
from paged_attention.engine.llm_engine import LLMEngine
from paged_attention.engine.params import SamplingParams

from .test_serving import NUM_KV_BLOCKS, Served, serve, sse_payloads

IDS = [5, 17, 3, 99, 42, 7, 8]


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    engine = LLMEngine(None, num_kv_blocks=NUM_KV_BLOCKS)
    with serve(engine, None) as (served, errors):
        yield served
        assert errors.take() == [], "the server logged errors"


@pytest.fixture(scope="module")
def http(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(model=None, num_kv_blocks=NUM_KV_BLOCKS)


def offline_run(offline: LLM, max_tokens: int, k: int = 1):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=k, prompt_logprobs=k)
    return offline.generate([{"prompt_token_ids": IDS}], params, use_tqdm=False)[0]


def test_echo_with_logprobs_gives_the_prompts_and_the_outputs_logprobs(
    http: httpx.Client, offline: LLM
) -> None:
    want = offline_run(offline, 3)
    body = {"prompt": IDS, "max_tokens": 3, "logprobs": 1, "echo": True, "temperature": 0}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    tokenizer = offline.get_tokenizer()
    assert choice["text"] == tokenizer.decode(IDS) + want.outputs[0].text
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(IDS) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts it
    assert lp["tokens"][0] == tokenizer.decode(IDS[:1])
    prompt_values = [entry[t].logprob for t, entry in zip(IDS[1:], want.prompt_logprobs[1:], strict=True)]
    output = want.outputs[0]
    output_values = [e[t].logprob for t, e in zip(output.token_ids, output.logprobs, strict=True)]
    assert lp["token_logprobs"][1:] == pytest.approx(prompt_values + output_values, abs=1e-6)
    for i, entry in enumerate(want.prompt_logprobs[1:], start=1):  # each position's most likely token
        best = min(entry.values(), key=lambda v: v.rank or 0)
        assert max(lp["top_logprobs"][i], key=lp["top_logprobs"][i].get) == best.decoded_token
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(IDS)


def test_echo_with_max_tokens_0_gives_the_prompt_alone(http: httpx.Client, offline: LLM) -> None:
    want = offline_run(offline, 1)
    body = {"prompt": IDS, "max_tokens": 0, "logprobs": 1, "echo": True, "temperature": 0}
    answer = http.post("/v1/completions", json=body).json()
    choice = answer["choices"][0]
    assert choice["text"] == offline.get_tokenizer().decode(IDS)
    values = choice["logprobs"]["token_logprobs"]
    assert len(values) == len(IDS) and values[0] is None
    prompt = [e[t].logprob for t, e in zip(IDS[1:], want.prompt_logprobs[1:], strict=True)]
    assert values[1:] == pytest.approx(prompt)
    assert answer["usage"]["completion_tokens"] == 1  # as vLLM: one token generated, not shown


def test_echo_of_a_string_prompt_streamed(http: httpx.Client) -> None:
    body = {"prompt": "The cat sat on", "max_tokens": 4, "echo": True, "temperature": 0}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert whole.startswith("The cat sat on") and len(whole) > len("The cat sat on")
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        chunks = sse_payloads(list(response.iter_lines()))
    texts = [c["choices"][0]["text"] for c in chunks if c.get("choices")]
    assert texts[0].startswith("The cat sat on") and "".join(texts) == whole


def test_prompt_logprobs_field_on_both_endpoints(http: httpx.Client, offline: LLM) -> None:
    want = offline_run(offline, 1, k=2)
    body = {"prompt": IDS, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0}
    field = http.post("/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"]
    assert field[0] is None and len(field) == len(IDS)
    for got, entry in zip(field[1:], want.prompt_logprobs[1:], strict=True):
        assert set(got) == {str(t) for t in entry}
        for token_id, lp in entry.items():
            assert got[str(token_id)]["logprob"] == pytest.approx(lp.logprob, abs=1e-6)
            assert got[str(token_id)]["rank"] == lp.rank
            assert got[str(token_id)]["decoded_token"] == lp.decoded_token
    no_field = http.post("/v1/completions", json={**body, "prompt_logprobs": None}).json()
    assert no_field["choices"][0]["prompt_logprobs"] is None
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1, "prompt_logprobs": 0}
    answer = http.post("/v1/chat/completions", json=chat).json()
    assert answer["prompt_logprobs"][0] is None and len(answer["prompt_logprobs"]) > 3
    assert all(len(entry) == 1 for entry in answer["prompt_logprobs"][1:])  # the prompt token itself


def test_max_tokens_0_without_echo_is_refused(http: httpx.Client) -> None:
    answer = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "max_tokens"
