"""HTTP plumbing shared by the relay and the aggregators: JSON errors, bounded bodies, queries.

Every error, ours or aiohttp's, leaves as ``{"error": code, "message": ..., "hint": ...}`` with a
4xx/5xx status, on every server of a run.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import re
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.typedefs import Handler

from relay_server.core.errors import ApiError
from toolkit.errors import ProtocolError
from toolkit.wire.protocol import MAX_JSON_BODY, ErrorBody
from toolkit.wire.schema import Schema
from toolkit.wire.tensor_container import MAX_HEADER

log = logging.getLogger(__name__)

_DRAIN_LIMIT = 8 << 20  # after rejecting an upload, read at most this much so the peer sees the answer
_QUERY_INT = re.compile(r"-?[0-9]{1,12}")
_HTTP_HINTS = {  # aiohttp's own refusals get a next step too
    404: "Check the URL: the relay's API lives under /api/ (GET /api/status lists the run).",
    405: "This route exists but not with that HTTP method.",
    413: "The body is larger than the relay accepts for this route.",
}


_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)
BUSY_RETRY_AFTER_S = 2  # what a 503 "busy" asks peers to wait (they add jitter)


def error_response(
    status: int, code: str, message: str, hint: str = "", headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response(
        ErrorBody(error=code, message=message, hint=hint).to_json(), status=status, headers=headers
    )


def busy_response(message: str, retry_after_s: int = BUSY_RETRY_AFTER_S) -> web.Response:
    """503 + Retry-After: the relay is at a resource limit and refuses this request *before* doing
    any of it, so retrying later is always safe (the toolkit waits Retry-After plus jitter)."""
    return error_response(
        503,
        "relay_busy",
        message,
        f"Retry in {retry_after_s} s (the toolkit does this "
        "on its own); if it persists the organizer should raise the relay's limits.",
        headers={"Retry-After": str(retry_after_s)},
    )


def headers_sent(request: web.Request) -> bool:
    """Whether a response to ``request`` was already started (status line and headers written or
    queued): from then on the only honest way to report an error is to cut the connection."""
    writer = request.writer
    return bool(
        getattr(writer, "output_size", 0)
        or getattr(writer, "_headers_buf", None)
        or getattr(writer, "_headers_written", False)
    )


def _abort(request: web.Request, why: str) -> web.Response:
    """Cut a connection whose response was already under way: the peer sees a short body (it
    checks length and digest, then retries), never a second response spliced into the first."""
    transport = request.transport
    if transport is not None:
        transport.abort()
    log.info("%s %s: %s after the response started; connection cut", request.method, request.path, why)
    return web.Response(status=500)  # never reaches the wire: the transport is gone


def _disconnected(request: web.Request, exc: BaseException) -> bool:
    """The peer went away mid-request: a normal event on the internet, not a relay bug. A reset
    or broken pipe is taken as the peer's (writing to it is what raises them); any other I/O
    error counts only when the peer's own connection is closing (an aggregator's error is ours)."""
    transport = request.transport
    if isinstance(exc, (ConnectionResetError, BrokenPipeError)):  # writing to it (sendfile, a write)
        return True
    gone = transport is None or transport.is_closing()
    return gone and isinstance(exc, (OSError, asyncio.IncompleteReadError, EOFError))


def json_ok(message: Schema | dict[str, Any]) -> web.Response:
    return web.json_response(message.to_json() if isinstance(message, Schema) else message)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        if isinstance(exc, Exception) and _disconnected(request, exc):
            log.info("%s %s: the peer disconnected (%s)", request.method, request.path, type(exc).__name__)
            if request.transport is not None:
                request.transport.abort()  # whatever follows must not reach a half-written response
            return web.Response(status=499)  # nobody reads it: the transport is gone
        if isinstance(exc, Exception) and headers_sent(request):
            if not isinstance(exc, (ApiError, ProtocolError, web.HTTPException, OSError)):
                log.exception("unhandled error on %s %s", request.method, request.path)
            return _abort(request, type(exc).__name__)
        if isinstance(exc, OSError) and exc.errno in _OUT_OF_DESCRIPTORS:
            log.warning("out of file descriptors on %s %s: answered 503", request.method, request.path)
            return busy_response("the relay is out of file descriptors right now")
        return _error_answer(request, exc)


def _error_answer(request: web.Request, exc: BaseException) -> web.StreamResponse:
    """The JSON error for an exception raised before any response was started."""
    try:
        raise exc
    except ApiError as exc:
        return error_response(exc.status, exc.code, exc.message, exc.hint)
    except ProtocolError as exc:
        return error_response(413 if exc.code == "body_too_large" else 400, exc.code, exc.message, exc.hint)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = re.sub(r"[^a-z0-9]+", "_", (exc.reason or "error").lower()).strip("_")
        return error_response(exc.status, code, exc.text or exc.reason or "", _HTTP_HINTS.get(exc.status, ""))
    except Exception:  # a bug: log it, keep serving
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(
            500,
            "internal_error",
            "the relay hit an unexpected error",
            "Retry; if it persists, report it to the organizer with the relay log.",
        )


M = TypeVar("M", bound=Schema)


async def read_message(request: web.Request, schema: type[M]) -> M:
    if request.content_length is not None and request.content_length > MAX_JSON_BODY:
        raise ApiError(413, "body_too_large", f"JSON bodies are limited to {MAX_JSON_BODY} bytes")
    return schema.loads(await request.read())


def int_query(request: web.Request, name: str, default: int | None = None) -> int:
    raw = request.query.get(name)
    if raw is None:
        if default is None:
            raise ApiError(400, "bad_query", f"query parameter {name!r} is required")
        return default
    if not _QUERY_INT.fullmatch(raw):  # ASCII digits, bounded: int() alone takes "1_0", "\u0661", 10**4000
        raise ApiError(400, "bad_query", f"query parameter {name!r} must be an integer")
    return int(raw)


def path_int(request: web.Request, name: str) -> int:
    raw = request.match_info[name]
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 12:  # "\u00b2".isdigit() is True
        raise ApiError(400, "bad_path", f"{name} in the path must be a non-negative integer, got {raw[:20]!r}")
    return int(raw)


async def drain(request: web.Request) -> None:
    """Read a little of a rejected body so the peer gets our answer, not a reset connection."""
    remaining = request.content_length
    if remaining is None or remaining > _DRAIN_LIMIT:
        return
    try:
        await request.content.read(_DRAIN_LIMIT)
    except Exception:  # the peer may already be gone
        pass


def upload_length(request: web.Request, limit: int) -> int:
    """Check a tensor upload's declared length against ``limit`` payload bytes (+ header) before
    reading any of it; chunked uploads are refused."""
    if request.content_length is None:
        raise ApiError(
            411,
            "length_required",
            "a gradient upload must declare its Content-Length",
            "Send the body with a known length (the toolkit does); chunked uploads are refused.",
        )
    if request.content_length > limit + MAX_HEADER + 8:
        raise ApiError(413, "body_too_large", f"a gradient is at most {limit + MAX_HEADER + 8} bytes")
    return request.content_length
