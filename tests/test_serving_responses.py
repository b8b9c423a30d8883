"""``POST /v1/responses`` (serving/responses_api.py) with the ``openai`` client, langchain-openai and
litellm: the text is the offline engine's answer to the same conversation, streamed as vLLM's
events, cut answers are ``incomplete``, and what is not stored is a 404."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from paged_attention import LLM, SamplingParams
from paged_attention.engine.chat import PLAIN_TEMPLATE
from paged_attention.engine.llm_engine import LLMEngine

from .test_serving import MODEL, NUM_KV_BLOCKS, serve

INSTRUCTIONS = "Answer briefly."
MAX = 16  # output tokens: OpenAI's least max_output_tokens (litellm raises a smaller one to it)
QUESTION = "hello"
EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serve(LLMEngine(None, num_kv_blocks=NUM_KV_BLOCKS), None) as (served, errors):
        yield served.url
        assert errors.take() == [], "the server logged errors"


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline_text() -> str:
    llm = LLM(model=None, num_kv_blocks=NUM_KV_BLOCKS)
    conversation = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    params = SamplingParams(temperature=0, max_tokens=MAX)
    return llm.chat(conversation, params, use_tqdm=False, chat_template=PLAIN_TEMPLATE)[0].outputs[0].text


def test_a_response_is_the_offline_answer_to_the_same_conversation(client, offline_text) -> None:
    response = client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=MAX, temperature=0
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == offline_text
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == MAX
    assert response.usage.total_tokens == response.usage.input_tokens + MAX
    as_list = client.responses.create(
        model=MODEL,
        instructions=INSTRUCTIONS,
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        max_output_tokens=MAX,
        temperature=0,
    )
    assert as_list.output_text == offline_text


def test_streamed_events_come_in_vllms_order_and_add_up(client, offline_text) -> None:
    events = list(
        client.responses.create(
            model=MODEL,
            instructions=INSTRUCTIONS,
            input=QUESTION,
            max_output_tokens=MAX,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert [k for k in kinds if k != "response.output_text.delta"] == EVENTS
    assert kinds.count("response.output_text.delta") >= 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == offline_text == events[-1].response.output_text


def test_text_format_asks_for_structured_output(client) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": schema}}
    response = client.responses.create(
        model=MODEL, input=QUESTION, text=fmt, max_output_tokens=64, temperature=0
    )
    assert response.status == "completed" and json.loads(response.output_text) in (
        {"ok": True},
        {"ok": False},
    )
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input=QUESTION, text={"format": {"type": "xml"}})
    assert caught.value.body["param"] == "text"


def test_nothing_is_stored_so_a_previous_response_is_not_found(client) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=MODEL, input=QUESTION, previous_response_id="resp_0123456789abcdef")
    assert "not found" in caught.value.body["message"] and caught.value.body["param"] == "response_id"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input=[{"content": "no role"}])
    assert caught.value.body["param"] == "input"


def test_langchain_and_litellm_read_responses(url: str, offline_text: str) -> None:
    import litellm
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        base_url=url + "/v1",
        api_key="unused",
        model=MODEL,
        temperature=0,
        max_tokens=MAX,
        use_responses_api=True,
    )
    message = chat.invoke([("system", INSTRUCTIONS), ("user", QUESTION)])
    assert message.text == offline_text
    response = litellm.responses(
        model=f"openai/{MODEL}",
        api_base=url + "/v1",
        api_key="unused",
        input=QUESTION,
        instructions=INSTRUCTIONS,
        max_output_tokens=MAX,
        temperature=0,
    )
    assert response.output[0].content[0].text == offline_text
