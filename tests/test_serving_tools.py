"""Tools on ``/v1/chat/completions`` as ``vllm serve`` 0.32 answers them (serving/tools.py): refused
without a parser except ``tool_choice: "none"``; with ``hermes``, calls parsed from the answer,
``"required"`` and named choices forced by a grammar; and the clients nobody here wrote
(langchain-openai, litellm) get tool calls and structured answers they can use."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from paged_attention.engine.llm_engine import LLMEngine
from paged_attention.serving import AsyncLLM, build_app
from paged_attention.serving.launch import ServerThread
from paged_attention.serving.tools import TEMPLATES, holding, parse_hermes

from .test_serving import MODEL, NUM_KV_BLOCKS, ErrorLog

PARAMETERS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "metric": {"type": "boolean"}},
    "required": ["city", "metric"],
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city", "parameters": PARAMETERS},
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC"]}}},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


ENGINES: dict[str | None, LLMEngine] = {}


def served(tool_parser: str | None) -> Iterator[str]:
    engine = ENGINES[tool_parser] = LLMEngine(None, num_kv_blocks=NUM_KV_BLOCKS * 8)  # tools: ~500 tokens
    llm = AsyncLLM(engine)
    app = build_app(llm, MODEL, TEMPLATES["chatml-tools"].read_text(), (), tool_parser)
    server = ServerThread(app)
    with ErrorLog() as errors:
        server.start()
        try:
            yield server.url
        finally:
            server.stop()
        assert errors.take() == [], "the server logged errors"


@pytest.fixture(scope="module")
def plain() -> Iterator[openai.OpenAI]:
    for url in served(None):
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            yield client


@pytest.fixture(scope="module")
def hermes_url() -> Iterator[str]:
    yield from served("hermes")


@pytest.fixture(scope="module")
def hermes(hermes_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=hermes_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


@pytest.mark.parametrize(
    ("choice", "message"),
    [
        (None, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
        ("auto", '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
        ("required", 'tool_choice="required" requires --tool-call-parser to be set'),
        (
            {"type": "function", "function": {"name": "get_weather"}},
            'tool_choice=function "get_weather" requires --tool-call-parser to be set',
        ),
    ],
)
def test_a_default_server_refuses_tool_calls_as_vllm_does(plain, choice, message) -> None:
    extra = {} if choice is None else {"tool_choice": choice}
    with pytest.raises(openai.BadRequestError) as caught:
        plain.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=8, **extra)
    assert caught.value.body["message"] == message and caught.value.body["param"] == "tool_choice"


def test_tool_choice_none_serves_with_the_tools_shown_to_the_template(plain) -> None:
    bare = plain.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
    shown = plain.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=4, temperature=0, tools=[WEATHER], tool_choice="none"
    )
    assert shown.usage.prompt_tokens > bare.usage.prompt_tokens + 20  # the tools are in the prompt
    assert shown.choices[0].message.tool_calls is None and shown.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"tool_choice": "required"}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
        ({"tools": []}, "tools", "`tools` must not be an empty array"),
        (
            {"tools": [WEATHER], "tool_choice": "always"},
            "tool_choice",
            "Invalid value for `tool_choice`: always!",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "does not match any of the specified `tools`",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function.name", "must name"),
        ({"tools": [{"type": "function"}]}, "tools", "tools[0] must be"),
    ],
)
def test_bad_tool_requests_are_a_400_naming_the_field(hermes, body, param, message) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        hermes.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, extra_body=body)
    assert caught.value.body["param"] == param and message in caught.value.body["message"], caught.value.body


def check_call(call, tool: dict) -> None:
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_a_required_tool_choice_is_forced_into_one_valid_call(hermes) -> None:
    answer = hermes.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=200, seed=1, n=2
    )
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content == ""
        [call] = choice.message.tool_calls
        check_call(call, WEATHER if call.function.name == "get_weather" else TIME)


def test_parallel_tool_calls_false_keeps_the_first_call(hermes_url: str) -> None:
    import httpx

    two = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>' * 2
    body = {"model": MODEL, "messages": ASK, "tools": [TIME], "max_tokens": 200, "temperature": 0,
            "structured_outputs": {"regex": re.escape(two)}}  # fmt: skip
    for parallel, count in ((True, 2), (False, 1)):
        request = {**body, "parallel_tool_calls": parallel}
        answer = httpx.post(hermes_url + "/v1/chat/completions", json=request, timeout=60).json()
        assert len(answer["choices"][0]["message"]["tool_calls"]) == count, answer


def test_a_named_tool_choice_calls_that_tool_streamed_or_not(hermes) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named, max_tokens=200, temperature=0
    )
    whole = hermes.chat.completions.create(**kwargs)
    [call] = whole.choices[0].message.tool_calls
    check_call(call, WEATHER)
    chunks = list(hermes.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in streamed] == [
        (0, "get_weather", call.function.arguments)
    ]
    assert (
        "".join(d.content or "" for d in deltas) == "" and chunks[-1].choices[0].finish_reason == "tool_calls"
    )


def test_a_conversation_with_a_tool_result_is_answered(hermes) -> None:
    arguments = '{"city": "Paris", "metric": true}'
    call = {
        "id": "chatcmpl-tool-1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "18 C, sunny"},
    ]
    answer = hermes.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=6)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_call_cut_short_by_max_tokens_is_text_and_nothing_leaks(hermes) -> None:
    """A forced call that runs out of tokens before it closes: plain content (its JSON does not
    parse), finish_reason length, as vLLM's hermes parser answers; every block back in the pool."""
    answer = hermes.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=10, temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.startswith("<tool_call>")
    stream = hermes.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=10,
        temperature=0,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    engine = ENGINES["hermes"]
    deadline = time.monotonic() + 10
    while (
        engine.cache_manager.num_free_blocks != engine.cache_manager.num_blocks
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert engine.cache_manager.num_free_blocks == engine.cache_manager.num_blocks


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("no call here", "no call here", []),
        (
            'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
            "Sure.\n",
            [("f", '{"a": 1}')],
        ),
        (
            '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g"}</tool_call>',
            None,
            [("f", "{}"), ("g", "{}")],
        ),
        (
            '<tool_call>\n{"name": "f", "arguments": {"a": 1}}',
            None,
            [("f", '{"a": 1}')],
        ),  # never closed, whole
        ('<tool_call>\n{"name": "f", "argum', '<tool_call>\n{"name": "f", "argum', []),  # never closed, cut
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            '<tool_call>{"arguments": {}}</tool_call>',
            [],
        ),  # no name
    ],
)
def test_the_hermes_parser(text: str, content: str | None, calls: list) -> None:
    got_content, got_calls = parse_hermes(text)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls


def test_streamed_text_stops_before_a_tool_call_tag() -> None:
    assert [holding(t) for t in ("abc", "abc <tool", "abc <tool_call>{", "<", "a<tool_call")] == [
        3,
        4,
        4,
        0,
        1,
    ]


def test_langchain_bind_tools_and_with_structured_output(hermes_url: str) -> None:
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: str
        metric: bool

    Weather.model_config["json_schema_extra"] = {"properties": PARAMETERS["properties"]}
    chat = ChatOpenAI(
        base_url=hermes_url + "/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=200
    )
    message = chat.bind_tools([WEATHER], tool_choice="any").invoke("What is the weather in Paris?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Rome", "Oslo")
    for method in ("json_schema", "function_calling"):
        answer = chat.with_structured_output(Weather, method=method).invoke("The weather in Paris, please.")
        assert isinstance(answer, Weather) and answer.city in ("Paris", "Rome", "Oslo"), (method, answer)


def test_litellm_response_format_and_tools(hermes_url: str) -> None:
    import litellm

    common = dict(model=f"openai/{MODEL}", api_base=hermes_url + "/v1", api_key="unused", messages=ASK)
    answer = litellm.completion(
        **common, response_format={"type": "json_object"}, max_tokens=48, temperature=0
    )
    content = answer.choices[0].message.content
    assert answer.choices[0].finish_reason != "stop" or isinstance(json.loads(content), dict), content
    answer = litellm.completion(**common, tools=[WEATHER], tool_choice="required", max_tokens=200)
    [call] = answer.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS)
