"""Requests to the relay, retried when that is safe, with every failure a typed error.

:class:`Transport` owns the connections: one keep-alive ``requests.Session`` for the relay and
one per slice owner (an aggregator the relay's plan names), plus the small thread pool that
moves slices in parallel. Its :meth:`Transport.request` is the one place that decides what a
failed request means: no answer, or an answer cut off mid-body (retried, then
:class:`~toolkit.errors.RelayUnreachable`), busy
or rate-limited (retried after the relay's Retry-After), an expired pass (signed again with a
fresh one), an error body (:class:`~toolkit.errors.RelayRejected` with the relay's hint), or a
web page where the relay's JSON should be (``not_a_relay``).
"""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import requests

from toolkit.errors import (
    MESSAGES,
    NOT_A_RELAY_HINT,
    ProtocolError,
    RelayRejected,
    RelayUnreachable,
    RelayUrlError,
    not_a_relay_message,
    unreachable_reason,
)
from toolkit.signing import SignedAuth
from toolkit.transfer import retry_after_s
from toolkit.wire.schema import Schema

log = logging.getLogger(__name__)
S = TypeVar("S", bound=Schema)

RETRY_STATUS = {502, 503, 504}
"""Answers from a relay (or its proxy) that is busy or restarting: worth asking again."""

FINAL_ANSWERS = {"task_timeout", "bad_result"}
"""The relay's own 502/504 answers about one call (its task ran past its deadline, its host sent
an invalid result): asking again with the same call id finds the same failed task, so the caller
hears the answer at once instead of after seconds of backoff (a failed expert, for a trainer)."""

MAX_RETRY_AFTER_S = 30.0
"""The longest Retry-After honoured: a relay asking for more is waited on for this long."""

RENEW_PASS = {"pass_expired", "stale_timestamp"}
"""Refusals a fresh access pass (and with it a fresh clock offset) fixes: retried at once."""

USER_AGENT = "collabtrain-peer"

NO_ANSWER: tuple[type[BaseException], ...] = (
    requests.ConnectionError,
    requests.Timeout,
    requests.exceptions.ChunkedEncodingError,
)
"""What ``requests`` raises when the relay gave no whole answer: no connection, no answer in time,
or a body cut off mid-way (``ChunkedEncodingError`` is how requests reports urllib3's
``IncompleteRead`` on a body it reads for the caller: a relay killed mid-answer). All mean the
same to a peer: ask again, and once the retries are spent, :class:`~toolkit.errors.RelayUnreachable`."""


def json_answer(response: requests.Response, schema: type[S], code: str, message: str, hint: str = "") -> S:
    """``response``'s JSON body as ``schema``. A body that is not JSON is ``ProtocolError(code,
    message)``; one that is JSON but breaks the schema keeps the schema's own error (which field)."""
    try:
        return schema.from_json(response.json())
    except ValueError as exc:
        if isinstance(exc, ProtocolError):
            raise
        raise ProtocolError(code, message, hint) from None


class Transport:
    """The relay's address, the sessions that reach it and its slice owners, and the retry policy."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 120.0,
        retries: int = 4,
        backoff_s: float = 0.5,
        auth: requests.auth.AuthBase | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise RelayUrlError("bad_relay_url", MESSAGES["bad_relay_url"][0].format(url=url))
        self.url = url.rstrip("/")
        self.timeout = (connect_timeout_s, read_timeout_s)
        self.retries = retries
        self.backoff_s = backoff_s
        self.session = requests.Session()
        self.session.headers["User-Agent"] = USER_AGENT
        self.session.auth = auth
        self._owners: dict[str, requests.Session] = {}
        """Slice owner URL -> its session; "" is the relay itself, signed like every relay request."""
        self._pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        self.session.close()
        for session in self._owners.values():
            session.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    @property
    def signed(self) -> bool:
        """Whether requests carry a signature (the run requires login and this peer logged in)."""
        return isinstance(self.session.auth, SignedAuth)

    def request(self, method: str, path: str, *, retry: bool = True, **kwargs: Any) -> requests.Response:
        """``method path`` on the relay; a response below 400, or a typed error.

        With ``retry`` (for requests safe to repeat), connection failures and busy answers are
        tried ``retries`` more times with backoff; a refused signature that a fresh pass fixes is
        signed again whatever ``retry`` says, since the relay did nothing with it."""
        kwargs.setdefault("timeout", self.timeout)
        attempts = self.retries + 1 if retry else 1
        for attempt in range(attempts):
            try:
                response = self.session.request(method, self.url + path, **kwargs)
            except NO_ANSWER as exc:
                if attempt + 1 == attempts:
                    message = MESSAGES["relay_unreachable"][0].format(url=self.url, reason=unreachable_reason(exc))
                    raise RelayUnreachable(
                        "relay_unreachable", f"{message} after {attempts} tries ({method} {path})"
                    ) from None
                self.backoff(attempt, type(exc).__name__)
                continue
            if (
                response.status_code in (*RETRY_STATUS, 429)
                and attempt + 1 < attempts
                and rejected(response).code not in FINAL_ANSWERS
            ):
                self.backoff(attempt, f"HTTP {response.status_code}", retry_after_s(response.headers))
                response.close()
                continue
            if (
                response.status_code == 401
                and attempt + 1 < attempts
                and isinstance(self.session.auth, SignedAuth)
                and rejected(response).code in RENEW_PASS
            ):
                self.session.auth.holder.invalidate()  # the next attempt is signed with a fresh pass
                continue
            if response.status_code >= 400:
                raise rejected(response)
            return response
        raise AssertionError("unreachable")

    def backoff(self, attempt: int, why: str, retry_after: float | None = None) -> None:
        """Backoff (or the relay's Retry-After) plus jitter: a thousand refused peers must not
        return at once."""
        base = min(MAX_RETRY_AFTER_S, retry_after) if retry_after is not None else self.backoff_s * 2**attempt
        delay = base * random.uniform(1.0, 1.5)
        log.debug("relay request failed (%s); retrying in %.1fs", why, delay)
        time.sleep(delay)

    def call(self, method: str, path: str, schema: type[S], body: Schema | None = None, **kwargs: Any) -> S:
        """A JSON route: ``body`` sent as JSON, the answer parsed as ``schema``. An answer that is
        not the relay's JSON (a web page at the wrong address) is ``not_a_relay``."""
        if body is not None:
            kwargs["data"] = body.dumps()
            kwargs["headers"] = {"Content-Type": "application/json"}
        response = self.request(method, path, **kwargs)
        return json_answer(
            response,
            schema,
            "not_a_relay",
            not_a_relay_message(response.url, response.status_code, response.headers.get("Content-Type", "")),
            NOT_A_RELAY_HINT,
        )

    def owner_session(self, url: str) -> tuple[requests.Session, str]:
        """The session for a slice owner and its base URL ("" = the relay: signed like every
        relay request)."""
        session = self._owners.get(url)
        if session is None:
            session = self._owners[url] = requests.Session()
            session.headers["User-Agent"] = USER_AGENT
            if not url:
                session.auth = self.session.auth
        return session, (url or self.url).rstrip("/")

    def pool(self) -> ThreadPoolExecutor:
        """The threads slices move on, started on first use (most runs never slice)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="collab-slices")
        return self._pool


def rejected(response: requests.Response) -> RelayRejected:
    """The relay's error body as a typed error; a body that is not the relay's JSON (a proxy's or
    web server's error page) says so instead of quoting it."""
    try:
        body = response.json()
        return RelayRejected(
            str(body.get("error", "error")),
            str(body.get("message", "")),
            str(body.get("hint", "")),
            status=response.status_code,
        )
    except ValueError:
        return RelayRejected(
            "not_a_relay",
            not_a_relay_message(response.url, response.status_code, response.headers.get("Content-Type", "")),
            NOT_A_RELAY_HINT,
            status=response.status_code,
        )
