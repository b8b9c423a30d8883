"""Tools (function calling) on ``/v1/chat/completions``, as ``vllm serve`` 0.32 answers them.

**A default server** (no ``--enable-auto-tool-choice``) serves ``tools`` only with
``tool_choice: "none"``: the tools go to the chat template (which may show them to the model), and
the answer is plain text. Every other choice is a 400, as vLLM's ``render_chat`` refuses it:
``"auto"`` (the default whenever ``tools`` are given) needs ``--enable-auto-tool-choice`` and a
``--tool-call-parser``, and so do ``"required"`` and a named tool.

**With ``--enable-auto-tool-choice --tool-call-parser hermes``** the model's answer is parsed for
tool calls in the Hermes format (Nous Research's, used by Qwen 2.5, SmolLM3 and many others)::

    text before, if any <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

:func:`parse_hermes` finds each call (a call never closed runs to the end of the text); each becomes
an OpenAI ``tool_calls`` entry (``arguments`` a JSON string), the text before the first tag the
message's content, and ``finish_reason`` is ``"tool_calls"``. A call whose JSON does not parse makes
the whole answer plain content (vLLM's parser does the same). ``"required"`` and a named tool are
*forced*, with structured outputs: the answer must be ``<tool_call>``, the JSON of one call (its
``name`` one of the tools, or the named one; its ``arguments`` the tool's parameter schema), and
``</tool_call>`` (:func:`forced_grammar`; vLLM 0.32 forces the same text with an xgrammar structural
tag). SmolLM2's own chat template shows no tools to the model: serve it with a template that does,
``--chat-template chatml-tools`` (:data:`TEMPLATES`, shipped here).
"""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path
from typing import Any

from .errors import APIError

PARSERS = ("hermes",)
#: Chat templates shipped with the package, by name (``serve --chat-template NAME``).
TEMPLATES = {"chatml-tools": Path(__file__).with_name("templates") / "chatml_tools.jinja"}
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def check(tools: list[Any] | None, choice: Any, parser: str | None) -> str | dict | None:
    """``tool_choice`` checked against ``tools`` and the server's parser (vLLM's messages); returns
    the choice in force: ``None`` without tools, ``"none"``, ``"auto"``, ``"required"`` or a named one."""
    if tools is not None and not tools:
        raise APIError(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field "
            "entirely.",
            400,
            "tools",
        )
    if not tools:
        if choice not in (None, "none"):
            raise APIError("When using `tool_choice`, `tools` must be set.", 400, "tool_choice")
        return None
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        kind = tool.get("type", "function") if isinstance(tool, dict) else None
        if kind != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
            shape = "{'type': 'function', 'function': {'name': ..., 'parameters': {...}}}"
            raise APIError(f"tools[{i}] must be {shape}", 400, "tools")
    choice = "auto" if choice is None else choice
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise APIError(
                "tool_choice must name a function: {'type': 'function', 'function': {'name': ...}}",
                400,
                "tool_choice.function.name",
            )
        if name not in names(tools):
            raise APIError(
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                400,
                "tool_choice",
            )
    elif choice not in ("none", "auto", "required"):
        raise APIError(
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" are '
            "supported.",
            400,
            "tool_choice",
        )
    if choice != "none" and parser is None:
        if choice == "auto":
            message = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        else:
            which = '"required"' if choice == "required" else f'function "{choice["function"]["name"]}"'
            message = f"tool_choice={which} requires --tool-call-parser to be set"
        raise APIError(message, 400, "tool_choice")
    return choice


def names(tools: list[dict]) -> list[str]:
    return [tool["function"]["name"] for tool in tools]


def forced_grammar(tools: list[dict], choice: str | dict) -> str:
    """The EBNF grammar (xgrammar's) of one Hermes tool call: ``<tool_call>``, a JSON object with the
    tool's ``name`` and its ``arguments`` (the tool's ``parameters`` schema), ``</tool_call>``. A
    schema's ``$defs`` (pydantic's nested models) move to the root, where its ``$ref``\\ s point; a
    schema xgrammar cannot take is a 400 naming ``tools``."""
    import xgrammar

    chosen = [choice["function"]["name"]] if isinstance(choice, dict) else names(tools)
    options, defs = [], {}
    for tool in tools:
        function = tool["function"]
        if function["name"] not in chosen:
            continue
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise APIError(
                f"tools: the parameters of {function['name']!r} must be a JSON schema object", 400, "tools"
            )
        parameters = dict(parameters)
        for key in ("$defs", "definitions"):
            for name, schema in (parameters.pop(key, None) or {}).items():
                if defs.get(name, schema) != schema:
                    raise APIError(
                        f"tools: two tools define {name!r} differently in their $defs", 400, "tools"
                    )
                defs[name] = schema
        options.append({
            "type": "object",
            "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })  # fmt: skip
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    if defs:
        schema = {**schema, "$defs": defs}
        text = json.dumps(schema).replace('"#/definitions/', '"#/$defs/')
    else:
        text = json.dumps(schema)
    try:
        body = xgrammar.Grammar.from_json_schema(text, any_whitespace=False)
    except (RuntimeError, ValueError, TypeError) as err:
        raise APIError(
            f"tools: a tool's parameters are not a schema this server can force: {err}", 400, "tools"
        ) from None
    grammar = xgrammar.Grammar.concat(
        xgrammar.Grammar.from_ebnf('root ::= "<tool_call>\\n"'),
        body,
        xgrammar.Grammar.from_ebnf('root ::= "\\n</tool_call>"'),
    )
    return str(grammar)


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` from a Hermes-format answer (see the module docstring): no call, or
    a call that is not JSON with a ``name``, and the whole text is the content."""
    found = list(_CALL.finditer(text))
    if not found:
        return text, []
    calls = []
    try:
        for match in found:
            call = json.loads(match.group(1) if match.group(1) is not None else match.group(2))
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return text, []
            arguments = call.get("arguments", {})
            calls.append({
                "id": f"chatcmpl-tool-{secrets.token_hex(8)}",
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
            })  # fmt: skip
    except ValueError:
        return text, []
    content = text[: found[0].start()]
    return (content if content.strip() else None), calls


def holding(text: str) -> int:
    """Where a streamed answer's shown text must stop: before a ``<tool_call>`` (or the start of
    one, the last characters being a prefix of the tag), so that a call is never streamed as text."""
    start = text.find("<tool_call>")
    if start >= 0:
        return start
    for keep in range(min(len(text), len("<tool_call>") - 1), 0, -1):
        if "<tool_call>".startswith(text[-keep:]):
            return len(text) - keep
    return len(text)
