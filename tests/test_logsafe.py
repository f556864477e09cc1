"""relay_server.core.logsafe's filter on aiohttp's server logger: every str or bytes argument of a
record is redacted and escaped, and a bytes argument (a raw header line) no longer raises inside
the filter (found by the type checker: ``redact`` searches str with str patterns)."""

from __future__ import annotations

import logging

from relay_server.core.logsafe import REDACTED, SecretFilter

SECRET = "Authorization: Bearer abcdefghijklmnopqrstuvwxyz0123456789"


def _filtered(*args: object) -> str:
    record = logging.LogRecord("aiohttp.server", logging.INFO, "x.py", 1, "got %s", args, None)
    assert SecretFilter().filter(record)
    return record.getMessage()


def test_a_str_argument_is_redacted() -> None:
    message = _filtered(SECRET)
    assert REDACTED in message and "abcdefghijklmnop" not in message


def test_a_bytes_argument_is_redacted_in_its_repr() -> None:
    message = _filtered(SECRET.encode() + b"\r\n")
    assert REDACTED in message and "abcdefghijklmnop" not in message
    assert "\r" not in message and "\n" not in message  # one record, one line


def test_other_arguments_pass_unchanged() -> None:
    assert _filtered(42) == "got 42"
