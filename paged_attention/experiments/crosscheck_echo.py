"""``echo``, ``logprobs`` and ``prompt_logprobs`` over HTTP: the same requests to ``vllm serve`` and
to this package's server, their answers compared field by field.

:func:`ask` sends :data:`REQUESTS` to one server (greedy, float32) and returns the JSON answers;
:func:`compare` fails a :class:`~.crosscheck.Check` on every difference: texts, tokens, finish
reasons and usage exactly; ``prompt_logprobs`` by the offline cross-check's own rule
(:func:`~.crosscheck.compare_logprobs`), and the completions' ``logprobs`` values within its
:data:`~.crosscheck.LOGPROB_TOL`; which positions are ``null`` exactly.
"""

from __future__ import annotations

from typing import Any

import httpx

from .crosscheck import Check, close, compare_logprobs

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


def compare(check: Check, ours: list[dict], theirs: list[dict]) -> None:
    """Fail ``check`` on every difference between two servers' answers to :data:`REQUESTS`."""
    for (route, body), a, b in zip(REQUESTS, ours, theirs, strict=True):
        where = f"{route} {sorted(body)}"
        if "error" in a or "error" in b:
            check.fail(f"{where}: an error: ours {a.get('error')}, vLLM's {b.get('error')}")
            continue
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # (vLLM adds null details)
        _same(check, f"{where} usage", *({k: u["usage"].get(k) for k in counts} for u in (a, b)))
        prompt = f"{where} prompt_logprobs"
        compare_logprobs(
            check, prompt, _entries(a.get("prompt_logprobs")), _entries(b.get("prompt_logprobs"))
        )
        for x, y in zip(a["choices"], b["choices"], strict=True):
            _same(check, f"{where} finish_reason", x["finish_reason"], y["finish_reason"])
            if "text" in x:
                _same(check, f"{where} text", x["text"], y["text"])
                compare_logprobs(
                    check, prompt, _entries(x["prompt_logprobs"]), _entries(y["prompt_logprobs"])
                )
                _completion_logprobs(check, where, x["logprobs"], y["logprobs"])
            else:
                _same(check, f"{where} content", x["message"]["content"], y["message"]["content"])


def _entries(field: list | None) -> list | None:
    """vLLM's JSON ``prompt_logprobs`` (``{"token id": {logprob, rank, decoded_token}}`` per position)
    in the offline cross-check's form, ``[(token_id, logprob, rank, text), ...]``, order kept."""
    if field is None:
        return None
    return [
        None
        if entry is None
        else [(int(t), e["logprob"], e["rank"], e["decoded_token"]) for t, e in entry.items()]
        for entry in field
    ]


def _same(check: Check, what: str, a: Any, b: Any) -> None:
    if a != b:
        check.fail(f"{what}: ours {str(a)[:120]}, vLLM's {str(b)[:120]}")


def _completion_logprobs(check: Check, where: str, a: dict | None, b: dict | None) -> None:
    """The completions ``logprobs`` object: tokens and offsets exactly, values within the tolerance."""
    if a is None or b is None:
        _same(check, f"{where} logprobs", a, b)
        return
    for key in ("tokens", "text_offset"):
        _same(check, f"{where} logprobs.{key}", a[key], b[key])
    for i, (x, y) in enumerate(zip(a["token_logprobs"], b["token_logprobs"], strict=True)):
        if not close(x, y):
            check.fail(f"{where} token_logprobs[{i}]: ours {x}, vLLM's {y}")
    for i, (x, y) in enumerate(zip(a["top_logprobs"], b["top_logprobs"], strict=True)):
        if x is None or y is None:
            _same(check, f"{where} top_logprobs[{i}]", x, y)
            continue
        _same(check, f"{where} top_logprobs[{i}] tokens", sorted(x), sorted(y))
        for token in set(x) & set(y):
            if not close(x[token], y[token]):
                check.fail(f"{where} top_logprobs[{i}][{token!r}]: ours {x[token]}, vLLM's {y[token]}")
