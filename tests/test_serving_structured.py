"""Structured outputs through the server, with the ``openai`` client: ``response_format`` (``json_object``,
``json_schema``) and vLLM's ``structured_outputs`` object on both endpoints; the answers equal the
offline engine's, streamed or not, and every bad constraint is a 400 naming its field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from paged_attention import LLM, SamplingParams, StructuredOutputsParams
from paged_attention.engine.chat import PLAIN_TEMPLATE
from paged_attention.engine.llm_engine import LLMEngine

from .test_serving import CHAT, MODEL, NUM_KV_BLOCKS, serve

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "kind": {"enum": ["cat", "dog"]}},
    "required": ["name", "kind"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with serve(LLMEngine(None, num_kv_blocks=NUM_KV_BLOCKS), None) as (served, errors):
        with openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
            yield c
        assert errors.take() == [], "the server logged errors"


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(model=None, num_kv_blocks=NUM_KV_BLOCKS)


def offline_chat(offline: LLM, constraint: StructuredOutputsParams, max_tokens: int) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=constraint)
    return offline.chat(CHAT, params, use_tqdm=False, chat_template=PLAIN_TEMPLATE)[0].outputs[0].text


def test_chat_with_a_json_schema_answers_what_the_offline_engine_answers(client, offline) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=60, response_format=RESPONSE_FORMAT
    )
    text = answer.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert answer.choices[0].finish_reason == "stop"
    assert text == offline_chat(offline, StructuredOutputsParams(json=SCHEMA), 60)


def test_streamed_json_schema_deltas_add_up_to_the_same_answer(client, offline) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=60, response_format=RESPONSE_FORMAT, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == offline_chat(offline, StructuredOutputsParams(json=SCHEMA), 60)


def test_json_object_gives_a_json_object(client) -> None:
    answer = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        seed=4,
        max_tokens=60,
        n=3,
        response_format={"type": "json_object"},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )
    finished = [c.message.content for c in answer.choices if c.finish_reason == "stop"]
    assert finished, [c.message.content for c in answer.choices]
    assert all(isinstance(json.loads(text), dict) for text in finished)


@pytest.mark.parametrize(
    ("structured", "check"),
    [
        ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"regex": "[A-Z][a-z]{2,4}-[0-9]{2}"}, lambda t: re.fullmatch("[A-Z][a-z]{2,4}-[0-9]{2}", t)),
        ({"grammar": 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'}, lambda t: re.fullmatch(r"\(\d+(\+\d+)*\)", t)),
    ],
)
def test_vllms_structured_outputs_field_on_completions(client, offline, structured, check) -> None:
    answer = client.completions.create(
        model=MODEL,
        prompt="The answer is",
        temperature=0,
        max_tokens=24,
        extra_body={"structured_outputs": structured},
    )
    text = answer.choices[0].text
    assert answer.choices[0].finish_reason == "stop" and check(text), text
    params = SamplingParams(
        temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(**structured)
    )
    assert text == offline.generate(["The answer is"], params, use_tqdm=False)[0].outputs[0].text


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs", "could not be compiled"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "Regex parsing error"),
        ({"structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs", "matches no text"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
        ({"structured_outputs": {"pattern": "a"}}, "structured_outputs", "has no field pattern"),
        ({"structured_outputs": {"choice": "a"}}, "structured_outputs", "list of non-empty strings"),
        (
            {"response_format": {"type": "xml"}},
            "response_format",
            "must be 'text', 'json_object' or 'json_schema'",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema object"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "structured_outputs",
            "could not be compiled",
        ),
    ],
)
def test_bad_constraints_are_a_400_naming_the_field(client, body, param, message) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, extra_body=body)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param, error
    assert message in error["message"], error
    ok = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)  # and it serves on
    assert ok.choices[0].finish_reason in ("stop", "length")
