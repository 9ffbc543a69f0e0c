"""What the HTTP API checks before a handler runs, and the header read timeout.

- ``ApiGuardMiddleware`` (pure ASGI, outermost): on every path but the probes a request
  must carry one of the API keys as ``Authorization: Bearer KEY`` when keys are set (401
  otherwise), and a POST must say ``Content-Type: application/json`` (415 otherwise, a
  missing one included: a browser may POST ``text/plain`` cross-site without a CORS
  preflight). Both are decided from the headers, before a byte of the body is read.
  ``/health``, ``/ready`` and ``/metrics`` stay open; ``/admin/*`` keeps its own admin
  token. Deny by default: vLLM's routes outside ``/v1`` (``/tokenize``, ``/classify``,
  ``/score``, ``/rerank``, ``/v2/rerank``) run the model or read its tokenizer, and a route
  added later is guarded without anyone remembering to.
- ``HeaderTimeoutH11Protocol``: uvicorn's h11 protocol with a deadline on a request's headers.
  uvicorn bounds only the idle time between requests (``timeout_keep_alive``); a client that
  sends half a request line and stops holds the connection for ever. Here the headers of
  every request must be complete within ``header_timeout`` seconds of the connection opening
  (or of the previous response); otherwise the connection gets a 408 and is closed.
  The body's deadline is ``errors.BodyLimitMiddleware``'s (``body_timeout``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvrelay.router.errors import ApiError

_OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes: no key
_ADMIN_PREFIX = "/admin/"  # its own token (errors.require_admin_token)
_JSON_MEDIA_TYPE = "application/json"


class ApiGuardMiddleware:
    """API keys and the JSON content type on every path but the probes and ``/admin/*``
    (see the module docstring)."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...] = ()) -> None:
        self.app = app
        self._keys = tuple(key.encode() for key in api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        guarded = path not in _OPEN_PATHS and not path.startswith(_ADMIN_PREFIX)
        if scope["type"] == "http" and guarded:
            error = self._check(scope)
            if error is not None:
                await error.to_response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> ApiError | None:
        headers = dict(scope.get("headers", ()))
        if self._keys and not self._authorized(headers.get(b"authorization", b"")):
            return ApiError(
                401,
                "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if scope["method"] == "POST":
            media_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if media_type != _JSON_MEDIA_TYPE.encode():
                shown = media_type.decode("latin-1")[:100] or "none"
                return ApiError(
                    415,
                    f"Content-Type must be {_JSON_MEDIA_TYPE}, got {shown}",
                    param="Content-Type",
                    code="unsupported_media_type",
                )
        return None

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        # compare with every key (no early exit): the time taken does not tell which matched
        matches = [hmac.compare_digest(token, key) for key in self._keys]
        return any(matches)


def read_api_keys(keys: str | None, key_file: str | None) -> tuple[str, ...]:
    """Keys from a comma-separated list and/or a file (one a line; ``#`` comments).

    Raises:
        ValueError: the file cannot be read or names no key.
    """
    found = [k.strip() for k in (keys or "").split(",") if k.strip()]
    if key_file:
        try:
            with open(key_file, encoding="utf-8") as f:
                lines = [line.strip() for line in f]
        except OSError as e:
            raise ValueError(f"--api-key-file {key_file}: {e.strerror}") from None
        from_file = [line for line in lines if line and not line.startswith("#")]
        if not from_file:
            raise ValueError(f"--api-key-file {key_file}: no key in the file")
        found += from_file
    return tuple(dict.fromkeys(found))


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol; a request's headers must arrive within ``header_timeout``.

    ``with_header_timeout(seconds)`` makes the class with another deadline.
    """

    header_timeout: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._armed_cycle: object = None
        self._num_bytes_since_armed = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._num_bytes_since_armed += len(data)
        super().data_received(data)

    def on_response_complete(self) -> None:
        # armed first: a pipelined request that super() starts is a new cycle, not timed out
        self._arm_header_timer()
        super().on_response_complete()

    def shutdown(self) -> None:
        """The server's graceful shutdown: an idle TLS connection is dropped at once. Its
        ``close`` sends TLS's close_notify and keeps the connection until the client answers,
        which a client holding it idle in its pool never does: uvicorn then waited out its
        whole graceful-shutdown timeout on every router exit. Nothing is in flight on it."""
        idle = self.cycle is None or self.cycle.response_complete
        if idle and self.transport.get_extra_info("ssl_object") is not None:
            self.transport.abort()
            return
        super().shutdown()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._armed_cycle = self.cycle
        self._num_bytes_since_armed = 0
        self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.cycle is not self._armed_cycle or self.transport.is_closing():
            return  # the next request's headers arrived in time
        if self._num_bytes_since_armed:  # part of a request came: say why it is closed
            self.transport.write(_timeout_response(self.header_timeout))
        self.transport.close()


def with_header_timeout(seconds: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class uvicorn's ``Config(http=...)`` takes, with this header deadline."""
    if not seconds > 0:
        raise ValueError(f"header timeout must be > 0, got {seconds}")
    return type("HeaderTimeoutH11", (HeaderTimeoutH11Protocol,), {"header_timeout": seconds})


def _timeout_response(seconds: float) -> bytes:
    error = ApiError(
        408, f"The request headers did not arrive within {seconds:g} s", code="request_timeout"
    )
    body = json.dumps(error.body()).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body
