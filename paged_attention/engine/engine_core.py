"""The engine core in its own process: vLLM v1's ``EngineCoreProc`` and its busy loop.

An :class:`~.llm_engine.LLMEngine` is what vLLM calls the engine core (it owns the scheduler, the
KV-cache manager, the model runner and the sampler, and ``step()`` is schedule -> execute ->
update). Here it runs in a process of its own, so that the front (HTTP, JSON, tokenizing prompts,
streaming) works on the other core while the model computes::

    front process (core_client.MPClient)               engine-core process (this module)
    ------------------------------------               --------------------------------------
    ("build", builder) ---------------------input-->   once: build the engine, warm it up
    <--output-- ("ready", describe(engine))            (or ("dead", why) if building failed)
    ("add", id, prompt, params, arrival) --input-->    every waiting message is handled before
    ("abort", ids)                                     each step: adds, aborts, utility calls
    ("call", n, method, args)                          (an idle core waits for one)
    ("shutdown",)                                      step(): schedule -> execute -> update
    <--output-- ("added", [(id, error or None)])       one message per message batch
    <--output-- ("outputs", [RequestOutput, ...])      one message per step that made tokens
    <--output-- ("failed", ids, message)               a step raised: it was rolled back, and
                                                       the requests it held are aborted
    <--output-- ("result", n, ok, value)               a utility call's answer (or error)

The sockets are ZeroMQ (pyzmq, as vLLM's): PUSH/PULL pairs over ``ipc://`` files in a directory
only this user can enter; messages are pickled Python objects (vLLM encodes its own structs with
msgspec; ours are the same dataclasses the in-process engine returns, so pickle keeps one
vocabulary for both). Only a process of this user can connect, so nothing foreign is unpickled.

Invariants: the core never decides when to stop on its own (SIGINT is ignored: Ctrl-C in a
terminal reaches the whole process group, and the front decides); it stops on ``shutdown``, when
the front process is gone (Linux's parent-death signal, and a check of the parent's pid while
idle), or when building the engine failed (reported as ``("dead", message)``).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import logging
import os
import pickle
import signal
import sys
from typing import TYPE_CHECKING, Any

import zmq

from .outputs import RequestOutput
from .params import SamplingParams

if TYPE_CHECKING:  # a front imports this module without the model code (transformers' modeling: ~3.5 s)
    from .llm_engine import LLMEngine

log = logging.getLogger("paged_attention.engine_core")

#: The message kinds each socket carries (the module docstring; notebook 09 draws them).
MESSAGES = {"input": ("add", "abort", "call", "shutdown"), "output": ("added", "outputs", "failed", "result")}
#: The methods a front may call on the core between two steps (vLLM's ``call_utility``).
UTILITIES = frozenset({"get_metrics", "reset_prefix_cache", "has_unfinished_requests"})
IDLE_POLL_MS = 500  # an idle core wakes this often to check that its front is still there


def describe(engine: LLMEngine) -> dict[str, Any]:
    """What a front needs of the core to serve without it: the tokenizer (the front tokenizes and
    renders chats itself), the defaults, the lengths, and what the server's banner prints."""
    manager = engine.cache_manager
    return {
        "tokenizer": engine.tokenizer,
        "sampling_defaults": dict(engine.sampling_defaults),
        "max_model_len": engine.max_model_len,
        "num_blocks": manager.num_blocks,
        "block_size": manager.block_size,
        "dtype": kv_description(engine),
        "pid": os.getpid(),
    }


def kv_description(engine: LLMEngine) -> str:
    """The model's dtype, and the KV cache's where it differs: ``"bfloat16, int8 KV cache"``."""
    model, kv = (str(d).removeprefix("torch.") for d in (engine.model.dtype, engine.spec.dtype))
    return model if model == kv else f"{model}, {kv} KV cache"


def warm_up(engine: LLMEngine) -> None:
    """vLLM's dummy run before the core says ready: one short greedy request through a prefill and
    a decode step, so that the first user's request does not pay for first-call work (importing and
    loading the compiled kernels: ~0.5-1 s here). Then forgotten: the engine's metrics are restored,
    the prefix cache emptied and fp8 scales it calculated (``calculate_kv_scales``) dropped, so the
    first real request sets them; nothing of it is reported."""
    metrics = copy.deepcopy(engine.metrics)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    engine.add_request("warm-up", {"prompt_token_ids": [0] * 8}, params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()
    engine.kv_cache.restart_calibration()
    engine.metrics = metrics


def step_once(engine: LLMEngine) -> tuple[list[RequestOutput], list[str], str | None]:
    """One step of the busy loop, wherever it runs: its outputs, or, if the step raised (the engine
    rolled it back), every request it held aborted and returned with why (the core serves on)."""
    try:
        return engine.step(), [], None
    except Exception as err:
        log.exception("step failed; failing the %d requests it held", len(engine.request_ids))
        ids = engine.request_ids
        engine.abort_request(ids)
        return [], ids, f"the engine step failed: {err!r}"


def abort_live(engine: LLMEngine, request_ids: list[str]) -> None:
    """Abort those of ``request_ids`` still unfinished (one that just finished needs nothing)."""
    live = set(engine.request_ids)
    if ids := [i for i in request_ids if i in live]:
        engine.abort_request(ids)


class EngineCoreProc:
    """An engine and the two sockets to its front; :meth:`run_busy_loop` serves until told to stop."""

    def __init__(self, engine: LLMEngine, inputs: zmq.Socket, outputs: zmq.Socket, parent_pid: int) -> None:
        self.engine, self.inputs, self.outputs, self.parent_pid = engine, inputs, outputs, parent_pid
        self.stopping = False

    def send(self, message: tuple) -> None:
        self.outputs.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def run_busy_loop(self) -> None:
        """Handle every waiting message, then step; an idle core waits for a message."""
        engine = self.engine
        while not self.stopping:
            self.process_inputs(block=not engine.has_unfinished_requests())
            if self.stopping or not engine.has_unfinished_requests():
                continue
            outputs, failed, why = step_once(engine)
            if failed:
                self.send(("failed", failed, why))
            if outputs:
                self.send(("outputs", outputs))

    def process_inputs(self, block: bool) -> None:
        """Handle the messages waiting (if ``block``, wait for the first one); the adds' answers go
        back in one message."""
        added: list[tuple[str, BaseException | None]] = []
        while not self.stopping:
            if block and not self.inputs.poll(IDLE_POLL_MS):  # idle: wait, but not for an orphan's life
                if not _parent_alive(self.parent_pid):
                    self.stopping = True
                continue
            block = False
            try:
                raw = self.inputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.handle(pickle.loads(raw), added)
        if added:
            self.send(("added", added))

    def handle(self, message: tuple, added: list[tuple[str, BaseException | None]]) -> None:
        kind = message[0]
        if kind == "add":
            _, request_id, prompt, params, arrival_time = message
            try:
                self.engine.add_request(request_id, prompt, params, arrival_time)
            except (ValueError, TypeError) as err:  # bad input: refused alone, the caller learns why
                added.append((request_id, err))
            else:
                added.append((request_id, None))
        elif kind == "abort":
            abort_live(self.engine, message[1])
        elif kind == "call":
            _, call_id, method, args = message
            try:
                if method not in UTILITIES:
                    raise ValueError(f"{method!r} is not a utility of the engine core: {sorted(UTILITIES)}")
                value = getattr(self.engine, method)(*args)
            except Exception as err:
                self.send(("result", call_id, False, err))
            else:
                self.send(("result", call_id, True, value))
        elif kind == "shutdown":
            self.stopping = True
        else:  # pragma: no cover - a bug in the front
            raise ValueError(f"unknown message {kind!r}")


def run_engine_core(input_address: str, output_address: str, parent_pid: int) -> None:
    """The engine-core process's entry point: receive the builder (the first message, a picklable
    callable), build the engine, say ``ready`` (with :func:`describe`), run the busy loop, then
    close the sockets."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front decides (see the module docstring)
    die_with_parent()
    context = zmq.Context()
    inputs, outputs = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inputs.connect(input_address)
    outputs.connect(output_address)
    try:
        try:
            kind, build = pickle.loads(inputs.recv())
            assert kind == "build", kind
            engine: LLMEngine = build()
        except BaseException as err:
            outputs.send(pickle.dumps(("dead", f"building the engine failed: {err!r}")))
            raise
        warm_up(engine)
        core = EngineCoreProc(engine, inputs, outputs, parent_pid)
        core.send(("ready", describe(engine)))
        core.run_busy_loop()
    finally:
        inputs.close(linger=0)
        outputs.close(linger=1000)  # the last answers reach the front
        context.term()


def die_with_parent() -> None:
    """On Linux, ask the kernel to send SIGTERM to this process when its parent dies (a front
    killed with SIGKILL cannot stop its core any other way; ``serve`` as a child process is asked
    the same, before it runs). The signal follows the thread that started the process."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _parent_alive(pid: int) -> bool:
    return os.getppid() == pid


if __name__ == "__main__":  # python -m paged_attention.engine.engine_core INPUT OUTPUT PARENT_PID
    run_engine_core(sys.argv[1], sys.argv[2], int(sys.argv[3]))
