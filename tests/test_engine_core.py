"""The engine core in its own process (:mod:`paged_attention.engine.engine_core`,
:class:`~paged_attention.engine.core_client.MPClient`): the same answers as the engine in-process,
and every promise kept across the process boundary, with faults injected.

One core process (the embedded tiny model, 32 blocks of 16 tokens) serves the module's server; the
tests that kill or break a core start their own. The builders live in ``tests/core_builders.py``:
the core process imports their module by name to build its engine, and this one's imports (the
server, openai, pytest) would add ~1.4 s to every core's start.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from paged_attention.engine.async_llm import AsyncLLM
from paged_attention.engine.chat import PLAIN_TEMPLATE
from paged_attention.engine.core_client import EngineDeadError, MPClient
from paged_attention.engine.llm import LLM
from paged_attention.engine.params import RequestOutputKind, SamplingParams
from paged_attention.serving import ServerProcess, ServerThread, build_app
from tests.core_builders import NUM_KV_BLOCKS, build_broken, build_faulty, build_tiny

PROMPTS = ["The cat sat on", "Once upon a time", "1 2 3 4"]


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(None, num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[AsyncLLM, str]]:
    llm = AsyncLLM.from_builder(build_tiny)
    server = ServerThread(build_app(llm, "tiny", PLAIN_TEMPLATE))
    with server:
        yield llm, server.url
    assert not llm.is_running and llm.client.process.poll() is not None, "the core outlived its server"


def utility(llm: AsyncLLM, url: str, method: str) -> object:
    """``llm.call_utility(method)`` from this test thread (the server's loop runs in its thread)."""
    return _on_loop(llm, llm.call_utility(method))


def _on_loop(llm: AsyncLLM, coroutine: object) -> object:
    loop = llm.client.loop  # the server's event loop
    return asyncio.run_coroutine_threadsafe(coroutine, loop).result(30)  # type: ignore[arg-type]


def wait_idle(llm: AsyncLLM, url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while utility(llm, url, "has_unfinished_requests") or llm.num_unfinished:
        assert time.monotonic() < deadline, "the core did not go idle"
        time.sleep(0.02)


def test_the_core_runs_in_another_process_and_answers_as_offline(served, offline: LLM) -> None:
    llm, url = served
    assert llm.engine is None and llm.client.info["pid"] not in (None, os.getpid())
    assert llm.client.info["pid"] == llm.client.process.pid
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        answer = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0, n=2)
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True
            )
        )
    want = offline.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, n=2))
    assert [c.text for c in answer.choices] == [o.text for out in want for o in out.outputs]
    assert streamed == want[0].outputs[0].text
    wait_idle(llm, url)


def test_the_front_tokenizes_and_the_core_refuses_bad_input(served) -> None:
    llm, url = served
    too_long = {"model": "tiny", "prompt": "word " * 2000, "max_tokens": 4}
    answer = httpx.post(url + "/v1/completions", json=too_long, timeout=30)
    assert answer.status_code == 400 and "max_model_len" in answer.json()["error"]["message"]
    bad_ids = {"model": "tiny", "prompt": [10**9], "max_tokens": 4}
    answer = httpx.post(url + "/v1/completions", json=bad_ids, timeout=30)
    assert answer.status_code == 400
    # a grammar is compiled in the core: its refusal crosses back as a 400 too, and a good one works
    bad_regex = {"model": "tiny", "prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "[a-"}}
    answer = httpx.post(url + "/v1/completions", json=bad_regex, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "structured_outputs"
    choice = {
        "model": "tiny",
        "prompt": "x",
        "max_tokens": 8,
        "structured_outputs": {"choice": ["on", "off"]},
    }
    answer = httpx.post(url + "/v1/completions", json=choice, timeout=30)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] in ("on", "off")
    wait_idle(llm, url)


def test_a_client_that_hangs_up_is_aborted_in_the_core(served) -> None:
    llm, url = served
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up
    wait_idle(llm, url)  # aborted before a later step: the core holds nothing
    text = httpx.get(url + "/metrics").text
    assert re.search(r'vllm:request_success_total\{finished_reason="abort",model_name="tiny"\} [1-9]', text)
    assert re.search(r'vllm:kv_cache_usage_perc\{model_name="tiny"\} 0\.0', text)


def test_asyncllm_over_a_process_streams_deltas_and_a_cancelled_reader_aborts(served, offline: LLM) -> None:
    """AsyncLLM without HTTP: deltas arrive in order and add up to the offline answer; a reader
    cancelled mid-stream (Ctrl-C at an ``await`` in a notebook) aborts its request in the core, which
    serves on; an unknown utility is refused by name."""
    llm, url = served

    async def run() -> tuple[str, list[str]]:
        params = SamplingParams(temperature=0.0, max_tokens=10, output_kind=RequestOutputKind.DELTA)
        pieces = [o.outputs[0].text async for o in llm.generate(PROMPTS[2], params)]
        long = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)

        async def read() -> None:
            async for _ in llm.generate(PROMPTS[0], long):
                pass

        reader = asyncio.ensure_future(read())
        await asyncio.sleep(0.2)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        with pytest.raises(ValueError, match="not a utility"):
            await llm.call_utility("shutdown_everything")
        with pytest.raises(TypeError, match="another process"):
            await llm.call(lambda e: e.request_ids)
        return "".join(pieces), pieces

    text, pieces = _on_loop(llm, run())  # type: ignore[misc]
    want = offline.generate(PROMPTS[2], SamplingParams(max_tokens=10, temperature=0.0))[0].outputs[0].text
    assert len(pieces) == 10 and text == want
    wait_idle(llm, url)  # the cancelled request was aborted: nothing left in the core


def test_a_step_that_fails_in_the_core_fails_its_requests_and_the_core_serves_on() -> None:
    async def run() -> None:
        llm = AsyncLLM.from_builder(functools.partial(build_faulty, 3))  # 1, 2: the warm-up's two steps
        await llm.start()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=8)
            with pytest.raises(RuntimeError, match="injected"):
                async for _ in llm.generate(PROMPTS[0], params):
                    pass
            outputs = [o async for o in llm.generate(PROMPTS[0], params)]  # the core serves on
            assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 8
            assert not await llm.call_utility("has_unfinished_requests")
        finally:
            await llm.shutdown()
        assert llm.client.process.returncode == 0

    asyncio.run(run())


@pytest.mark.parametrize("watch", ["pidfd", "poll"])
def test_a_core_that_dies_fails_every_waiting_caller_and_nothing_hangs(monkeypatch, watch: str) -> None:
    """Linux's pidfd tells the front at once; elsewhere (macOS) it looks every 0.2 s."""
    if watch == "poll":
        monkeypatch.delattr(os, "pidfd_open", raising=False)

    async def run() -> None:
        llm = AsyncLLM.from_builder(build_tiny)
        await llm.start()
        params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)

        async def consume() -> None:
            async for _ in llm.generate(PROMPTS[1], params):
                pass

        readers = [asyncio.ensure_future(consume()) for _ in range(3)]
        await asyncio.sleep(0.5)
        os.kill(llm.client.process.pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*readers, return_exceptions=True), 10)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert not llm.is_running and "died" in str(llm.error)
        with pytest.raises(EngineDeadError):
            await llm.add_request(PROMPTS[0], params)
        with pytest.raises(EngineDeadError):
            await llm.call_utility("get_metrics")
        await asyncio.wait_for(llm.shutdown(), 10)

    asyncio.run(run())


def test_a_core_that_dies_before_anyone_listens_is_reported_with_its_status() -> None:
    """Not started (no event loop watches it): the next call finds the process gone and says how."""
    client = MPClient(build_tiny)
    try:
        os.kill(client.process.pid, signal.SIGKILL)
        client.process.wait(10)
        with pytest.raises(EngineDeadError, match="exit status -9"):
            asyncio.run(client.call_utility("get_metrics"))
    finally:
        client.close()


def test_a_core_that_cannot_start_says_why() -> None:
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="building the engine failed"):
        MPClient(build_broken)
    assert time.monotonic() - started < 60


def core_pid(log: str) -> int:
    match = re.search(r"engine core in its own process \(pid (\d+)\)", log)
    assert match, log
    return int(match.group(1))


def gone(pid: int, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as f:  # a zombie (ended, not yet reaped by its parent) is gone
            if f.read().split()[2] == "Z":
                return True
        time.sleep(0.1)
    return False


def test_a_server_killed_takes_its_core_along(tmp_path) -> None:
    """SIGKILL (no clean-up possible): the core follows its front (Linux's parent-death signal).
    SIGTERM and SIGINT: tests/test_serving.py (the server stops its core and exits 0)."""
    how = signal.SIGKILL
    args = ["--model", "tiny", "--num-kv-blocks", "32", "--threads", "1", "--log-level", "warning"]
    server = ServerProcess(args, log=tmp_path / "serve.log")
    try:
        server.start()
        answer = httpx.post(
            server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30
        )
        assert answer.status_code == 200
        core = core_pid((tmp_path / "serve.log").read_text())
        assert server.process is not None
        server.process.send_signal(how)
        status = server.process.wait(timeout=20)
        assert status == -signal.SIGKILL
        assert gone(core), f"the engine core (pid {core}) outlived its server"
    finally:
        server.stop(timeout=5)


def test_the_message_kinds_drawn_are_the_ones_the_core_speaks() -> None:
    """Notebook 09 draws :data:`MESSAGES`; the core's code handles and sends exactly those kinds
    (and, once at start, takes its ``build`` message and says ``ready`` or ``dead``)."""
    from paged_attention.engine import engine_core

    source = Path(engine_core.__file__).read_text()
    handled = set(re.findall(r'kind == "(\w+)"', source))
    sent = set(re.findall(r'send\(\(\s*"(\w+)"', source)) | set(
        re.findall(r'pickle\.dumps\(\("(\w+)"', source)
    )
    assert handled == set(engine_core.MESSAGES["input"]) | {"build"}
    assert sent == set(engine_core.MESSAGES["output"]) | {"ready", "dead"}


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_serve_binds_the_core_to_its_cpus_and_the_front_to_the_rest() -> None:
    import subprocess
    import sys

    from paged_attention.cli.serve import bind_cores

    mine = os.sched_getaffinity(0)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        said = bind_cores(child.pid, 1)
        cpus = sorted(mine)
        if len(cpus) < 2:
            assert said == "" and os.sched_getaffinity(child.pid) == mine
        else:
            assert os.sched_getaffinity(child.pid) == {cpus[-1]} and said == f", bound to CPU {cpus[-1]}"
            assert os.sched_getaffinity(0) == set(cpus[:-1])
            assert bind_cores(child.pid, len(cpus)) == ""  # nothing left for the front: no binding
    finally:
        os.sched_setaffinity(0, mine)
        child.kill()
        child.wait()


def test_the_load_generator_reads_streams_and_whole_answers_alike(served) -> None:
    """``loadgen.run_load`` through the core process: streamed and whole answers (``stream=False``)
    carry the same greedy text and token counts; only the streamed ones have latencies."""
    from paged_attention.experiments.loadgen import LoadRequest, run_load

    llm, url = served
    requests = [LoadRequest(max_tokens=8, prompt=p, ignore_eos=True) for p in PROMPTS]
    streamed, _ = asyncio.run(run_load(url, requests, float("inf"), model="tiny"))
    whole, _ = asyncio.run(run_load(url, requests, float("inf"), model="tiny", stream=False))
    assert all(r.ok for r in streamed + whole)
    assert [(r.text, r.output_tokens, r.prompt_tokens) for r in whole] == [
        (r.text, r.output_tokens, r.prompt_tokens) for r in streamed
    ]
    assert all(r.output_tokens == 8 and r.finish_reason == "length" for r in whole)
    assert all(r.metrics is not None for r in streamed) and all(r.metrics is None for r in whole)
    wait_idle(llm, url)


FRONT_IMPORTS = """
import sys
import paged_attention.cli.serve, paged_attention.serving
from paged_attention.engine.async_llm import AsyncLLM
from paged_attention.engine.core_client import MPClient
client = object.__new__(MPClient)  # a core elsewhere: what the front keeps of it
client.info = {"tokenizer": None, "sampling_defaults": {}, "max_model_len": 64}
AsyncLLM(client)
MODEL_CODE = ("transformers.modeling_utils", "paged_attention.engine.llm_engine")
print(sorted(m for m in MODEL_CODE if m in sys.modules))
"""


def test_a_servers_front_never_loads_the_model_code() -> None:
    """The front of a server whose core runs in another process tokenizes and serves HTTP: importing
    transformers' modeling (~3.5 s here, the larger part of the front's start) is the core's alone."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FRONT_IMPORTS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "[]"
