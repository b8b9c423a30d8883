"""An asyncio front over the engine, in the shape of vLLM's ``AsyncLLM``: one thread drives ``step()``.

The engine is synchronous and not thread-safe; a server is an asyncio event loop that must never
wait for a forward pass. So exactly one thread, the *engine loop*, owns the :class:`LLMEngine`::

    event loop (HTTP handlers)                 engine loop (one thread)
    --------------------------                 ------------------------
    generate(): command "add" ------------->   between steps: run every queued command
        await stream.get()                     step()  (schedule -> forward -> sample -> update)
    <---- call_soon_threadsafe(put) ---------  each RequestOutput to its request's stream
    client gone: command "abort" ---------->   aborted before the next step: its blocks are free

Every touch of the engine (adding, aborting, reading metrics) is a command that the engine loop
runs between two steps, so the engine sees one caller, as in ``LLM.generate``. vLLM goes further:
its engine core is a separate *process* (ZMQ sockets between them) and detokenization happens in
the front process; here one process and one thread keep the path short enough to read.

Invariants: a request added through :meth:`AsyncLLM.generate` ends, whatever happens, either with a
finished output or an exception in its stream, and the engine holds nothing of it afterwards
(a consumer that stops early, by a client disconnect or a cancelled task, aborts it). A step that
raises (a bug, out of memory) is rolled back by the engine; the loop then fails every request it
holds with that error, aborts them (their blocks return) and keeps serving.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from ..engine.inputs import Prompt
from ..engine.llm_engine import LLMEngine
from ..engine.outputs import RequestOutput
from ..engine.params import SamplingParams

log = logging.getLogger("paged_attention.serving")
T = TypeVar("T")


class EngineOverloaded(RuntimeError):
    """The front holds ``max_waiting`` requests that have not started: come back later (HTTP 503)."""


class EngineDead(RuntimeError):
    """The engine loop is not running (not started, shut down, or crashed)."""


class RequestAborted(RuntimeError):
    """The request was aborted by :meth:`AsyncLLM.abort` before it finished."""


class RequestStream:
    """One added request's outputs, in order: ``async for output in stream``. It ends after the
    ``finished`` output, or raises the exception that ended it. :meth:`close` ends it early and
    aborts the request if it is still running (call it in a ``finally``)."""

    def __init__(self, llm: AsyncLLM, request_id: str) -> None:
        self.llm, self.request_id = llm, request_id
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.started = False  # has it produced an output (left the waiting count)?
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        self.started = True
        if item.finished:
            self.finished = True
            self.llm._streams.pop(self.request_id, None)
        return item

    def close(self, reason: BaseException | None = None) -> None:
        """Stop following the request; abort it if it has not finished. A reader waiting in
        ``async for`` gets ``reason`` (:class:`RequestAborted` by default)."""
        if self.finished:
            return
        self.finished = True
        if self.llm._streams.get(self.request_id) is self:
            del self.llm._streams[self.request_id]
        self.llm._abort_soon(self.request_id)
        self.queue.put_nowait(reason or RequestAborted(f"request {self.request_id!r} was closed"))


class AsyncLLM:
    """Streams :class:`RequestOutput` objects of concurrent requests from one engine (see the module
    docstring). Use it from a running event loop: ``await start()``, ``async for out in generate(...)``,
    ``await shutdown()``.

    ``max_waiting``: how many requests may be admitted but not yet started (no output yet) before
    :meth:`generate` refuses with :class:`EngineOverloaded`; ``None`` for no limit.
    """

    def __init__(self, engine: LLMEngine, max_waiting: int | None = None) -> None:
        if not isinstance(engine, LLMEngine):
            raise TypeError(f"engine must be an LLMEngine, got {type(engine).__name__}")
        if max_waiting is not None and (
            isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1
        ):
            raise ValueError(f"max_waiting must be a positive int or None, got {max_waiting!r}")
        self.engine = engine
        self.max_waiting = max_waiting
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # touched by the event loop only
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.error: BaseException | None = None  # what killed the engine loop, if anything did
        self.num_steps = 0

    # -- life cycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine loop (once), bound to the running event loop."""
        if self._thread is not None:
            raise RuntimeError("this AsyncLLM was already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Abort everything still running, stop the engine loop and wait for it to end."""
        if self._thread is None:
            return
        self._stopping.set()
        self._commands.put(None)  # wake the loop if it waits for work
        await asyncio.to_thread(self._thread.join)
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDead("the server is shutting down"))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    @property
    def num_unfinished(self) -> int:
        """Requests admitted and not yet ended (as the front sees them)."""
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests admitted that have not produced an output yet (what ``max_waiting`` bounds)."""
        return sum(not s.started for s in self._streams.values())

    # -- requests -----------------------------------------------------------------------------------
    def check_admission(self) -> None:
        """Raise :class:`EngineDead` if the loop is not running, :class:`EngineOverloaded` if
        ``max_waiting`` requests already wait to start. A caller that adds several requests for
        one client call (a list of prompts) asks once, then adds them all with ``admitted=True``."""
        if not self.is_running:
            raise EngineDead("the engine loop is not running" + (f": {self.error!r}" if self.error else ""))
        if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            raise EngineOverloaded(
                f"{self.num_waiting} requests are waiting to start (the limit is max_waiting="
                f"{self.max_waiting}): retry later"
            )

    async def add_request(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None, admitted: bool = False
    ) -> RequestStream:
        """Add one request; returns its :class:`RequestStream` once the engine has accepted it.
        Bad input raises the engine's ``ValueError``/``TypeError`` (nothing is queued); unless
        ``admitted``, :meth:`check_admission` is asked first."""
        if not admitted:
            self.check_admission()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        try:
            await self._call(lambda: self.engine.add_request(request_id, prompt, params))
        except BaseException:
            stream.close()  # refused (nothing queued), or cancelled (an add that lands is aborted)
            raise
        return stream

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Add one request and yield its outputs as the engine produces them (as its
        ``params.output_kind`` says), the last one ``finished``; leaving early aborts it."""
        stream = await self.add_request(prompt, params, request_id)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    async def abort(self, request_id: str) -> None:
        """Abort a request now (before the next step); its stream ends with :class:`RequestAborted`."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.close(RequestAborted(f"request {request_id!r} was aborted"))

    def _abort_soon(self, request_id: str) -> None:
        """Queue the abort: the engine loop runs it before its next step (a no-op if it ended)."""

        def abort() -> None:
            if request_id in self.engine.request_ids:
                self.engine.abort_request(request_id)

        self._commands.put(abort)

    def call_soon(self, fn: Callable[[LLMEngine], T], timeout: float | None = None) -> T:
        """:meth:`call` from a thread other than the event loop's (a test, a notebook): blocks
        until the engine loop has run ``fn`` between two steps, and returns its result."""
        if self._loop is None:
            raise EngineDead("the engine loop was never started")
        return asyncio.run_coroutine_threadsafe(self.call(fn), self._loop).result(timeout)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine loop between two steps and return its result: the only
        safe way to read the engine (metrics, queues, the cache manager) while it serves."""
        return await self._call(lambda: fn(self.engine))

    async def _call(self, fn: Callable[[], T]) -> T:
        if not self.is_running:
            raise EngineDead("the engine loop is not running")
        assert self._loop is not None
        future: asyncio.Future = self._loop.create_future()
        loop = self._loop

        def run() -> None:
            try:
                result: Any = fn()
            except BaseException as err:
                loop.call_soon_threadsafe(_settle, future, None, err)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._commands.put(run)
        return await future

    # -- the engine loop (its own thread) -----------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping.is_set():
                busy = engine.has_unfinished_requests()
                self._run_commands(block=not busy)
                if self._stopping.is_set() or not engine.has_unfinished_requests():
                    continue
                try:
                    outputs = engine.step()
                except Exception as err:  # rolled back by the engine: fail what it holds, go on
                    log.exception("step failed; failing the %d requests it held", len(engine.request_ids))
                    self._fail_all(err)
                    continue
                self.num_steps += 1
                if outputs:
                    self._post(outputs)
        except BaseException as err:  # pragma: no cover - a bug in the loop itself
            self.error = err
            log.exception("the engine loop died")
        finally:
            self._stopping.set()
            ids = engine.request_ids
            if ids:
                engine.abort_request(ids)

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

    def _post(self, outputs: list[RequestOutput]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """On the event loop: each output to its stream (a stream already gone is skipped)."""
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.queue.put_nowait(output)

    def _fail_all(self, err: Exception) -> None:
        ids = self.engine.request_ids
        if ids:
            self.engine.abort_request(ids)
        assert self._loop is not None

        def fail() -> None:
            for request_id in ids:
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream.queue.put_nowait(RuntimeError(f"the engine step failed: {err!r}"))

        self._loop.call_soon_threadsafe(fail)


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
