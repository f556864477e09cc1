"""Access passes: issue one at login (HF token checked), renew it without the token (refresh).

Login (``POST /api/auth/login``, public): ``{hf_token, peer_public_key}`` -> the Hub confirms the
username, the allowlist and ban list admit it, and the relay signs a pass binding the username
to the peer's key for ``ttl_s``. Refresh (``POST /api/auth/refresh``, signed with a valid pass)
issues a new pass for the same key without the token, so a thousand peers do not call HF's
rate-limited whoami every hour; after ``reauth_after_s`` since the last HF check the peer must
log in with its token again (org membership and allowlist changes are seen then; bans at once).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from aiohttp import web
from aiohttp.typedefs import Handler

from relay_server.auth.identity import HfIdentityVerifier
from relay_server.auth.relay_key import RelayKey
from relay_server.auth.verify import PASS_KEY, AuthRejected
from toolkit.wire.auth import LOGIN_PATH, REFRESH_PATH, USERNAME_RE, PassClaims, b64u, unb64u
from toolkit.wire.protocol import LoginRequest, LoginResponse
from toolkit.wire.schema import Schema

log = logging.getLogger(__name__)

LOGIN_ROUTE = LOGIN_PATH  # public
REFRESH_ROUTE = REFRESH_PATH  # signed
_MAX_LOGIN_BODY = 4096
_WRITE_TOKEN_WARNING = (
    "your Hugging Face token can write to your account; this relay only needs a read "
    "token (or a fine-grained token with no permissions)"
)


class PassIssuer:
    """Signs passes with the relay key. ``ttl_s`` bounds how long a stolen pass+key is useful."""

    def __init__(self, relay_key: RelayKey, *, ttl_s: float = 3600.0, clock: Callable[[], float] = time.time) -> None:
        if ttl_s < 60:
            raise ValueError("auth.pass_ttl_s must be at least 60 seconds")
        self.relay_key, self.ttl_s, self.clock = relay_key, ttl_s, clock

    def issue(
        self, username: str, peer_key: bytes, *, auth_at: int | None = None, warnings: list[str] | None = None
    ) -> LoginResponse:
        if not USERNAME_RE.fullmatch(username) or len(peer_key) != 32:
            raise ValueError("cannot issue a pass for an invalid username or key")
        now = self.clock()
        claims = PassClaims(
            self.relay_key.key_id,
            int(now),
            int(now + self.ttl_s),
            int(now) if auth_at is None else auth_at,
            peer_key,
            username,
        )
        body = claims.encode_claims()
        token = b64u(body + self.relay_key.sign(PassClaims.signed_message(body)))
        return LoginResponse(
            access_pass=token,
            username=username,
            issued_at=claims.issued_at,
            expires_at=claims.expires_at,
            server_time=now,
            relay_public_key=self.relay_key.public_b64,
            relay_key_id=self.relay_key.key_id,
            warnings=list(warnings or []),
        )


class LoginService:
    """The login and refresh routes (handlers are bound methods: ``service.routes()``)."""

    def __init__(
        self,
        identity: HfIdentityVerifier,
        issuer: PassIssuer,
        *,
        is_banned: Callable[[str], bool] = lambda username: False,
        reauth_after_s: float = 86400.0,
    ) -> None:
        self.identity, self.issuer, self.is_banned, self.reauth_after_s = identity, issuer, is_banned, reauth_after_s

    async def login(self, request: LoginRequest) -> LoginResponse:
        try:
            peer_key = unb64u(request.peer_public_key, "peer_public_key")
        except ValueError:
            peer_key = b""
        if len(peer_key) != 32:
            raise AuthRejected(
                400,
                "bad_public_key",
                "peer_public_key must be a raw Ed25519 key (32 bytes, b64u)",
                "Upgrade the toolkit.",
            )
        identity = await self.identity.verify(request.hf_token)
        self._check_ban(identity.username)
        warnings = [_WRITE_TOKEN_WARNING] if identity.token_role == "write" else []
        response = self.issuer.issue(identity.username, peer_key, warnings=warnings)
        log.info("issued an access pass to %s (valid %.0fs)", identity.username, self.issuer.ttl_s)
        return response

    def refresh(self, claims: PassClaims) -> LoginResponse:
        self._check_ban(claims.username)
        if self.issuer.clock() - claims.auth_at > self.reauth_after_s:
            raise AuthRejected(
                401,
                "reauth_required",
                "the Hugging Face check behind this pass is too old",
                "Log in with your token again (the toolkit does this by itself).",
            )
        return self.issuer.issue(claims.username, claims.peer_key, auth_at=claims.auth_at)

    def _check_ban(self, username: str) -> None:
        if self.is_banned(username):
            log.info("login refused: %s is banned", username)
            raise AuthRejected(
                403,
                "user_banned",
                f"user {username!r} is banned from this run",
                "Contact the organizer if you think this is a mistake.",
            )

    async def handle_login(self, request: web.Request) -> web.Response:
        if request.content_length is not None and request.content_length > _MAX_LOGIN_BODY:
            raise AuthRejected(413, "body_too_large", f"a login body is at most {_MAX_LOGIN_BODY} bytes")
        message = LoginRequest.loads(await request.read())
        return _json(await self.login(message))

    async def handle_refresh(self, request: web.Request) -> web.Response:
        claims = request.get(PASS_KEY)
        if claims is None:  # the route was left public or auth is off: nothing to refresh
            raise AuthRejected(
                401,
                "missing_auth",
                "refresh needs a signed request with a valid pass",
                "Log in with your Hugging Face token instead.",
            )
        return _json(self.refresh(claims))

    def routes(self) -> list[tuple[str, str, Handler]]:
        """Route table entries; LOGIN_ROUTE must be public, REFRESH_ROUTE must not."""
        return [("POST", LOGIN_ROUTE, self.handle_login), ("POST", REFRESH_ROUTE, self.handle_refresh)]


def _json(message: Schema) -> web.Response:
    return web.json_response(message.to_json())
