"""The plumbing between the server's routes and the engine: adding a request's prompts, merging
their streams, aborting when the client goes away, and one server-sent event."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request

from ..engine.async_llm import AsyncLLM, EngineOverloaded, RequestStream
from ..engine.core_client import EngineDeadError
from ..engine.outputs import RequestOutput
from ..engine.params import SamplingParams
from .errors import APIError, engine_error


async def add_all(
    llm: AsyncLLM, prompts: list[Any], params: SamplingParams, response_id: str, prompt_field: str
) -> list[RequestStream]:
    """One engine request per prompt, all or none: a refused prompt aborts those already added."""
    streams: list[RequestStream] = []
    try:
        llm.check_admission()  # once per client call: its prompts are admitted together
        for i, prompt in enumerate(prompts):
            try:
                streams.append(await llm.add_request(prompt, params, f"{response_id}-{i}", admitted=True))
            except (ValueError, TypeError) as err:
                error = engine_error(err, prompt_field)
                if len(prompts) > 1:
                    error.message = f"prompt {i}: {error.message}"
                raise error from err
    except (EngineOverloaded, EngineDeadError) as err:  # come back later
        raise APIError(str(err), 503) from err
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return streams


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several streams as they come, each with its stream's index."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await merged.put((index, output))
        except BaseException as err:
            await merged.put((index, err))
        finally:
            await merged.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, item = await merged.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def until_disconnect(
    raw: Request, work: Callable[[], Awaitable[None]], streams: list[RequestStream]
) -> bool:
    """Run ``work``; if the client disconnects first, close (abort) ``streams`` and stop. Returns
    whether ``work`` finished (false: the client is gone and nobody reads an answer)."""
    task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(disconnected(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            for stream in streams:
                stream.close()
        watcher.cancel()
    if not task.done():  # cancelled just now (it ends at its next await): the client went away
        return False
    task.result()
    return True


async def disconnected(raw: Request) -> None:
    """Return when the client goes away (the body was read: what comes next is the disconnect)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
