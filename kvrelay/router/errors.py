"""OpenAI-shaped errors for the HTTP API, the request body limit and the admin-token check.

Every error leaves the server as ``{"error": {"message", "type", "param", "code"}}``:

=====  ==============================  =========================================================
code   type                            raised for
=====  ==============================  =========================================================
400    invalid_request_error           malformed JSON, invalid UTF-8, wrong types, bad values
401    invalid_request_error           missing or wrong admin token or API key
404    invalid_request_error           unknown model (code ``model_not_found``) or route
405    invalid_request_error           a known route with the wrong method
408    invalid_request_error           headers or body not received within their timeout
413    invalid_request_error           body over ``max_body_bytes`` (checked before parsing)
415    invalid_request_error           a POST (not /admin/*) whose Content-Type is not JSON
429    rate_limit_error                ``Overloaded`` (with Retry-After)
500    server_error                    ``GenerationFailed`` or an unexpected error (logged)
503    server_error                    ``Unavailable`` (with Retry-After)
=====  ==============================  =========================================================

FastAPI's own 422 validation shape never reaches a client: it becomes a 400 here.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvrelay.router.backend import BackendError

if TYPE_CHECKING:
    from pydantic import ValidationError
    from pydantic_core import ErrorDetails

    from kvrelay.router.api_settings import ApiSettings

logger = logging.getLogger(__name__)

DEFAULT_RETRY_AFTER_S = 1  # Retry-After when a BackendError names none
_BACKEND_ERROR_TYPES = {
    400: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}
_OBJECT_EXPECTED = re.compile(r"a valid dictionary or instance of \w+")  # pydantic's wording
_BACKEND_ERROR_CODES = {429: "rate_limit_exceeded", 500: "generation_failed", 503: "unavailable"}


class ApiError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_response(self) -> Response:
        # ensure_ascii: messages may quote client input holding lone surrogates.
        content = json.dumps(self.body(), ensure_ascii=True).encode("ascii")
        return Response(content, self.status_code, self.headers, "application/json")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_backend_error(exc: BackendError) -> ApiError:
    """The client-facing form of a backend refusal or failure."""
    status = exc.status_code
    headers = {}
    if status in (429, 503):
        retry_after = exc.retry_after if exc.retry_after is not None else DEFAULT_RETRY_AFTER_S
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    return ApiError(
        status,
        str(exc) or type(exc).__name__,
        type=_BACKEND_ERROR_TYPES.get(status, "server_error"),
        code=_BACKEND_ERROR_CODES.get(status),
        headers=headers,
        param=getattr(exc, "param", None),
    )


def format_loc(loc: Sequence[int | str]) -> str:
    """``("messages", 0, "role")`` -> ``"messages[0].role"``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def from_validation_errors(errors: Sequence[ErrorDetails], skip_loc: int = 0) -> ApiError:
    """A 400 naming the first invalid field; ``skip_loc`` drops FastAPI's ``body`` prefix."""
    if not errors:
        return bad_request("invalid request")
    # The deepest location is the most specific (a union reports one error per member).
    locs = [_drop_union_tags(e["loc"][skip_loc:]) for e in errors]
    deepest = max(range(len(errors)), key=lambda i: len(locs[i]))
    param = format_loc(locs[deepest]) or None
    where = f" for '{param}'" if param else ""
    message = _OBJECT_EXPECTED.sub("an object", errors[deepest]["msg"])
    return bad_request(f"Invalid value{where}: {message}", param=param)


def from_pydantic(exc: ValidationError) -> ApiError:
    return from_validation_errors(exc.errors(include_url=False, include_input=False))


def _drop_union_tags(loc: Sequence[int | str]) -> list[int | str]:
    """Pydantic puts the union member's name (``str``, ``list[int]``...) in ``loc``; drop it."""
    return [p for p in loc if isinstance(p, int) or not _is_type_tag(p)]


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in {"str", "int", "float", "bool", "list", "dict", "none"}


# ---- exception handlers -------------------------------------------------------------------


async def _handle_api_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.to_response()


async def _handle_backend_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, BackendError)
    if exc.status_code >= 500:
        logger.warning("backend error: %s", exc)
    return from_backend_error(exc).to_response()


async def _handle_request_validation(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = [dict(e) for e in exc.errors()]
    for error in errors:
        error.pop("input", None)
    loc_prefix = 1 if errors and errors[0].get("loc", ("",))[0] in ("body", "query") else 0
    return from_validation_errors(errors, loc_prefix).to_response()  # type: ignore[arg-type]


async def _handle_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif exc.status_code == 405:
        message = f"Method {request.method} not allowed for {request.url.path}"
    else:
        message = str(exc.detail)
    error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    headers = dict(exc.headers or {})
    return ApiError(exc.status_code, message, type=error_type, headers=headers).to_response()


async def _handle_unexpected(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return ApiError(500, "internal server error", type="server_error").to_response()


def install_error_handlers(app: FastAPI) -> None:
    """Makes every error ``app`` can raise leave in OpenAI's shape."""
    app.add_exception_handler(ApiError, _handle_api_error)
    app.add_exception_handler(BackendError, _handle_backend_error)
    app.add_exception_handler(RequestValidationError, _handle_request_validation)
    app.add_exception_handler(StarletteHTTPException, _handle_http_exception)
    app.add_exception_handler(Exception, _handle_unexpected)


# ---- request body limit -------------------------------------------------------------------


class BodyLimitMiddleware:
    """Pure ASGI middleware that reads an HTTP request body up to ``max_body_bytes``,
    within ``body_timeout`` seconds.

    A ``Content-Length`` over the limit is refused at once (413) without reading; a chunked
    body is counted as it arrives and refused as soon as it passes the limit. A body not
    complete within ``body_timeout`` (a chunked body that never ends, fewer bytes than its
    ``Content-Length``, a slow drip) gets 408 and the connection is closed. A body within
    the limits is replayed to the app, and later ``receive`` calls (disconnect) pass through.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout: float = 30.0) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            declared = _content_length(scope)
            if declared is not None and declared > self.max_body_bytes:
                raise self._too_large()
            async with asyncio.timeout(self.body_timeout):
                body = await self._read_body(receive)
        except TimeoutError:
            await self._timed_out().to_response()(scope, receive, send)
            return
        except ApiError as exc:
            await exc.to_response()(scope, receive, send)
            return
        if body is None:  # the client went away while sending
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _timed_out(self) -> ApiError:
        return ApiError(
            408,
            f"The request body did not arrive within {self.body_timeout:g} s",
            code="request_timeout",
            headers={"Connection": "close"},
        )

    def _too_large(self) -> ApiError:
        return ApiError(
            413,
            f"Request body is larger than the limit of {self.max_body_bytes} bytes",
            code="request_too_large",
            headers={"Connection": "close"},
        )


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                raise ApiError(400, "Invalid Content-Length header") from None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


# ---- admin token --------------------------------------------------------------------------


def require_admin_token(settings: ApiSettings) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency that demands ``Authorization: Bearer <settings.admin_token>``.

    With no token configured every request passes. Use it as
    ``APIRouter(dependencies=[Depends(require_admin_token(settings))])``.
    """
    expected = settings.admin_token

    async def check(request: Request) -> None:
        if expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode("utf-8", "surrogateescape"), expected.encode("utf-8")
        ):
            raise ApiError(
                401,
                "Missing or invalid admin bearer token",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check
