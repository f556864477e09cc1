"""The error every authentication check raises (:class:`AuthRejected`), shared by the request
verifier and the streamed-body checks; the rate limiter counts these per address."""

from __future__ import annotations

from relay_server.core.errors import ApiError

_LOGIN_HINT = "Log in again (the toolkit does this by itself; re-run the cell if it keeps failing)."


class AuthRejected(ApiError):
    """A request that failed authentication: 401 (who are you?) or 403 (you may not)."""


def _reject(status: int, code: str, message: str, hint: str = _LOGIN_HINT) -> AuthRejected:
    return AuthRejected(status, code, message, hint)
