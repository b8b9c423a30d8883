"""An asyncio front over the engine core, in the shape of vLLM v1's ``AsyncLLM``.

A server is an asyncio event loop that must never wait for a forward pass, so the engine core runs
elsewhere and the front talks to it through a client (:mod:`.core_client`)::

    event loop (HTTP handlers, this module)          engine core (a thread, or its own process)
    ---------------------------------------          -------------------------------------------
    generate(): client.add(id, prompt, params) --->  between steps: adds, aborts, utility calls
        async for output in its RequestStream        step()  (schedule -> execute -> update)
    <---- sink.outputs([...]): each to its stream --  the outputs of every request that moved on
    client gone: client.abort([id]) ------------->   aborted before the next step: its blocks free

:meth:`AsyncLLM.from_builder` starts the core in a process of its own (vLLM's default; ``serve``
uses it): the front then tokenizes prompts and the HTTP work runs on the other CPU core while the
model computes. ``AsyncLLM(engine)`` runs an engine built here on a thread of this process (tests,
notebooks: one model load, the engine's state readable with :meth:`call`).

Invariants: a request added through :meth:`AsyncLLM.generate` ends, whatever happens, either with a
finished output or an exception in its stream, and the engine holds nothing of it afterwards (a
consumer that stops early, by a client disconnect or a cancelled task, aborts it). A step that raises
is rolled back by the engine; the requests it held fail with that error and are aborted, and the
core keeps serving. A core that dies fails every open stream and every waiting call with
:class:`~.core_client.EngineDeadError`; nothing hangs.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .core_client import EngineDeadError, MPClient, ThreadClient
from .inputs import Prompt
from .outputs import RequestOutput
from .params import SamplingParams

if TYPE_CHECKING:  # a front whose core runs in another process never loads the model code
    from .llm_engine import LLMEngine

T = TypeVar("T")


class EngineOverloaded(RuntimeError):
    """The front holds ``max_waiting`` requests that have not started: come back later (HTTP 503)."""


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
            self.llm.streams.pop(self.request_id, None)
        return item

    def close(self, reason: BaseException | None = None) -> None:
        """Stop following the request; abort it if it has not finished. A reader waiting in
        ``async for`` gets ``reason`` (:class:`RequestAborted` by default)."""
        if self.finished:
            return
        self.finished = True
        if self.llm.streams.get(self.request_id) is self:
            del self.llm.streams[self.request_id]
        self.llm.client.abort([self.request_id])
        self.queue.put_nowait(reason or RequestAborted(f"request {self.request_id!r} was closed"))


class AsyncLLM:
    """Streams :class:`RequestOutput` objects of concurrent requests from one engine core (see the
    module docstring). Use it from a running event loop: ``await start()``, ``async for out in
    generate(...)``, ``await shutdown()``.

    ``max_waiting``: how many requests may be admitted but not yet started (no output yet) before
    :meth:`generate` refuses with :class:`EngineOverloaded`; ``None`` for no limit.
    """

    def __init__(self, engine: LLMEngine | MPClient, max_waiting: int | None = None) -> None:
        if not isinstance(engine, MPClient):
            from .llm_engine import LLMEngine  # imported here: a front with an MPClient never needs it

            if not isinstance(engine, LLMEngine):
                raise TypeError(f"engine must be an LLMEngine (or an MPClient), got {type(engine).__name__}")
        if max_waiting is not None and (
            isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1
        ):
            raise ValueError(f"max_waiting must be a positive int or None, got {max_waiting!r}")
        self.client = engine if isinstance(engine, MPClient) else ThreadClient(engine)
        #: The engine, when it runs on a thread of this process (None when it has its own process).
        self.engine = None if isinstance(engine, MPClient) else engine
        self.max_waiting = max_waiting
        info = self.client.info
        self.tokenizer = info["tokenizer"]  # the front's own copy (MPClient: sent by the core)
        self.sampling_defaults: dict[str, Any] = info["sampling_defaults"]
        self.max_model_len: int = info["max_model_len"]
        self.streams: dict[str, RequestStream] = {}  # touched by the event loop only
        self._ids = itertools.count()
        self._started = False

    @classmethod
    def from_builder(
        cls, build: Callable[[], LLMEngine], max_waiting: int | None = None, startup_timeout: float = 600
    ) -> AsyncLLM:
        """The engine core built by ``build`` (picklable) in a process of its own; returns when it is
        ready (raises :class:`EngineDeadError` if it could not start)."""
        return cls(MPClient(build, startup_timeout), max_waiting)

    # -- life cycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start receiving from the core (once), bound to the running event loop."""
        if self._started:
            raise RuntimeError("this AsyncLLM was already started")
        self._started = True
        self.client.start(self)

    async def shutdown(self) -> None:
        """Abort everything still running, stop the engine core and wait for it to end."""
        if not self._started:
            if isinstance(self.client, MPClient):
                self.client.close()
            return
        await self.client.shutdown()
        self.dead(EngineDeadError("the server is shutting down"))

    @property
    def is_running(self) -> bool:
        return self._started and self.client.is_running

    @property
    def error(self) -> BaseException | None:
        """What stopped the engine core, if anything did."""
        return self.client.error

    @property
    def num_unfinished(self) -> int:
        """Requests admitted and not yet ended (as the front sees them)."""
        return len(self.streams)

    @property
    def num_waiting(self) -> int:
        """Requests admitted that have not produced an output yet (what ``max_waiting`` bounds)."""
        return sum(not s.started for s in self.streams.values())

    # -- requests -----------------------------------------------------------------------------------
    def check_admission(self) -> None:
        """Raise :class:`EngineDeadError` if the core is not running, :class:`EngineOverloaded` if
        ``max_waiting`` requests already wait to start. A caller that adds several requests for
        one client call (a list of prompts) asks once, then adds them all with ``admitted=True``."""
        if not self.is_running:
            why = f": {self.error!r}" if self.error else ""
            raise EngineDeadError(f"the engine core is not running{why}")
        if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            raise EngineOverloaded(
                f"{self.num_waiting} requests are waiting to start (the limit is max_waiting="
                f"{self.max_waiting}): retry later"
            )

    async def add_request(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None, admitted: bool = False
    ) -> RequestStream:
        """Add one request; returns its :class:`RequestStream` once the core has accepted it.
        Bad input raises the engine's ``ValueError``/``TypeError`` (nothing is queued); unless
        ``admitted``, :meth:`check_admission` is asked first."""
        if not admitted:
            self.check_admission()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = RequestStream(self, request_id)
        self.streams[request_id] = stream
        try:
            await self.client.add(request_id, prompt, params)
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
        stream = self.streams.get(request_id)
        if stream is not None:
            stream.close(RequestAborted(f"request {request_id!r} was aborted"))

    async def call_utility(self, method: str, *args: Any) -> Any:
        """``method(*args)`` of the engine core between two steps, wherever the core runs (vLLM's
        ``call_utility``): ``get_metrics``, ``reset_prefix_cache``, ``has_unfinished_requests``."""
        return await self.client.call_utility(method, *args)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine's thread between two steps and return its result: the
        way to read an engine on a thread of this process (its queues, its cache manager) while it
        serves. A core in its own process answers :meth:`call_utility` only."""
        if not isinstance(self.client, ThreadClient):
            raise TypeError("the engine core runs in another process: use call_utility(method, *args)")
        engine = self.client.engine
        return await self.client.run(lambda: fn(engine))

    def call_soon(self, fn: Callable[[LLMEngine], T], timeout: float | None = None) -> T:
        """:meth:`call` from a thread other than the event loop's (a test, a notebook): blocks
        until the engine's thread has run ``fn`` between two steps, and returns its result."""
        if not self._started:
            raise EngineDeadError("the engine core was never started")
        if not isinstance(self.client, ThreadClient):
            raise TypeError("the engine core runs in another process: use call_utility(method, *args)")
        return asyncio.run_coroutine_threadsafe(self.call(fn), self.client.loop).result(timeout)

    # -- the sink: what the core produced, on the event loop (core_client.Sink) ---------------------
    def outputs(self, outputs: list[RequestOutput]) -> None:
        """Each output to its stream (a stream already gone is skipped)."""
        for output in outputs:
            stream = self.streams.get(output.request_id)
            if stream is not None:
                stream.queue.put_nowait(output)

    def failed(self, request_ids: list[str], error: BaseException) -> None:
        """A step raised and was rolled back; these requests were aborted by the core."""
        for request_id in request_ids:
            stream = self.streams.get(request_id)
            if stream is not None:
                stream.queue.put_nowait(error)

    def dead(self, error: BaseException) -> None:
        """The core is gone: every open stream ends with ``error``."""
        for stream in self.streams.values():
            stream.queue.put_nowait(error)
