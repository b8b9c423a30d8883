"""``echo``, ``logprobs`` and ``prompt_logprobs`` over HTTP: the same requests to ``vllm serve`` and
to this package's server, their answers compared field by field.

:func:`ask` sends :data:`REQUESTS` to one server (greedy, float32) and returns the JSON answers;
:func:`compare` lists every difference: texts, tokens, finish reasons and usage exactly; the
log-probabilities within :data:`TOLERANCE` (two engines' float32 sums); ranks and decoded tokens
exactly; which positions are ``null`` exactly.
"""

from __future__ import annotations

from typing import Any

import httpx

TOLERANCE = 2e-3
TEXT = "The capital of France is Paris. The capital of Italy is"
IDS = "token ids"  # stands for TEXT's token ids, from the server's own /tokenize

#: (route, body without "model"): what an evaluation harness and a curious client ask
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": IDS, "max_tokens": 2, "logprobs": 2, "echo": True, "temperature": 0}),
    (
        "/v1/completions",
        {
            "prompt": "The capital of France is",
            "max_tokens": 0,
            "logprobs": 1,
            "echo": True,
            "temperature": 0,
        },
    ),
    ("/v1/completions", {"prompt": IDS, "max_tokens": 3, "echo": True, "temperature": 0}),
    ("/v1/completions", {"prompt": IDS, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0}),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": 2,
            "prompt_logprobs": 1,
            "temperature": 0,
        },
    ),
]


def ask(url: str) -> list[dict[str, Any]]:
    """:data:`REQUESTS` against the server at ``url`` (its one model)."""
    with httpx.Client(base_url=url, timeout=300) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        ids = http.post("/tokenize", json={"model": model, "prompt": TEXT, "add_special_tokens": False})
        prompt = ids.json()["tokens"]
        answers = []
        for route, body in REQUESTS:
            body = {**body, "model": model} | ({"prompt": prompt} if body.get("prompt") == IDS else {})
            answers.append(http.post(route, json=body).json())
        return answers


def compare(ours: list[dict], theirs: list[dict]) -> list[str]:
    """Every difference between two servers' answers to :data:`REQUESTS` (empty: the same)."""
    found: list[str] = []
    for (route, body), a, b in zip(REQUESTS, ours, theirs, strict=True):
        where = f"{route} {sorted(body)}"
        if "error" in a or "error" in b:
            found.append(f"{where}: an error: ours {a.get('error')}, vLLM's {b.get('error')}")
            continue
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # (vLLM adds null details)
        _same(found, f"{where} usage", *({k: u["usage"].get(k) for k in counts} for u in (a, b)))
        _logprob_lists(found, f"{where} prompt_logprobs", a.get("prompt_logprobs"), b.get("prompt_logprobs"))
        for x, y in zip(a["choices"], b["choices"], strict=True):
            _same(found, f"{where} finish_reason", x["finish_reason"], y["finish_reason"])
            if "text" in x:
                _same(found, f"{where} text", x["text"], y["text"])
                _logprob_lists(found, f"{where} prompt_logprobs", x["prompt_logprobs"], y["prompt_logprobs"])
                _completion_logprobs(found, where, x["logprobs"], y["logprobs"])
            else:
                _same(found, f"{where} content", x["message"]["content"], y["message"]["content"])
    return found


def _same(found: list[str], what: str, a: Any, b: Any) -> None:
    if a != b:
        found.append(f"{what}: ours {str(a)[:120]}, vLLM's {str(b)[:120]}")


def _close(found: list[str], what: str, a: float | None, b: float | None) -> None:
    if (a is None) != (b is None) or (a is not None and b is not None and abs(a - b) > TOLERANCE):
        found.append(f"{what}: ours {a}, vLLM's {b}")


def _completion_logprobs(found: list[str], where: str, a: dict | None, b: dict | None) -> None:
    if a is None or b is None:
        _same(found, f"{where} logprobs", a, b)
        return
    for key in ("tokens", "text_offset"):
        _same(found, f"{where} logprobs.{key}", a[key], b[key])
    for i, (x, y) in enumerate(zip(a["token_logprobs"], b["token_logprobs"], strict=True)):
        _close(found, f"{where} token_logprobs[{i}]", x, y)
    for i, (x, y) in enumerate(zip(a["top_logprobs"], b["top_logprobs"], strict=True)):
        if x is None or y is None:
            _same(found, f"{where} top_logprobs[{i}]", x, y)
            continue
        _same(found, f"{where} top_logprobs[{i}] tokens", sorted(x), sorted(y))
        for token in set(x) & set(y):
            _close(found, f"{where} top_logprobs[{i}][{token!r}]", x[token], y[token])


def _logprob_lists(found: list[str], what: str, a: list | None, b: list | None) -> None:
    if a is None or b is None or len(a) != len(b):
        _same(found, what, a if a is None else len(a), b if b is None else len(b))
        return
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x is None or y is None:
            _same(found, f"{what}[{i}]", x, y)
            continue
        _same(found, f"{what}[{i}] token ids", sorted(x), sorted(y))
        for token in set(x) & set(y):
            _close(found, f"{what}[{i}][{token}].logprob", x[token]["logprob"], y[token]["logprob"])
            _same(found, f"{what}[{i}][{token}].rank", x[token]["rank"], y[token]["rank"])
            _same(
                found,
                f"{what}[{i}][{token}].decoded_token",
                x[token]["decoded_token"],
                y[token]["decoded_token"],
            )
