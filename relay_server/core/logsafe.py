"""Log hygiene: what users control is escaped, secrets never reach a log line.

Peer names, device labels, usernames of open runs, reported shard names and request paths
(decoded: ``%0a`` is a newline) are user text. Written raw, a newline in a ``peer_name`` forges a
whole relay log line. :func:`printable` escapes control characters, ``\\`` and Unicode
line separators as ``\\xNN``; :func:`install` applies it to every string argument of every log
record the relay's and aiohttp's loggers create (a log record factory), so no call site can
forget it, and one record is always one line.

aiohttp logs a malformed request itself ("Error handling request", the ``BadHttpMessage`` with
the offending header line's raw bytes): a mistyped ``Authorization: Bearer <admin token>`` used
to land in the log almost whole. :func:`install` puts :class:`SecretFilter` on aiohttp's server
logger: such records become one line naming the address and the kind of error, with anything
token-like redacted (:func:`redact`), and no traceback.
"""

from __future__ import annotations

import logging
import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\\\u2028\u2029]")
_HEADER_SECRET = re.compile(
    r"(?i)\b(authorization|proxy-authorization|cookie|x-collab-pass|x-collab-signature"
    r"|x-collab-ticket)(\s*[:=]\s*)[^\r\n]*"
)
_TOKEN = re.compile(r"hf_[A-Za-z0-9]{4,}|(?i:bearer)\s+\S+|[A-Za-z0-9_\-+/=]{24,}")
REDACTED = "<redacted>"


def printable(value: object, limit: int = 120) -> str:
    """``value`` as one safe log token: control characters escaped, at most ``limit`` characters
    of the original (then ``...``)."""
    text = value if isinstance(value, str) else str(value)
    cut = len(text) > limit
    escaped = _CONTROL.sub(_escape, text[:limit])
    return escaped + ("..." if cut else "")


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    return "\\\\" if char == "\\" else f"\\x{ord(char):02x}" if ord(char) < 256 else f"\\u{ord(char):04x}"


def redact(text: str) -> str:
    """``text`` with credential headers' values and token-like runs replaced by ``<redacted>``."""
    text = _HEADER_SECRET.sub(lambda m: m.group(1) + m.group(2) + REDACTED, text)
    return _TOKEN.sub(REDACTED, text)


class SecretFilter(logging.Filter):
    """On aiohttp's server logger: a record about a request aiohttp could not parse keeps only
    the peer address and the error's first line, redacted and escaped; every other record's
    arguments are redacted and escaped too (tracebacks of real bugs are kept)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and _is_parse_error(exc):
            remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            record.msg = "refused a malformed HTTP request from %s: %s (%s)"
            record.args = (printable(remote, 64), type(exc).__name__, printable(redact(first), 160))
            record.exc_info, record.exc_text = None, None
            return True
        if isinstance(record.args, tuple):
            # bytes are redacted in their repr (a str pattern cannot search bytes: redact(bytes) raised here)
            record.args = tuple(
                printable(redact(a if isinstance(a, str) else repr(a)), 400) if isinstance(a, (str, bytes)) else a
                for a in record.args
            )
        return True


def _is_parse_error(exc: BaseException) -> bool:
    try:
        from aiohttp.http_exceptions import HttpProcessingError
    except ImportError:  # pragma: no cover - aiohttp is a dependency of the relay
        return False
    return isinstance(exc, HttpProcessingError)


_SCOPED = ("relay_server", "aiohttp")
_installed = False


def install() -> None:
    """Escape user text in every relay and aiohttp log record, and put :class:`SecretFilter`
    on aiohttp's server logger (once per process)."""
    global _installed
    if _installed:
        return
    _installed = True
    previous = logging.getLogRecordFactory()

    def factory(*args: object, **kwargs: object) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        if record.name.startswith(_SCOPED) and isinstance(record.args, tuple):
            record.args = tuple(printable(a, 2000) if isinstance(a, str) else a for a in record.args)
        return record

    logging.setLogRecordFactory(factory)
    logging.getLogger("aiohttp.server").addFilter(SecretFilter())
