"""How the front reaches the engine core: on a thread of this process, or in a process of its own
(vLLM v1's ``vllm/v1/engine/core_client.py``: ``InprocClient``, ``AsyncMPClient``).

Both clients give :class:`~.async_llm.AsyncLLM` the same five verbs, all used from its event loop:
``start(sink)``, ``await add(id, prompt, params)`` (returns once the core has queued the request,
or raises its ``ValueError``/``TypeError``), ``abort(ids)`` (before the core's next step),
``await call_utility(method, *args)`` and ``await shutdown()``. What the core produces reaches the
``sink``: ``sink.outputs(list)``, ``sink.failed(ids, error)`` (a step raised and was rolled back;
those requests were aborted) and ``sink.dead(error)`` (the core is gone: every waiting caller gets
:class:`EngineDeadError`, nothing hangs).

* :class:`ThreadClient`: the engine on one thread of this process; commands run between steps.
  One process, one GIL: the model's step and the server's HTTP, JSON and tokenizing take turns.
* :class:`MPClient`: the engine in its own process (:mod:`.engine_core`), over ZeroMQ. The front
  tokenizes prompts itself (it has the core's tokenizer, sent at start), so a string prompt costs the
  core nothing; its busy loop only schedules, executes and updates.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import os
import pickle
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import zmq
import zmq.asyncio

from . import engine_core
from .engine_core import UTILITIES, abort_live, describe, step_once
from .inputs import Prompt, tokenize
from .outputs import RequestOutput
from .params import SamplingParams

if TYPE_CHECKING:  # a front whose core runs in another process never loads the model code
    from .llm_engine import LLMEngine

log = logging.getLogger("paged_attention.serving")


class EngineDeadError(RuntimeError):
    """The engine core is not running (not started, shut down, or died); vLLM's name."""


class Sink(Protocol):
    """Where a client delivers what the core produced (always on the front's event loop)."""

    def outputs(self, outputs: list[RequestOutput]) -> None: ...
    def failed(self, request_ids: list[str], error: BaseException) -> None: ...
    def dead(self, error: BaseException) -> None: ...


class ThreadClient:
    """The engine core on a thread of this process (the front's event loop never waits for a step)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.info = describe(engine)
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.error: BaseException | None = None

    def start(self, sink: Sink) -> None:
        self.loop, self._sink = asyncio.get_running_loop(), sink
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    async def add(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None:
        await self.run(lambda: self.engine.add_request(request_id, prompt, params))

    def abort(self, request_ids: list[str]) -> None:
        self._commands.put(lambda: abort_live(self.engine, request_ids))

    async def call_utility(self, method: str, *args: Any) -> Any:
        if method not in UTILITIES:
            raise ValueError(f"{method!r} is not a utility of the engine core: {sorted(UTILITIES)}")
        return await self.run(lambda: getattr(self.engine, method)(*args))

    async def run(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the engine's thread between two steps; its result or its exception."""
        if not self.is_running:
            why = f": {self.error!r}" if self.error else ""
            raise EngineDeadError(f"the engine core is not running{why}")
        loop = self.loop
        future = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as err:
                loop.call_soon_threadsafe(settle, future, None, err)
            else:
                loop.call_soon_threadsafe(settle, future, result, None)

        self._commands.put(run)
        return await future

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        self._stopping.set()
        self._commands.put(None)  # wake the loop if it waits for work
        await asyncio.to_thread(self._thread.join)

    def _run(self) -> None:
        engine, loop, sink = self.engine, self.loop, self._sink
        try:
            while not self._stopping.is_set():
                self._run_commands(block=not engine.has_unfinished_requests())
                if self._stopping.is_set() or not engine.has_unfinished_requests():
                    continue
                outputs, failed, why = step_once(engine)
                if failed:
                    loop.call_soon_threadsafe(sink.failed, failed, RuntimeError(why))
                if outputs:
                    loop.call_soon_threadsafe(sink.outputs, outputs)
        except BaseException as err:  # pragma: no cover - a bug in the loop itself
            self.error = err
            log.exception("the engine loop died")
        finally:
            self._stopping.set()
            if ids := engine.request_ids:
                engine.abort_request(ids)
            if self.error is not None:
                loop.call_soon_threadsafe(sink.dead, EngineDeadError(f"the engine loop died: {self.error!r}"))

    def _run_commands(self, block: bool) -> None:
        """Run every queued command; if ``block``, wait for the first one (the engine is idle)."""
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if command is not None:
                command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return


class MPClient:
    """The engine core in a process of its own (:mod:`.engine_core`), started here.

    ``build`` is a picklable callable that builds the :class:`LLMEngine` in the new process (a
    module-level function, or a ``functools.partial`` of one). The constructor returns once the core
    is ready (``info``: :func:`~.engine_core.describe`), or raises :class:`EngineDeadError` with
    why it is not. Build it on a thread that lives as long as the core (the main thread): Linux's
    parent-death signal, which stops a core whose front was killed, follows the starting thread."""

    def __init__(self, build: Callable[[], LLMEngine], startup_timeout: float = 600) -> None:
        self._dir = tempfile.mkdtemp(prefix="paged-attention-core-")  # mode 0700: this user only
        self._context = zmq.Context()
        self._inputs = self._context.socket(zmq.PUSH)
        self._inputs.bind(f"ipc://{self._dir}/input")
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.bind(f"ipc://{self._dir}/output")
        self.addresses = (f"ipc://{self._dir}/input", f"ipc://{self._dir}/output")
        # A fresh interpreter (no forked torch threads; unlike multiprocessing's spawn, it never
        # re-runs the caller's script, so a script or notebook needs no __main__ guard).
        command = [sys.executable, "-m", engine_core.__name__, *self.addresses, str(os.getpid())]
        # what this process can import, the core can (a builder may live in a script's folder)
        path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        self.process = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": path})
        atexit.register(self.close)  # a front that ends without shutdown() still stops its core
        self._send(("build", build))  # the core's first message: how to build its engine
        self.error: BaseException | None = None
        self._pending: dict[str, asyncio.Future] = {}  # adds awaiting the core's answer
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._reader: asyncio.Task | None = None
        self._pidfd: int | None = None
        self._watcher: asyncio.Task | None = None
        self._closed = self._stopping = False
        try:
            self.info = self._wait_ready(startup_timeout)
        except BaseException:
            self.close()
            raise
        self.tokenizer = self.info["tokenizer"]

    def _wait_ready(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._outputs.poll(200):
                message = pickle.loads(self._outputs.recv())
                if message[0] == "ready":
                    return message[1]
                raise EngineDeadError(message[1])
            if self.process.poll() is not None:
                status = self.process.returncode
                raise EngineDeadError(f"the engine core exited with status {status} at start")
        raise EngineDeadError(f"the engine core was not ready after {timeout:.0f} s")

    @property
    def is_running(self) -> bool:
        return self.error is None and not self._closed and self.process.poll() is None

    def start(self, sink: Sink) -> None:
        self._sink = sink
        self.loop = loop = asyncio.get_running_loop()
        self._async_outputs = zmq.asyncio.Socket.from_socket(self._outputs)
        self._reader = loop.create_task(self._read())
        if hasattr(os, "pidfd_open"):  # Linux: a descriptor that turns readable when the process ends
            self._pidfd = os.pidfd_open(self.process.pid)
            loop.add_reader(self._pidfd, self._died)
        else:  # elsewhere: look every 0.2 s
            self._watcher = loop.create_task(self._watch())

    # -- the verbs ------------------------------------------------------------------------------------
    async def add(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None:
        self._check_running()
        text, token_ids, salt = tokenize(prompt, self.tokenizer)  # the front's work, not the core's
        tokens: dict[str, Any] = {"prompt_token_ids": token_ids}
        if text is not None:
            tokens["prompt"] = text
        if salt is not None:
            tokens["cache_salt"] = salt
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        self._send(("add", request_id, tokens, params, None))
        try:
            await future
        finally:
            self._pending.pop(request_id, None)

    def abort(self, request_ids: list[str]) -> None:
        if self.is_running:
            self._send(("abort", list(request_ids)))

    async def call_utility(self, method: str, *args: Any) -> Any:
        self._check_running()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(("call", call_id, method, args))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    async def shutdown(self, timeout: float = 10) -> None:
        """Ask the core to stop, wait for it (then terminate, then kill it), release the sockets."""
        if self._closed:
            return
        self._stopping = True  # the core's end is expected from here on
        if self.process.poll() is None:
            with contextlib.suppress(zmq.ZMQError):
                self._send(("shutdown",))
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(self.process.wait, timeout)
        self._unwatch()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self._fail_waiting(EngineDeadError("the engine core was shut down"))
        self.close()

    def close(self) -> None:
        """Stop the process if it still runs and free the sockets (no event loop needed)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self._inputs.close(linger=0)
        self._outputs.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- inside ------------------------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        self._inputs.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def _check_running(self) -> None:
        if not self.is_running:
            why = "shut down" if self._closed else self.error or f"exit status {self.process.returncode}"
            raise EngineDeadError(f"the engine core is not running ({why})")

    async def _read(self) -> None:
        while True:
            message = pickle.loads(await self._async_outputs.recv())
            kind = message[0]
            if kind == "outputs":
                self._sink.outputs(message[1])
            elif kind == "added":
                for request_id, error in message[1]:
                    future = self._pending.get(request_id)
                    if future is not None and not future.done():
                        future.set_exception(error) if error is not None else future.set_result(None)
            elif kind == "result":
                _, call_id, ok, value = message
                future = self._calls.get(call_id)
                if future is not None and not future.done():
                    future.set_result(value) if ok else future.set_exception(value)
            elif kind == "failed":
                self._sink.failed(message[1], RuntimeError(message[2]))

    def _died(self) -> None:
        """The core process ended (the event loop saw its sentinel): fail everything waiting."""
        self._unwatch()
        if self._closed or self._stopping:
            return
        self.process.wait(1)
        status = self.process.returncode
        self.error = EngineDeadError(f"the engine core process died (exit status {status})")
        # stopped on purpose (SIGTERM to the whole process group, as `timeout` or a service manager
        # sends it, reaches the core first) is not a crash
        stopped = status is not None and -status in (signal.SIGTERM, signal.SIGINT)
        (log.warning if stopped else log.error)("%s", self.error)
        self._fail_waiting(self.error)
        self._sink.dead(self.error)

    async def _watch(self) -> None:
        while self.process.poll() is None:
            await asyncio.sleep(0.2)
        self._died()

    def _unwatch(self) -> None:
        if self._watcher is not None and self._watcher is not asyncio.current_task():
            self._watcher.cancel()
        if self._pidfd is not None:
            with contextlib.suppress(ValueError, OSError, RuntimeError):
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def _fail_waiting(self, error: BaseException) -> None:
        for future in [*self._pending.values(), *self._calls.values()]:
            if not future.done():
                future.set_exception(error)


def settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
