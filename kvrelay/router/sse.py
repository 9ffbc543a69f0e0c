"""Fan-out of one request's choices over the backend, SSE framing, and client disconnects.

``ChoiceStream`` runs one ``Backend.generate`` per choice in its own task and merges their
deltas, in arrival order, into one stream. ``close()`` cancels those tasks; each task closes
its generator (``aclose``), which is how the backend learns to abort and free KV blocks.
Whoever creates a ``ChoiceStream`` must ``close()`` it on every path (it is idempotent).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.responses import StreamingResponse

from kvrelay.router.backend import Backend, BackendError, Delta, GenerateInput, GenerationFailed
from kvrelay.router.errors import from_backend_error

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.types import Receive, Scope, Send

    from kvrelay.router.responses import ResponseBuilder

logger = logging.getLogger(__name__)

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


class ChoiceStream:
    """The merged deltas of every choice of one request.

    Args:
        backend: where to generate.
        inputs: one ``GenerateInput`` per choice; choice ``i`` is ``inputs[i]``.
    """

    def __init__(self, backend: Backend, inputs: list[GenerateInput]) -> None:
        self._queue: asyncio.Queue[tuple[int, Delta | BackendError]] = asyncio.Queue()
        self._num_open = len(inputs)
        self._tasks: list[asyncio.Task[None]] = []
        for index, request in enumerate(inputs):
            task = asyncio.create_task(self._pump(index, backend.generate(request)))
            task.add_done_callback(self._on_pump_done)
            self._tasks.append(task)

    async def next(self) -> tuple[int, Delta] | None:
        """The next delta of any choice, or None once every choice has finished.

        Raises:
            BackendError: a choice could not be admitted or broke off.
        """
        if self._num_open == 0:
            return None
        index, item = await self._queue.get()
        if isinstance(item, BackendError):
            raise item
        if item.finished:
            self._num_open -= 1
            if item.finish_reason == "abort":
                raise GenerationFailed("generation was aborted by the server")
        return index, item

    def close(self) -> None:
        """Cancels every choice still running; their generators abort in the backend."""
        for task in self._tasks:
            task.cancel()

    async def _pump(self, index: int, deltas: AsyncIterator[Delta]) -> None:
        try:
            async with aclosing(deltas):  # type: ignore[type-var]
                async for delta in deltas:
                    self._queue.put_nowait((index, delta))
                    if delta.finished:
                        return
            error: BackendError = GenerationFailed("the backend ended a choice without finishing")
        except BackendError as exc:
            error = exc
        self._queue.put_nowait((index, error))

    def _on_pump_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:  # a bug in a backend: fail the request instead of hanging it
            logger.error("backend generate raised", exc_info=exc)
            self._queue.put_nowait((-1, GenerationFailed("internal error while generating")))


async def until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Awaits ``awaitable`` unless the client disconnects first (then it is cancelled).

    Call only after the request body was read: it consumes ``receive`` messages.

    Raises:
        ClientDisconnected: the client went away first.
    """
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
    if work.cancelled():
        raise ClientDisconnected
    return work.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(stream: ChoiceStream, builder: ResponseBuilder) -> None:
    """Feeds every delta of ``stream`` into ``builder`` (the non-stream path)."""
    while (event := await stream.next()) is not None:
        builder.add(*event)


def encode_event(body: dict[str, Any]) -> bytes:
    return (
        b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    )


async def sse_events(
    first: tuple[int, Delta], stream: ChoiceStream, builder: ResponseBuilder
) -> AsyncIterator[bytes]:
    """The SSE body: chunks, the usage chunk if asked for, then ``[DONE]``.

    An error after the response started becomes a ``data: {"error": ...}`` event. The stream
    is closed however this generator ends (including cancellation on a client disconnect).
    """
    try:
        for start in builder.start_chunks():
            yield encode_event(start)
        event: tuple[int, Delta] | None = first
        while event is not None:
            chunk = builder.delta_chunk(*event)
            if chunk is not None:
                yield encode_event(chunk)
            event = await stream.next()
        usage = builder.usage_chunk()
        if usage is not None:
            yield encode_event(usage)
    except BackendError as exc:
        logger.warning("request %s failed while streaming: %s", builder.id, exc)
        yield encode_event(from_backend_error(exc).body())
    finally:
        stream.close()
    yield DONE


class EventStreamResponse(StreamingResponse):
    """An SSE response that runs ``on_close`` however it ends, even if never iterated."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
