"""Who is this peer? Ask Hugging Face (``whoami``) once per login, then apply the run's allowlist.

The token only passes through: it is handed to ``huggingface_hub`` in a worker thread and
dropped; no log line, error message or repr here contains it (errors name the exception type and
HTTP status, never the upstream text, which could echo the request).

``huggingface_hub`` reads ``HF_ENDPOINT`` at import time and its shared HTTP client has no
timeout, so the endpoint is passed explicitly and each call runs in a daemon thread under
``timeout_s`` with at most ``max_concurrent`` in flight: a hung Hub cannot pile up threads or
block the relay's exit, and logins answer 503 instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relay_server.auth.verify import AuthRejected
from relay_server.core.hub_files import DEFAULT_ENDPOINT
from toolkit.wire.auth import USERNAME_RE

log = logging.getLogger(__name__)

_TOKEN_HINT = (
    "Create a read token at https://huggingface.co/settings/tokens, put it in the HF_TOKEN secret "
    "(notebook) or variable (shell), and run again."
)


@dataclass(frozen=True, kw_only=True)
class AllowList:
    """Who may join: listed usernames, members of listed organizations, or (explicitly) anyone
    with a Hugging Face account. Names compare case-insensitively, as the Hub's do."""

    users: frozenset[str] = frozenset()
    """HF usernames allowed to join (``auth.allow_users``)."""
    orgs: frozenset[str] = frozenset()
    """HF organizations whose members may join (``auth.allow_orgs``); the token must be allowed
    to see the membership (fine-grained tokens: grant read access to the organization)."""
    any_user: bool = False
    """Admit every HF account (``auth.allow_any_hf_user``): identity and bans, no screening."""

    def __post_init__(self) -> None:
        if not (self.users or self.orgs or self.any_user):
            raise ValueError(
                "the allowlist is empty, so nobody could join: set auth.allow_users and/or "
                "auth.allow_orgs, or auth.allow_any_hf_user = true"
            )
        object.__setattr__(self, "users", frozenset(u.casefold() for u in self.users))
        object.__setattr__(self, "orgs", frozenset(o.casefold() for o in self.orgs))

    def permits(self, identity: HfIdentity) -> bool:
        return (
            self.any_user
            or identity.username.casefold() in self.users
            or any(org.casefold() in self.orgs for org in identity.orgs)
        )


@dataclass(frozen=True)
class HfIdentity:
    """What the Hub confirmed. ``token_role`` is "read", "write", "fineGrained" or ""."""

    username: str
    orgs: tuple[str, ...]
    token_role: str = ""


Whoami = Callable[[str, str], dict[str, Any]]  # (endpoint, token) -> whoami-v2 JSON


def hf_whoami(endpoint: str, token: str) -> dict[str, Any]:
    """``GET {endpoint}/api/whoami-v2`` with ``Authorization: Bearer <token>``, via huggingface_hub."""
    from huggingface_hub import HfApi  # imported late: the relay without auth never needs it

    return HfApi(endpoint=endpoint, library_name="collabtrain-relay").whoami(token=token)


class HfIdentityVerifier:
    """Verify a token with the Hub and check the allowlist; raise :class:`AuthRejected` otherwise."""

    def __init__(
        self,
        allow: AllowList,
        *,
        endpoint: str | None = None,
        timeout_s: float = 15.0,
        max_concurrent: int = 4,
        whoami: Whoami = hf_whoami,
    ) -> None:
        self.allow = allow
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        if not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(f"auth.hf_endpoint must start with http:// or https://, got {self.endpoint!r}")
        self.timeout_s = timeout_s
        self._whoami = whoami
        self._slots = threading.BoundedSemaphore(max_concurrent)

    async def verify(self, token: str) -> HfIdentity:
        if (
            not isinstance(token, str)
            or not 8 <= len(token) <= 512
            or not token.isascii()
            or not token.isprintable()
            or any(c.isspace() for c in token)
        ):
            raise AuthRejected(401, "invalid_hf_token", "that does not look like a Hugging Face token", _TOKEN_HINT)
        info = await self._call(token)
        identity = _parse_whoami(info)
        if not self.allow.permits(identity):
            log.info("login refused: %s is not on the allowlist", identity.username)
            raise AuthRejected(
                403,
                "not_allowlisted",
                f"Hugging Face user {identity.username!r} is not allowed to join this run",
                "Ask the organizer to add your username, or join the run's organization on huggingface.co.",
            )
        log.info("HF identity verified: %s", identity.username)
        return identity

    async def _call(self, token: str) -> dict[str, Any]:
        if not self._slots.acquire(blocking=False):
            raise AuthRejected(503, "login_busy", "too many logins in progress", "Retry in a few seconds.")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[tuple[Any, BaseException | None]] = loop.create_future()

        def work() -> None:
            try:
                outcome: tuple[Any, BaseException | None] = (self._whoami(self.endpoint, token), None)
            except BaseException as exc:  # handed to the event loop, mapped below
                outcome = (None, exc)
            finally:
                self._slots.release()
            try:
                loop.call_soon_threadsafe(_settle, done, outcome)
            except RuntimeError:  # the loop closed while the Hub was answering
                pass

        threading.Thread(target=work, name="hf-whoami", daemon=True).start()
        try:
            info, exc = await asyncio.wait_for(done, self.timeout_s)
        except asyncio.TimeoutError:
            log.warning("HF identity check at %s timed out after %.0fs", self.endpoint, self.timeout_s)
            raise AuthRejected(
                503,
                "identity_unavailable",
                f"Hugging Face did not answer within {self.timeout_s:.0f}s",
                "Retry in a minute.",
            ) from None
        if exc is not None:
            raise _map_error(exc, self.endpoint) from None
        return info


def _settle(
    future: asyncio.Future[tuple[Any, BaseException | None]], outcome: tuple[Any, BaseException | None]
) -> None:
    if not future.done():
        future.set_result(outcome)


def _map_error(exc: BaseException, endpoint: str) -> AuthRejected:
    status = getattr(getattr(exc, "response", None), "status_code", None)
    log.warning(
        "HF identity check at %s failed: %s%s", endpoint, type(exc).__name__, f" (HTTP {status})" if status else ""
    )
    if status in (401, 403):
        return AuthRejected(
            401, "invalid_hf_token", "Hugging Face rejected the token (wrong, expired or revoked)", _TOKEN_HINT
        )
    if status == 429:
        return AuthRejected(
            503, "identity_rate_limited", "Hugging Face rate-limited the relay's identity checks", "Retry in a minute."
        )
    if type(exc).__name__ == "OfflineModeIsEnabled":
        return AuthRejected(
            503,
            "identity_unavailable",
            "the relay runs with HF_HUB_OFFLINE set",
            "The organizer must unset HF_HUB_OFFLINE for the relay.",
        )
    return AuthRejected(
        503,
        "identity_unavailable",
        f"cannot reach Hugging Face ({type(exc).__name__})",
        "Retry in a minute; if it persists, the organizer should check auth.hf_endpoint.",
    )


def _parse_whoami(info: Any) -> HfIdentity:
    """Read the fields we trust from whoami-v2: type, name, orgs[].name, auth.accessToken.role."""
    if not isinstance(info, dict):
        raise AuthRejected(503, "identity_unavailable", "Hugging Face answered with something unexpected")
    if info.get("type") != "user":
        raise AuthRejected(
            403,
            "not_a_user_token",
            "the token belongs to an organization or app, not a user",
            "Use a personal access token of your own account.",
        )
    username = info.get("name")
    if not isinstance(username, str) or not USERNAME_RE.fullmatch(username):
        raise AuthRejected(503, "identity_unavailable", "Hugging Face returned an unusable username")
    raw_orgs = info.get("orgs")
    orgs = (
        tuple(o["name"] for o in raw_orgs if isinstance(o, dict) and isinstance(o.get("name"), str))
        if isinstance(raw_orgs, list)
        else ()
    )
    auth = info.get("auth")
    token = auth.get("accessToken") if isinstance(auth, dict) else None
    role = token.get("role") if isinstance(token, dict) else ""
    return HfIdentity(username, orgs, role if isinstance(role, str) else "")
