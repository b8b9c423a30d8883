"""The server on the real model (SmolLM2): a chat over HTTP answers with exactly the tokens
``LLM.chat`` gives, streamed or not. One model load for both."""

from __future__ import annotations

import pytest
from openai import OpenAI

from paged_attention import LLM, SamplingParams
from paged_attention.serving import AsyncLLM, ServerThread, build_app

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"

QUESTIONS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "Name three primary colors."}],
]


@pytest.fixture(scope="module")
def threads():
    import torch

    from paged_attention.cli._threads import set_threads

    before = torch.get_num_threads()
    set_threads()
    yield
    torch.set_num_threads(before)


def test_smollm2_chat_over_http_equals_llm_chat(threads) -> None:
    # offline first, then the same engine served; float32, because bfloat16 on a CPU is not batch-invariant
    # (oneDNN changes kernels with the row count), and the server batches differently
    llm = LLM(SMOLLM2, num_kv_blocks=64, max_model_len=256, dtype="float32")
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    expected = [out.outputs[0] for out in llm.chat(QUESTIONS, greedy, use_tqdm=False)]
    with ServerThread(build_app(AsyncLLM(engine), SMOLLM2)) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
        for conversation, want in zip(QUESTIONS, expected, strict=True):
            whole = client.chat.completions.create(
                model=SMOLLM2, messages=conversation, max_tokens=24, temperature=0, logprobs=True
            )
            tokens = [entry.token for entry in whole.choices[0].logprobs.content]
            assert whole.choices[0].message.content == want.text
            assert whole.usage.completion_tokens == len(want.token_ids) == len(tokens)
            assert whole.choices[0].finish_reason == want.finish_reason
            stream = client.chat.completions.create(
                model=SMOLLM2, messages=conversation, max_tokens=24, temperature=0, stream=True
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert text == want.text
        assert "Paris" in expected[0].text  # real text, not gibberish
