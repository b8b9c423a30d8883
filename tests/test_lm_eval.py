"""EleutherAI's lm-evaluation-harness against the server, unchanged: its ``local-completions`` client
(vLLM's recipe: ``echo`` + ``logprobs`` + ``max_tokens: 1`` for log-likelihoods, plain completions
for generation) on two small local tasks of our own, SmolLM2 in float32. Every per-choice
log-likelihood, each answer's greedy flag, the generated texts and the scores must be the offline
engine's: the harness's numbers are this engine's, unchanged by the trip over HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from paged_attention.engine.llm import LLM
from paged_attention.engine.llm_engine import LLMEngine
from paged_attention.engine.params import SamplingParams
from paged_attention.models.pretrained import SMOLLM2, pretrained_path
from paged_attention.serving import AsyncLLM, ServerThread, build_app

lm_eval = pytest.importorskip("lm_eval")

#: (question, choices, answer): the harness puts its target delimiter, a space, before each choice
QUESTIONS = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid"], 0),
    ("Water freezes at zero degrees", ["Celsius", "Fahrenheit", "Kelvin"], 0),
    ("The largest planet in the solar system is", ["Mars", "Jupiter", "Venus"], 1),
    ("A week has seven", ["months", "years", "days"], 2),
    ("The opposite of hot is", ["cold", "warm", "loud"], 0),
    ("Bees make", ["milk", "honey", "silk"], 1),
]
PROMPTS = [("Question: What is 2 + 2?\nAnswer:", " 4"), ("The colour of the sky on a clear day is", " blue")]
MC_TASK = """task: pa_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_TASK = """task: pa_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(model=SMOLLM2.name, num_kv_blocks=64, dtype="float32")


@pytest.fixture(scope="module")
def url(offline: LLM) -> Iterator[str]:
    engine = LLMEngine(SMOLLM2.name, num_kv_blocks=64, dtype="float32")
    server = ServerThread(build_app(AsyncLLM(engine), "smollm2"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def tasks(folder: Path) -> Path:
    folder.mkdir()
    mc, gen = folder / "choice.jsonl", folder / "generate.jsonl"
    rows = [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS]
    mc.write_text("".join(json.dumps(row) + "\n" for row in rows))
    gen.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in PROMPTS))
    (folder / "pa_choice.yaml").write_text(MC_TASK.format(data=mc))
    (folder / "pa_generate.yaml").write_text(GEN_TASK.format(data=gen))
    return folder


def test_lm_eval_scores_and_log_likelihoods_are_the_offline_engines(
    url: str, offline: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    args = {
        "model": "smollm2",
        "base_url": url + "/v1/completions",
        "tokenizer_backend": "huggingface",
        "tokenizer": str(pretrained_path(SMOLLM2)),
        "max_retries": 1,
    }
    out = simple_evaluate(
        model="local-completions",
        model_args=args,
        tasks=["pa_choice", "pa_generate"],
        # our two tasks only: indexing the harness's own thousands of task files costs ~11 s
        task_manager=TaskManager(include_path=str(tasks(tmp_path / "tasks")), include_defaults=False),
        log_samples=True,
    )
    # the log-likelihoods, recomputed offline from the very token ids the harness sent
    harness = LocalCompletionsAPI(**args)
    right = 0
    for sample in out["samples"]["pa_choice"]:
        doc = sample["doc"]
        scores = []
        for (text, choice), ((got, greedy),) in zip(sample["arguments"], sample["resps"], strict=True):
            assert text == doc["question"] and choice.strip() in doc["choices"]
            context, continuation = harness._encode_pair(text, choice)
            params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)
            entries = offline.generate(
                [{"prompt_token_ids": context + continuation}], params, use_tqdm=False
            )[0].prompt_logprobs
            tail = list(zip(continuation, entries[len(context) :], strict=True))
            want = sum(entry[token].logprob for token, entry in tail)
            assert got == pytest.approx(want, abs=1e-4), (text, choice)
            assert greedy == all(entry[token].rank == 1 for token, entry in tail)
            scores.append(want)
        right += scores.index(max(scores)) == doc["answer"]
    assert out["results"]["pa_choice"]["acc,none"] == pytest.approx(right / len(QUESTIONS))
    assert right >= 4  # SmolLM2 knows most of these
    matches = 0
    for sample in out["samples"]["pa_generate"]:
        params = SamplingParams(max_tokens=8, temperature=0, stop=["\n", "."])
        text = offline.generate([sample["doc"]["question"]], params, use_tqdm=False)[0].outputs[0].text
        assert sample["resps"][0][0] == text
        matches += text == sample["doc"]["answer"]
    assert out["results"]["pa_generate"]["exact_match,none"] == pytest.approx(matches / len(PROMPTS))
