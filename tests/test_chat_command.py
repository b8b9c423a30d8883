"""``python -m paged_attention chat`` on the embedded tiny model: long pastes, bytes that are not
UTF-8, Ctrl-C while an answer streams or at the prompt, and the status line's prefix-cache count.

The tiny model has no chat template, so the command sends ``role: content`` lines
(:data:`~paged_attention.engine.chat.PLAIN_TEMPLATE`). Its text is gibberish; what is checked is what
the command does around it."""

from __future__ import annotations

import argparse
import dataclasses
import io
import re

import pytest
import torch

from paged_attention.cli.chat import run_chat
from paged_attention.cli.main import main
from paged_attention.engine.chat import PLAIN_TEMPLATE, render_chat
from paged_attention.engine.llm_engine import LLMEngine
from paged_attention.engine.outputs import RequestOutput
from paged_attention.models import DEFAULT_MODEL_NAME as TINY

STATUS = re.compile(r"prompt (\d+) tokens, (-?\d+) prompt tokens from the prefix cache")
REPLACED = "undecodable bytes were replaced with U+FFFD"


@pytest.fixture(autouse=True)
def _restore_threads():
    """The command sets torch's thread count: put it back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def cached_tokens_stand_in(monkeypatch):
    """``RequestOutput.num_cached_tokens`` is being added in another change. Until it lands, a class
    attribute of 0 (nothing computed) lets the tests that are about something else run; once the
    field exists this does nothing and the real value is read."""
    if "num_cached_tokens" not in {f.name for f in dataclasses.fields(RequestOutput)}:
        monkeypatch.setattr(RequestOutput, "num_cached_tokens", 0, raising=False)


def options(**overrides: object) -> argparse.Namespace:
    """What ``main(["chat", ...])`` would parse: the tiny model, greedy, short answers."""
    opts = dict(model=TINY, system=None, max_tokens=6, temperature=0.0, top_p=1.0, seed=0,
                num_kv_blocks=64, max_model_len=None, threads=1)  # fmt: skip
    return argparse.Namespace(**{**opts, **overrides})


def record_prompts(monkeypatch) -> list[dict]:
    """Every prompt the command sends to an engine (``{"prompt": text, "prompt_token_ids": ids}``)."""
    sent: list[dict] = []
    add_request = LLMEngine.add_request

    def recording(self, request_id, prompt, *args, **kwargs):
        sent.append(prompt)
        return add_request(self, request_id, prompt, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "add_request", recording)
    return sent


def all_blocks_free(engine: LLMEngine) -> bool:
    manager = engine.cache_manager  # num_free_blocks counts prefix-cached free blocks as free
    return not engine.has_unfinished_requests() and manager.num_free_blocks == manager.num_blocks


def chat(*args: object) -> None:
    """``run_chat``, with a Ctrl-C that escapes it failing the test (not stopping pytest's run)."""
    try:
        run_chat(*args)  # type: ignore[arg-type]
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C reached the caller of the chat loop")


def chat_main(argv: list[str]) -> int:
    try:
        return main(argv)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C reached the caller of main")


class Lines(io.StringIO):
    """stdin: these lines, then Ctrl-C at the prompt."""

    def readline(self, size: int = -1) -> str:
        line = super().readline(size)
        if not line:
            raise KeyboardInterrupt
        return line


# -- 1. a conversation longer than max_model_len -----------------------------------------------------
@pytest.mark.usefixtures("cached_tokens_stand_in")
def test_a_long_paste_drops_the_oldest_turns_and_one_too_long_alone_is_refused(monkeypatch, capsys):
    fits_alone, too_long = "hello world " * 12, "hello world " * 30  # about 85 and 210 tokens
    sent = record_prompts(monkeypatch)
    lines = ["Hi there", "And what about paging?", fits_alone, too_long, "ok"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines)))  # ends at EOF, no empty line
    argv = ["chat", "--model", TINY, "--max-model-len", "128", "--max-tokens", "6", "--threads", "1",
            "--num-kv-blocks", "64"]  # fmt: skip
    assert chat_main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"\[dropped the [12] oldest turns to fit max_model_len=128\]", out)
    assert "Hi there" not in sent[2]["prompt"] and fits_alone.strip() in sent[2]["prompt"]
    assert all(len(p["prompt_token_ids"]) + 6 <= 128 for p in sent)
    # The message too long even alone: refused, with the limit and its token count; never sent.
    tokenizer = LLMEngine(TINY, num_kv_blocks=16).tokenizer
    alone = render_chat(
        tokenizer, [{"role": "user", "content": too_long.strip()}], chat_template=PLAIN_TEMPLATE
    )
    assert f"this message is {len(alone['prompt_token_ids'])} prompt tokens" in out
    assert "exceeds max_model_len=128" in out
    assert len(sent) == 4 and len(STATUS.findall(out)) == 4  # four answered, one refused
    assert fits_alone.strip() in sent[3]["prompt"]  # the conversation was kept as it was
    assert sent[3]["prompt"].endswith("user: ok\nassistant:")


# -- 2. bytes that are not UTF-8 ---------------------------------------------------------------------
@pytest.mark.usefixtures("cached_tokens_stand_in")
@pytest.mark.parametrize(
    "stdin",
    [
        pytest.param(lambda: io.TextIOWrapper(io.BytesIO(b"caf\xe9 au lait\n"), "utf-8"), id="byte-stream"),
        pytest.param(lambda: io.StringIO("caf\udce9 au lait\n"), id="surrogate-escapes"),  # POSIX locale
    ],
)
def test_bytes_that_are_not_utf8_become_replacement_characters_with_a_notice(stdin):
    out = io.StringIO()
    chat(options(), stdin(), out)
    text = out.getvalue()
    assert "you> caf\ufffd au lait" in text and REPLACED in text
    assert len(STATUS.findall(text)) == 1


# -- 3. Ctrl-C ---------------------------------------------------------------------------------------
def interrupt_in_the_model(engine: LLMEngine, out: io.StringIO) -> io.StringIO:
    """Ctrl-C inside a step, in the model's forward pass of the second step (the first decode)."""
    calls = []

    def hook(module, args, kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt

    engine.model.base_model.register_forward_pre_hook(hook, with_kwargs=True)
    return out


def interrupt_before_a_step(engine: LLMEngine, out: io.StringIO) -> io.StringIO:
    """Ctrl-C as the third step starts."""
    step, calls = engine.step, []

    def interrupted():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    engine.step = interrupted
    return out


class InterruptedWhilePrinting(io.StringIO):
    """Ctrl-C while the first streamed text is printed (between steps)."""

    armed = 0

    def write(self, s: str) -> int:
        if s == "bot> ":
            self.armed += 1
        elif self.armed == 1:
            self.armed += 1
            raise KeyboardInterrupt
        return super().write(s)


@pytest.mark.usefixtures("cached_tokens_stand_in")
@pytest.mark.parametrize(
    "interrupt",
    [
        interrupt_in_the_model,
        interrupt_before_a_step,
        lambda engine, out: InterruptedWhilePrinting(),
    ],
    ids=["in-the-model", "before-a-step", "while-printing"],
)
def test_ctrl_c_cancels_the_answer_frees_its_blocks_and_ctrl_c_at_the_prompt_quits(monkeypatch, interrupt):
    engine = LLMEngine(TINY, num_kv_blocks=64)
    out = interrupt(engine, io.StringIO())
    sent = record_prompts(monkeypatch)
    chat(options(max_tokens=12), Lines("the first question, cancelled\nthe second\n"), out, engine)
    text = out.getvalue()
    assert text.count("[answer cancelled]") == 1 and "Traceback" not in text
    assert all_blocks_free(engine)
    # The next turn was served, and neither the cancelled message nor its half answer was kept.
    assert len(sent) == 2 and len(STATUS.findall(text)) == 1
    assert "the first question" not in sent[1]["prompt"]
    assert (
        sent[1]["prompt"]
        == render_chat(
            engine.tokenizer, [{"role": "user", "content": "the second"}], chat_template=PLAIN_TEMPLATE
        )["prompt"]
    )


@pytest.mark.parametrize("stdin", [Lines(""), io.StringIO("")], ids=["ctrl-c", "eof"])
def test_ctrl_c_or_eof_at_the_first_prompt_quits_with_exit_code_0(monkeypatch, capsys, stdin):
    monkeypatch.setattr("sys.stdin", stdin)
    assert chat_main(["chat", "--model", TINY, "--num-kv-blocks", "16", "--threads", "1"]) == 0
    assert "chat with" in capsys.readouterr().out


# -- 4. the prefix cache on the status line --------------------------------------------------------
def test_the_second_turn_reads_the_first_turns_blocks_from_the_prefix_cache():
    """Needs ``RequestOutput.num_cached_tokens`` (vLLM's field), being added to the engine: until
    it lands this fails with an AttributeError."""
    engine = LLMEngine(TINY, num_kv_blocks=64)
    out = io.StringIO()
    question = "Tell me how paged attention keeps the keys and values of a long conversation."
    chat(options(), io.StringIO(f"{question}\nAnd then?\n"), out, engine)
    (first_len, first), (second_len, second) = STATUS.findall(out.getvalue())
    assert int(first_len) > engine.cache_manager.block_size  # one full block to find next turn
    assert int(first) == 0 and 0 < int(second) <= int(second_len)
