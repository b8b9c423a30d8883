"""What a request's output must match: vLLM's ``StructuredOutputsParams``, checked at the door.

Exactly one constraint: ``json`` (a JSON schema, as a dict or its text), ``regex``, ``choice`` (a
list of strings: the output is one of them), ``grammar`` (EBNF in xgrammar's dialect, GBNF-like:
``root ::= ...``, or Lark, ``start: ...``, as vLLM takes both) or ``json_object`` (any JSON
object: OpenAI's ``response_format: json_object``).
``disable_any_whitespace`` makes JSON compact (no whitespace the schema does not need), as vLLM's
option of that name; ``disable_additional_properties`` adds ``"additionalProperties": false`` to
every object of a schema that says nothing about it. vLLM's ``structural_tag`` and
``whitespace_pattern`` are accepted at their neutral value (``None``) only.
"""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass
from typing import Any

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output (see the module docstring); checked when built."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if self.structural_tag is not None or self.whitespace_pattern is not None:
            raise ValueError("structural_tag and whitespace_pattern are vLLM options this engine does not "
                             "have: only None is accepted")  # fmt: skip
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(CONSTRAINTS)}; got "
                + (", ".join(given) if given else "none")
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise TypeError(
                f"structured_outputs.json must be a JSON schema (a dict or its text), got {self.json!r}"
            )
        if isinstance(self.json, str):
            try:
                schema = jsonlib.loads(self.json)
            except ValueError as err:
                raise ValueError(f"structured_outputs.json is not valid JSON: {err}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(
                    f"structured_outputs.json must be a JSON schema (an object), got {self.json!r}"
                )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise TypeError(
                f"structured_outputs.choice must be a list of non-empty strings, got {self.choice!r}"
            )
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(
                f"structured_outputs.json_object must be True (or left out), got {self.json_object!r}"
            )
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"structured_outputs.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of :data:`CONSTRAINTS`."""
        return next(name for name in CONSTRAINTS if getattr(self, name) is not None)

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema as a dict (``json_object``: any object), with ``additionalProperties``
        closed where asked; ``None`` for the other constraints."""
        if self.json_object:
            return {"type": "object"}
        if self.json is None:
            return None
        schema = jsonlib.loads(self.json) if isinstance(self.json, str) else self.json
        return _closed(schema) if self.disable_additional_properties else schema


def _closed(schema: Any) -> Any:
    """A copy of ``schema`` whose objects without an ``additionalProperties`` say ``false``."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
