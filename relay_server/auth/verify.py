"""Per-request authentication on the relay: verify pass + signature + freshness, sign answers.

Order of checks (cheap and stateless first; only a request that passed every signature check
may occupy nonce memory): headers well-formed -> pass decodes -> pass names our key -> pass
signature -> pass not expired -> user not banned -> timestamp within ``max_skew_s`` (and not
before this process started) -> body hash
matches -> request signature -> nonce unseen in the last ``2 * max_skew_s``.

A nonce only needs remembering for 2N: a request accepted at relay time t0 has a timestamp
within N of t0, so a replay is refused as stale after t0 + 2N anyway (DeDLOC I.5).

Streamed tensor uploads (``application/octet-stream``) are authenticated by the hash of their
container header, whose metadata lists a sha256 per data chunk; :class:`VerifiedBodyStream`
(:mod:`.streams`) then checks every chunk before handing any of its bytes to the reducer. Which
routes take such a body is the app's list (``container_routes``), never the client's Content-Type.

Open mode is simply not installing :func:`auth_middleware`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from relay_server.auth.rejections import _LOGIN_HINT, AuthRejected, _reject  # noqa: F401 (re-exported)
from relay_server.auth.relay_key import RelayKey
from relay_server.auth.streams import ChunkDigests, VerifiedBodyStream, container_digests, read_container_head  # noqa: F401
from relay_server.core.errors import ApiError
from relay_server.core.http import drain
from toolkit.errors import ProtocolError
from toolkit.wire.auth import (
    BODY_SHA256_HEADER,
    CONTAINER_TYPE,
    NONCE_HEADER,
    NONCE_RE,
    PASS_HEADER,
    RELAY_SIGNATURE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    PassClaims,
    b64u,
    covered_headers_payload,
    decode_pass,
    format_relay_signature,
    request_message,
    response_message,
    unb64u,
)
from toolkit.wire.tensor_container import MAX_HEADER

log = logging.getLogger(__name__)


def _request_key(name: str, tp: type) -> Any:
    """A typed request key where aiohttp has them (3.13+), the plain name before."""
    return web.RequestKey(name, tp) if hasattr(web, "RequestKey") else name


IDENTITY_KEY = _request_key("identity", dict)  # {"username", "peer_key"} of a verified request
PASS_KEY = _request_key("access_pass", PassClaims)
BODY_STREAM_KEY = _request_key("body_stream", object)  # use request.get(BODY_STREAM_KEY, request.content)
_NONCE = _request_key("auth_nonce", str)
_SIGNER = _request_key("auth_signer", RelayKey)
_HEX64 = re.compile(r"[0-9a-f]{64}")


class NonceCache:
    """Nonces seen in the last ``window_s``, in bounded memory.

    Full means refusing (503), never forgetting early: eviction would re-open a replay window.
    ``max_per_user`` keeps one user from filling it for everyone (429).
    """

    def __init__(self, window_s: float, *, max_entries: int = 200_000, max_per_user: int = 20_000) -> None:
        self.window_s, self.max_entries, self.max_per_user = window_s, max_entries, max_per_user
        self._expiry: dict[str, float] = {}
        self._order: deque[tuple[float, str, str]] = deque()
        self._per_user: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._expiry)

    def add(self, key: str, username: str, now: float) -> None:
        """Remember ``key`` or raise :class:`AuthRejected` if it was seen within the window."""
        self._purge(now)
        if key in self._expiry:
            raise _reject(
                401,
                "replayed_nonce",
                "this request's nonce was already used",
                "Every request needs a fresh nonce; a replayed request is refused.",
            )
        if self._per_user.get(username, 0) >= self.max_per_user:
            raise _reject(
                429,
                "too_many_requests",
                f"more than {self.max_per_user} signed requests in {self.window_s:.0f}s",
                "Slow down; the toolkit's defaults stay far below this.",
            )
        if len(self._expiry) >= self.max_entries:
            raise _reject(503, "nonce_cache_full", "the relay is at its request capacity", "Retry in a few seconds.")
        self._expiry[key] = now + self.window_s
        self._order.append((now + self.window_s, key, username))
        self._per_user[username] = self._per_user.get(username, 0) + 1

    def _purge(self, now: float) -> None:
        while self._order and self._order[0][0] <= now:
            _, key, username = self._order.popleft()
            del self._expiry[key]
            left = self._per_user[username] - 1
            if left:
                self._per_user[username] = left
            else:
                del self._per_user[username]


@dataclass(frozen=True)
class PendingAuth:
    """Header checks passed; the body hash, request signature and nonce remain."""

    claims: PassClaims
    peer_public: Ed25519PublicKey
    timestamp: str
    nonce: str
    body_sha256: str
    signature: bytes


class RequestVerifier:
    """Stateless checks plus the nonce cache. ``is_banned`` is asked on every request, so a ban
    takes effect at once, even for passes already issued."""

    def __init__(
        self,
        relay_key: RelayKey,
        *,
        max_skew_s: float = 60.0,
        is_banned: Callable[[str], bool] = lambda username: False,
        nonces: NonceCache | None = None,
        clock: Callable[[], float] = time.time,
        pass_cache_size: int = 4096,
    ) -> None:
        self.relay_key, self.max_skew_s, self.is_banned, self.clock = relay_key, max_skew_s, is_banned, clock
        self.nonces = nonces or NonceCache(2 * max_skew_s)
        # nonces live in memory: refusing timestamps from before this process started closes the
        # replay window a restart would open (a peer re-syncs its clock offset by logging in again)
        self.not_before = int(clock())
        self._passes: OrderedDict[str, tuple[PassClaims, Ed25519PublicKey]] = OrderedDict()
        self._pass_cache_size = pass_cache_size

    def check_headers(self, headers: Mapping[str, str]) -> PendingAuth:
        values = {}
        for name in (PASS_HEADER, TIMESTAMP_HEADER, NONCE_HEADER, BODY_SHA256_HEADER, SIGNATURE_HEADER):
            value = headers.get(name)
            if not value:
                raise _reject(
                    401,
                    "missing_auth",
                    f"this route needs a signed request (no {name} header)",
                    "Log in first: the toolkit signs requests once it holds an access pass.",
                )
            values[name] = value
        claims, peer_public = self._pass(values[PASS_HEADER])
        now = self.clock()
        if claims.expires_at <= now:
            raise _reject(401, "pass_expired", f"the access pass expired {now - claims.expires_at:.0f}s ago")
        if claims.issued_at > now + self.max_skew_s:
            raise _reject(401, "pass_not_yet_valid", "the access pass was issued in the future")
        if self.is_banned(claims.username):
            raise _reject(
                403,
                "user_banned",
                f"user {claims.username!r} is banned from this run",
                "Contact the organizer if you think this is a mistake.",
            )
        timestamp, nonce, body_sha256 = values[TIMESTAMP_HEADER], values[NONCE_HEADER], values[BODY_SHA256_HEADER]
        if not (timestamp.isascii() and timestamp.isdigit() and len(timestamp) <= 12):  # "\u00b2".isdigit()
            raise _reject(401, "malformed_auth", f"{TIMESTAMP_HEADER} must be unix seconds")
        skew = float(timestamp) - now
        if abs(skew) > self.max_skew_s or int(timestamp) < self.not_before:
            raise _reject(
                401,
                "stale_timestamp",
                f"request timestamp is {skew:+.0f}s off the relay's clock (limit {self.max_skew_s:.0f}s)",
                "Log in again: the toolkit re-syncs its clock offset at login.",
            )
        if not NONCE_RE.fullmatch(nonce) or not _HEX64.fullmatch(body_sha256):
            raise _reject(401, "malformed_auth", f"bad {NONCE_HEADER} or {BODY_SHA256_HEADER} header")
        try:
            signature = unb64u(values[SIGNATURE_HEADER], SIGNATURE_HEADER)
        except ValueError as exc:
            raise _reject(401, "malformed_auth", str(exc)) from None
        return PendingAuth(claims, peer_public, timestamp, nonce, body_sha256, signature)

    def finish(
        self, pending: PendingAuth, *, method: str, path_qs: str, content_type: str, body_sha256: str
    ) -> PassClaims:
        if not hmac.compare_digest(body_sha256, pending.body_sha256):
            raise _reject(
                401,
                "body_mismatch",
                "the body does not match its signed hash",
                "Something between the peer and the relay altered the request (a proxy?).",
            )
        message = request_message(
            pending.claims.relay_key_id,
            method,
            path_qs,
            content_type,
            pending.timestamp,
            pending.nonce,
            pending.body_sha256,
        )
        try:
            pending.peer_public.verify(pending.signature, message)
        except InvalidSignature:
            raise _reject(
                401,
                "bad_signature",
                "the request signature does not verify with the pass's key",
                "A reverse proxy must forward method, path, query and Content-Type unchanged.",
            ) from None
        self.nonces.add(f"{b64u(pending.claims.peer_key)}:{pending.nonce}", pending.claims.username, self.clock())
        return pending.claims

    def verify(self, *, method: str, path_qs: str, headers: Mapping[str, str], body: bytes = b"") -> PassClaims:
        """All checks for an ordinary (fully read) body."""
        pending = self.check_headers(headers)
        return self.finish(
            pending,
            method=method,
            path_qs=path_qs,
            content_type=headers.get("Content-Type", ""),
            body_sha256=hashlib.sha256(body).hexdigest(),
        )

    def _pass(self, token: str) -> tuple[PassClaims, Ed25519PublicKey]:
        """Decode and verify a pass, caching by its exact string: one Ed25519 verify per request."""
        cached = self._passes.get(token)
        if cached is not None:
            self._passes.move_to_end(token)
            return cached
        try:
            claims, body, signature = decode_pass(token)
        except ValueError as exc:
            raise _reject(401, "malformed_pass", f"the access pass is malformed: {exc}") from None
        if claims.relay_key_id != self.relay_key.key_id:
            raise _reject(
                401,
                "pass_wrong_relay",
                f"the pass was issued by relay key {claims.relay_key_id}, this relay's key is {self.relay_key.key_id}",
                "Log in to this relay (passes are per relay and per relay key).",
            )
        try:
            self.relay_key.public.verify(signature, PassClaims.signed_message(body))
        except InvalidSignature:
            raise _reject(401, "forged_pass", "the access pass signature does not verify") from None
        entry = (claims, Ed25519PublicKey.from_public_bytes(claims.peer_key))
        self._passes[token] = entry
        if len(self._passes) > self._pass_cache_size:
            self._passes.popitem(last=False)
        return entry


# --- responses ----------------------------------------------------------------------------------
def sign_response(relay_key: RelayKey, payload: bytes, *, request_nonce: str, covers: str = "body") -> str:
    """The ``X-Collab-Relay-Signature`` value for ``payload`` (the body, or covered header bytes)."""
    signature = relay_key.sign(response_message(relay_key.key_id, request_nonce, covers, payload))
    return format_relay_signature(relay_key.key_id, covers, signature)


def sign_response_headers(request: web.Request, response: web.StreamResponse, names: Iterable[str]) -> None:
    """Sign the named headers of a streamed response (call before ``prepare``); e.g. the params
    download signs X-Collab-Step and X-Collab-Sha256 and the peer checks the bytes against the
    hash. A no-op in open mode (no middleware ran)."""
    relay_key, nonce = request.get(_SIGNER), request.get(_NONCE)
    if relay_key is None or nonce is None:
        return
    names = [n.lower() for n in names]
    covers = "headers:" + ",".join(names)
    response.headers[RELAY_SIGNATURE_HEADER] = sign_response(
        relay_key, covered_headers_payload(response.headers, names), request_nonce=nonce, covers=covers
    )


# --- middleware ---------------------------------------------------------------------------------
def auth_middleware(
    verifier: RequestVerifier,
    public_paths: Iterable[str],
    *,
    container_routes: Iterable[tuple[str, str]] = (),
    container_limit: Callable[[], int] = lambda: 0,
    binary_routes: Iterable[tuple[str, str]] = (),
    container_limits: Mapping[tuple[str, str], Callable[[], int]] | None = None,
) -> Middleware:
    """Require a signed request on every route except ``public_paths`` (where a request that
    carries a pass is still verified, so a logged-in peer gets signed answers everywhere).

    ``public_paths`` are route templates as registered (``"/api/status"``, ``"/static"``); the
    check uses the matched route, so no spelling of a URL can reach a protected handler as public.
    Unmatched URLs (404/405) pass through: no handler runs. On success the request carries
    ``request[IDENTITY_KEY]`` and 2xx ``web.Response`` answers are signed over their body.

    The signature covers exactly the bytes the handler acts on: ``container_routes`` (method,
    route template) take a streamed tensor container -- header hash, then a digest per chunk, at
    most ``container_limit()`` data bytes --, every other route a body hashed whole. The route,
    not the client's Content-Type, decides which: an octet-stream body on a JSON route used to be
    hashed by its first bytes only, leaving an unsigned JSON tail for the handler.
    ``binary_routes`` take a small tensor container (an expert call, at most the app's
    ``client_max_size``) as ``application/octet-stream``, hashed whole like a JSON body.
    ``container_limits`` adds container routes with a limit of their own (an expert's checkpoint
    is not the run's parameter vector)."""
    public = frozenset(public_paths)
    containers = frozenset(container_routes)
    binary = frozenset(binary_routes)
    limits = dict.fromkeys(containers, container_limit) | dict(container_limits or {})

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        if resource is None or (resource.canonical in public and PASS_HEADER not in request.headers):
            return await handler(request)  # public, and not signed: observers and not-yet-logged-in peers
        try:
            route = (request.method, resource.canonical)
            await _authenticate(
                verifier, request, route in limits, limits.get(route, container_limit), route in binary
            )
        except (ApiError, ProtocolError) as exc:
            log.info("refused %s %s: %s", request.method, request.path[:80], getattr(exc, "code", "error"))
            await drain(request)
            raise
        response = await handler(request)
        if (
            isinstance(response, web.Response)
            and not response.prepared
            and 200 <= response.status < 300
            and RELAY_SIGNATURE_HEADER not in response.headers
        ):
            body = response.body
            if body is None or isinstance(body, (bytes, bytearray)):
                response.headers[RELAY_SIGNATURE_HEADER] = sign_response(
                    verifier.relay_key, bytes(body or b""), request_nonce=request[_NONCE]
                )
        return response

    return middleware


async def _authenticate(
    verifier: RequestVerifier,
    request: web.Request,
    container: bool,
    container_limit: Callable[[], int],
    binary: bool = False,
) -> None:
    pending = verifier.check_headers(request.headers)
    content_type = request.headers.get("Content-Type", "")
    streamed = content_type.split(";")[0].strip().lower() == CONTAINER_TYPE
    if streamed != (container or binary):
        raise ApiError(
            415,
            "wrong_content_type",
            f"this route takes {CONTAINER_TYPE if container or binary else 'JSON'}, not {content_type[:60]!r}",
            "Send the body the toolkit sends for this route "
            "(tensors as application/octet-stream, everything else as application/json).",
        )
    if container:
        limit = container_limit()
        if request.content_length is not None and request.content_length > limit + MAX_HEADER + 8:
            raise ApiError(
                413,
                "body_too_large",
                f"a tensor upload is at most {limit + MAX_HEADER + 8} bytes",
                "Upload the run's parameters in its codec; the model or codec does not match the run's.",
            )
        head = await read_container_head(request.content)
        claims = verifier.finish(
            pending,
            method=request.method,
            path_qs=request.raw_path,
            content_type=content_type,
            body_sha256=hashlib.sha256(head).hexdigest(),
        )
        request[BODY_STREAM_KEY] = VerifiedBodyStream(request.content, head, container_digests(head, limit))
    else:
        body = await request.read()  # bounded by the app's client_max_size; handlers read these same bytes
        claims = verifier.finish(
            pending,
            method=request.method,
            path_qs=request.raw_path,
            content_type=content_type,
            body_sha256=hashlib.sha256(body).hexdigest(),
        )
    request[IDENTITY_KEY] = {"username": claims.username, "peer_key": b64u(claims.peer_key)}
    request[PASS_KEY] = claims
    request[_NONCE] = pending.nonce
    request[_SIGNER] = verifier.relay_key
