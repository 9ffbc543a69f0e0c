"""A real in-process ``Backend`` over an ``LLMEngine``, for HTTP API tests.

One engine thread owns the engine: it takes commands (add, abort, call) from a thread-safe
queue between steps, steps while any request is unfinished, and hands each request's
outputs to the event loop that asked for it (``loop.call_soon_threadsafe``). The asyncio
side never touches the engine, so the engine needs no locks::

    event loop                          engine thread
    generate() --("add", input, sink)-->  add_request      ... step() --> sink.deliver(delta)
    aclose()   --("abort", request_id)-> abort_request (frees blocks)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from kvrelay.engine.admission import RequestError
from kvrelay.engine.engine import LLMEngine
from kvrelay.engine.outputs import RequestOutput
from kvrelay.router.backend import (
    Backend,
    Delta,
    GenerateInput,
    GenerationFailed,
    InvalidRequest,
    Unavailable,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
_IDLE_POLL_S = 0.05  # how long the idle engine thread waits for a command


@dataclass(slots=True)
class _Sink:
    """Where one request's deltas go: an asyncio queue on the loop that called generate."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Delta | BaseException] = field(default_factory=asyncio.Queue)
    num_delivered: int = 0

    def deliver(self, item: Delta | BaseException) -> bool:
        """False when the loop is gone (the request should be aborted)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # loop closed
            return False
        return True


class EngineBackend(Backend):
    """Runs requests on an ``LLMEngine`` driven by one background thread.

    Args:
        model_dir: checkpoint directory (a tokenizer is loaded from it).
        model_name: the name the API serves it under.
        **engine_args: passed to ``LLMEngine.from_args`` (``num_blocks``, ``max_model_len``...).
    """

    def __init__(self, model_dir: str | Path, model_name: str = "tiny", **engine_args: Any):
        self.engine = LLMEngine.from_args(model_dir, **engine_args)
        self.engine.grammars.warm_up()  # as workers do: no request waits seconds for it
        assert self.engine.tokenizer is not None
        self.tokenizer = self.engine.tokenizer
        self.model_name = model_name
        self.max_model_len = self.engine.config.scheduler.max_model_len
        self.step_delay_s = 0.0  # sleep after each step (tests that need slow generation)
        self.num_aborted = 0  # requests aborted while unfinished (engine thread writes)
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    # ---- Backend

    def is_ready(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    async def generate(self, request: GenerateInput) -> AsyncIterator[Delta]:
        if not self.is_ready():
            raise Unavailable("the engine is stopped", retry_after=1)
        sink = _Sink(asyncio.get_running_loop())
        self._commands.put(("add", request, sink))
        finished = False
        try:
            while not finished:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._commands.put(("abort", request.request_id))

    # ---- test helpers

    def call(self, fn: Callable[[LLMEngine], T], timeout: float = 10.0) -> T:
        """Runs ``fn(engine)`` on the engine thread, between steps, and returns its result."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put(("call", fn, future))
        return future.result(timeout)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Waits until no request is unfinished in the engine; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.call(lambda e: e.has_unfinished_requests() or bool(self._sinks)):
                return True
            time.sleep(0.01)
        return False

    def check_no_leaks(self, timeout: float = 10.0) -> None:
        """Asserts that, once idle, no KV block is referenced and the block manager is sound."""
        assert self.wait_idle(timeout), "requests still running in the engine"

        def check(engine: LLMEngine) -> int:
            engine.block_manager.check_integrity()
            return engine.block_manager.num_leaked()

        num_leaked = self.call(check)
        assert num_leaked == 0, f"{num_leaked} KV blocks leaked"

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._thread.join(timeout)

    # ---- engine thread

    def _run(self) -> None:
        while not self._stopping.is_set():
            busy = self.engine.has_unfinished_requests()
            self._drain_commands(block=not busy)
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception:  # last resort: fail every request rather than hang it
                logger.exception("engine step failed")
                self._fail_all("engine step failed")
                continue
            for output in outputs:
                self._deliver(output)
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
        self._fail_all("the engine stopped")

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_POLL_S) if block else None
            while True:
                if command is not None:
                    self._handle(command)
                command = self._commands.get_nowait()
        except queue.Empty:
            return

    def _handle(self, command: tuple[Any, ...]) -> None:
        kind = command[0]
        if kind == "add":
            self._add(command[1], command[2])
        elif kind == "abort":
            self._abort(command[1])
        elif kind == "call":
            fn, future = command[1], command[2]
            try:
                future.set_result(fn(self.engine))
            except Exception as exc:  # not swallowed: re-raised in the calling thread
                future.set_exception(exc)

    def _add(self, request: GenerateInput, sink: _Sink) -> None:
        try:
            self.engine.add_request(request.request_id, request.prompt_token_ids, request.params)
        except (RequestError, ValueError) as exc:
            param = getattr(exc, "param", None)  # the request's fault: 400, as the dispatcher
            if param is not None:
                sink.deliver(InvalidRequest(str(exc), param))
            else:
                sink.deliver(GenerationFailed(f"engine refused the request: {exc}"))
            return
        self._sinks[request.request_id] = sink

    def _abort(self, request_id: str) -> None:
        if self._sinks.pop(request_id, None) is not None and self.engine.abort_request(request_id):
            self.num_aborted += 1

    def _deliver(self, output: RequestOutput) -> None:
        sink = self._sinks.get(output.request_id)
        if sink is None:
            return
        if output.finished:
            del self._sinks[output.request_id]
        if not sink.deliver(self._delta(output, first=sink.num_delivered == 0)):
            self._abort(output.request_id)
        sink.num_delivered += 1

    def _delta(self, output: RequestOutput, first: bool) -> Delta:
        num_new = len(output.new_token_ids)
        logprobs = output.logprobs[-num_new:] if num_new else []
        cached = output.num_cached_tokens if first else 0
        return Delta(
            token_ids=list(output.new_token_ids),
            text=output.new_text,
            logprobs=[lp for lp in logprobs if lp is not None] or None,
            finished=output.finished,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
            num_prompt_tokens=len(output.prompt_token_ids),
            num_cached_tokens=cached,
            cached_tokens_by_tier={"device": cached} if cached else {},
            prompt_logprobs=output.prompt_logprobs if first else None,
        )

    def _fail_all(self, reason: str) -> None:
        for request_id, sink in list(self._sinks.items()):
            self.engine.abort_request(request_id)
            sink.deliver(GenerationFailed(reason))
        self._sinks.clear()


class ServerThread:
    """Serves an ASGI app with uvicorn on 127.0.0.1 (a free port) in a background thread."""

    def __init__(self, app: Any, startup_timeout: float = 30.0) -> None:
        import socket

        import uvicorn

        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._socket]}, name="uvicorn", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + startup_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self._socket.close()


class ScaleBody(BaseModel):
    """Body of the test admin route ``POST /admin/scale``."""

    num_decode: int


API_MODEL_NAMES = ("tiny", "tiny-alias")
API_ADMIN_TOKEN = "s3cret"
API_MAX_MODEL_LEN = 256


@dataclass(slots=True)
class ApiServer:
    base_url: str
    backend: EngineBackend
    server: ServerThread

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    def stop(self) -> None:
        self.server.stop()
        self.backend.shutdown()


def start_api_server(model_dir: str | Path) -> ApiServer:
    """``create_app`` over an ``EngineBackend``, extended as the lead does: a router of
    token-guarded admin routes (``/admin/ping``, and ``/admin/scale`` with a FastAPI body)."""
    from fastapi import APIRouter, Depends

    from kvrelay.router.api import create_app
    from kvrelay.router.api_settings import ApiSettings
    from kvrelay.router.errors import require_admin_token

    backend = EngineBackend(
        model_dir, API_MODEL_NAMES[0], num_blocks=128, max_model_len=API_MAX_MODEL_LEN
    )
    settings = ApiSettings(served_model_names=API_MODEL_NAMES, admin_token=API_ADMIN_TOKEN)
    app = create_app(backend, backend.tokenizer, settings)
    admin = APIRouter(prefix="/admin", dependencies=[Depends(require_admin_token(settings))])

    @admin.get("/ping")
    async def ping() -> dict[str, str]:
        return {"status": "pong"}

    @admin.post("/scale")
    async def scale(body: ScaleBody) -> dict[str, int]:  # FastAPI-validated body (422 -> 400)
        return {"num_decode": body.num_decode}

    app.include_router(admin)
    server = ServerThread(app)
    return ApiServer(server.base_url, backend, server)
