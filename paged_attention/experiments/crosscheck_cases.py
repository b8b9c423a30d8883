"""The cross-check's cases: what both engines are asked, in one JSON spec (:mod:`.peer_probe`).

Several families of prompt, short and long, as completions and as chats; greedy decoding (token ids
must be identical), log-probabilities of outputs and prompts, seeded sampling with every filter and
penalty (identical too: :mod:`..engine.sample.gumbel`), stops and the other request fields, the prefix
cache, and ``SamplingParams``' defaults and ``repr``. Everything runs in float32, the dtype in which
two engines' kernels round alike enough for argmaxes to agree.
"""

from __future__ import annotations

from typing import Any

from ..models.corpus import CORPUS
from .prompts import QUESTIONS

COMPLETIONS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "A list of five fruits:\n1.",
    "12 + 35 =",
    "Once upon a time, in a small village by the sea,",
    "Paris est la capitale de la France. Berlin est",
    "Hello",
    # a long prompt: a few paragraphs of the embedded model's prose (about 300 tokens)
    CORPUS[:1400] + "\n\nIn one sentence, the main idea is",
]

CHATS = [[{"role": "user", "content": q}] for q in QUESTIONS[:6]] + [
    [
        {"role": "system", "content": "You are a terse assistant. Answer in at most ten words."},
        {"role": "user", "content": "What is a KV cache?"},
    ],
    [
        {"role": "user", "content": "Pick a number between 1 and 10."},
        {"role": "assistant", "content": "7."},
        {"role": "user", "content": "Now double it and explain."},
    ],
]

#: Sampling settings whose seeded draws must be identical on both engines.
SEEDED = {
    "top_p": dict(temperature=0.8, top_p=0.95, seed=42, n=2),
    "plain": dict(temperature=1.0, seed=7),
    "top_k_min_p": dict(temperature=0.7, top_k=20, min_p=0.05, seed=3),
    "penalties": dict(
        temperature=0.9, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3, seed=11
    ),
    "all_filters_logprobs": dict(temperature=0.6, top_p=0.5, top_k=5, min_p=0.01, seed=123, logprobs=2),
}

#: Structured outputs (xgrammar in both engines): ``(name, StructuredOutputsParams fields, case kind)``.
#: Not ``disable_any_whitespace``: vLLM 0.32's xgrammar backend reads only the engine-wide setting.
STRUCTURED = [
    (
        "json schema",
        {
            "json": {
                "type": "object",
                "properties": {"answer": {"type": "string"}, "confidence": {"type": "integer"}},
                "required": ["answer", "confidence"],
            }
        },
        "chat",
    ),
    ("json object", {"json_object": True}, "chat"),
    ("regex", {"regex": r"[A-Z][a-z]+ (is|are) [a-z ]{3,20}\."}, "generate"),
    ("choice", {"choice": ["yes", "no", "it depends"]}, "chat"),
    ("grammar", {"grammar": 'root ::= num (" + " num)* " = " num\nnum ::= [1-9] [0-9]*'}, "generate"),
]

#: ``SamplingParams`` fields whose defaults must agree.
DEFAULT_FIELDS = [
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
    "min_p", "seed", "stop", "stop_token_ids", "bad_words", "ignore_eos", "max_tokens", "min_tokens",
    "logprobs", "prompt_logprobs", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "logit_bias", "allowed_token_ids", "output_kind", "extra_args",
]  # fmt: skip


def cases(model: str, max_tokens: int = 32) -> dict[str, Any]:
    """The spec :mod:`.peer_probe` reads: engine settings (float32, block size 32 on both: vLLM's
    CPU default is 128 and it takes multiples of 32) and the cases."""
    greedy = dict(temperature=0, max_tokens=max_tokens)
    some = COMPLETIONS[:4]
    spec: list[dict[str, Any]] = [
        {"name": "greedy completions", "kind": "generate", "prompts": COMPLETIONS, "params": greedy},
        {"name": "greedy chats", "kind": "chat", "conversations": CHATS, "params": greedy},
        {
            "name": "greedy token-id prompt",
            "kind": "generate",
            "prompts": [{"prompt_token_ids": [1, 504, 3575, 282, 4649, 314]}],
            "params": greedy,
        },
        {
            "name": "logprobs and prompt logprobs",
            "kind": "generate",
            "prompts": some,
            "params": dict(temperature=0, max_tokens=12, logprobs=5, prompt_logprobs=5),
        },
        {
            "name": "stop strings",
            "kind": "generate",
            "prompts": COMPLETIONS[:5],
            "params": dict(temperature=0, max_tokens=max_tokens, stop=[".", "\n"]),
        },
        {
            "name": "stop strings kept",
            "kind": "generate",
            "prompts": COMPLETIONS[:5],
            "params": dict(temperature=0, max_tokens=max_tokens, stop=["."], include_stop_str_in_output=True),
        },
        {
            "name": "stop token ids, min_tokens",
            "kind": "generate",
            "prompts": some,
            "params": dict(temperature=0, max_tokens=max_tokens, stop_token_ids=[30, 28], min_tokens=3),
        },
        {
            "name": "ignore_eos",
            "kind": "chat",
            "conversations": CHATS[:2],
            "params": dict(temperature=0, max_tokens=48, ignore_eos=True),
        },
        {
            "name": "bad words, logit_bias",
            "kind": "generate",
            "prompts": some[:2],
            "params": dict(temperature=0, max_tokens=12, bad_words=["Paris", " the"], logit_bias={216: 2.5}),
        },
        {
            "name": "allowed token ids",
            "kind": "generate",
            "prompts": some[:2],
            "params": dict(temperature=0, max_tokens=8, allowed_token_ids=[216, 30, 33, 34, 35, 198]),
        },
        {
            "name": "greedy penalties",
            "kind": "chat",
            "conversations": CHATS[:3],
            "params": dict(
                temperature=0,
                max_tokens=max_tokens,
                repetition_penalty=1.3,
                frequency_penalty=0.4,
                presence_penalty=0.2,
            ),
        },
        {
            "name": "prefix cache, first",
            "kind": "generate",
            "prompts": [COMPLETIONS[-1]],
            "params": dict(temperature=0, max_tokens=4),
        },
        {
            "name": "prefix cache, again",
            "kind": "generate",
            "prompts": [COMPLETIONS[-1] + " that"],
            "params": dict(temperature=0, max_tokens=4),
        },
    ]
    for name, constraint, kind in STRUCTURED:
        inputs = {"prompts": COMPLETIONS[:4]} if kind == "generate" else {"conversations": CHATS[:4]}
        params = dict(temperature=0, max_tokens=48, structured_outputs=constraint)
        spec.append({"name": f"structured {name}", "kind": kind, **inputs, "params": params})
    params = dict(SEEDED["top_p"], max_tokens=48, structured_outputs=STRUCTURED[0][1])
    chats = {"conversations": CHATS[:4]}
    spec.append({"name": "structured json, seeded", "kind": "chat", **chats, "params": params})
    for name, params in SEEDED.items():
        spec.append({"name": f"seeded {name}, completions", "kind": "generate", "prompts": COMPLETIONS[:6],
                     "params": dict(params, max_tokens=max_tokens)})  # fmt: skip
        spec.append({"name": f"seeded {name}, chats", "kind": "chat", "conversations": CHATS[:4],
                     "params": dict(params, max_tokens=max_tokens)})  # fmt: skip
    for i, params in enumerate(
        [
            {},
            dict(temperature=0, top_p=0.5),
            dict(stop="x", seed=-1, logprobs=True),
            dict(n=2, stop_token_ids=[2, 2, 1], bad_words=["a", "a"], max_tokens=None),
        ]
    ):
        spec.append({"name": f"repr {i}", "kind": "repr", "params": params})  # fmt: skip
    spec.append({"name": "defaults", "kind": "defaults", "fields": DEFAULT_FIELDS})
    for i, (rows, vocab, masked) in enumerate([(64, 49152, 0.0), (64, 49152, 0.9), (256, 1000, 0.5)]):
        spec.append({"name": f"Gumbel-max draw {i} ({rows} rows x {vocab})", "kind": "gumbel", "rows": rows,
                     "vocab": vocab, "masked": masked, "seed": 100 + i})  # fmt: skip
    return {
        "engine_args": dict(model=model, dtype="float32", max_model_len=1024, seed=0, block_size=32),
        # vLLM: eager, a third of its compiled start-up time (bench peer runs it compiled).
        "vllm_args": dict(enforce_eager=True),
        "cases": spec,
    }
