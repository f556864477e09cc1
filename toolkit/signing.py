"""The peer's half of authentication: its key, its access pass, and signing every request.

A peer logs in once with its Hugging Face token (``RelayClient.login``), gets an access pass
bound to a fresh in-memory Ed25519 key, and from then on :class:`SignedAuth` signs every request
and checks the relay's signature on the answers it relies on. The wire format is in
:mod:`toolkit.wire.auth`; the relay's half in :mod:`relay_server.auth.verify`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import requests
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from toolkit.errors import AuthError, RelayKeyChanged
from toolkit.wire.auth import (
    _HEX64_RE,
    BODY_SHA256_HEADER,
    EMPTY_SHA256,
    LOGIN_PATH,
    NONCE_HEADER,
    PASS_HEADER,
    RELAY_SIGNATURE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    PassClaims,
    b64u,
    key_id,
    public_key_from_b64,
    request_message,
    verify_pass,
    verify_relay_signature,
)
from toolkit.wire.protocol import LoginResponse

log = logging.getLogger(__name__)


# --- the peer's keys and pins -------------------------------------------------------------------
class PeerKey:
    """The peer's Ed25519 key pair: made fresh in memory per session (~50 us), never written."""

    def __init__(self, private: Ed25519PrivateKey | None = None) -> None:
        self._private = private or Ed25519PrivateKey.generate()
        self.public_raw = self._private.public_key().public_bytes_raw()
        self.public_b64 = b64u(self.public_raw)

    def sign(self, message: bytes) -> bytes:
        return self._private.sign(message)

    def __repr__(self) -> str:
        return f"PeerKey(public={self.public_b64[:8]}...)"


class RelayKeyPins:
    """Trust-on-first-use pins of relay public keys by relay URL.

    The first login to a URL pins the key it presents; a later different key raises
    :class:`RelayKeyChanged`. ``expected`` (URL -> key id) lets an organizer publish the key id in
    the notebook, which removes the first-use gap. ``path`` (JSON) makes pins survive restarts;
    without it pins last for the process (a re-run cell re-pins, which is still safe against a
    key swapped mid-session).
    """

    def __init__(self, path: str | Path | None = None, expected: Mapping[str, str] | None = None) -> None:
        self.path = Path(path) if path else None
        self.expected = {u.rstrip("/"): k for u, k in (expected or {}).items()}
        self._pins: dict[str, str] = {}
        if self.path and self.path.exists():
            try:
                self._pins = {str(k): str(v) for k, v in json.loads(self.path.read_text()).items()}
            except (OSError, ValueError, AttributeError):
                raise AuthError(
                    "bad_pin_file",
                    f"cannot read relay key pins from {self.path}",
                    "Delete the file to pin the relay's key again.",
                ) from None

    def check(self, relay_url: str, relay_public_b64: str) -> Ed25519PublicKey:
        url = relay_url.rstrip("/")
        try:
            public = public_key_from_b64(relay_public_b64, "relay public key")
        except ValueError as exc:
            raise AuthError("bad_relay_key", str(exc)) from None
        kid = key_id(public.public_bytes_raw())
        want = self.expected.get(url) or self._pins.get(url)
        if want is None:
            self._pins[url] = kid
            self._save()
            log.info("pinned relay key %s for %s", kid, url)
        elif want != kid:
            where = f" (pins: {self.path})" if self.path else ""
            raise RelayKeyChanged("relay_key_changed", f"relay {url} presents key {kid}, expected {want}{where}")
        return public

    def _save(self) -> None:
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self._pins, indent=1, sort_keys=True))
            os.replace(tmp, self.path)


# --- the peer's current pass --------------------------------------------------------------------
@dataclass(frozen=True)
class AccessPass:
    """A pass as the peer holds it, with local timings (monotonic, immune to clock jumps)."""

    token: str = field(repr=False)
    claims: PassClaims
    relay_public: Ed25519PublicKey = field(repr=False)
    clock_offset_s: float  # relay clock - local clock, applied to request timestamps
    received_mono: float
    lifetime_s: float  # expires_at - server_time, on the relay's clock

    @classmethod
    def from_login(
        cls, response: LoginResponse, *, peer_key: PeerKey, relay_url: str, pins: RelayKeyPins
    ) -> "AccessPass":
        """Check a login/refresh answer against the pinned relay key and our own public key."""
        relay_public = pins.check(relay_url, response.relay_public_key)
        try:
            claims = verify_pass(response.access_pass, relay_public)
        except (ValueError, InvalidSignature):
            raise AuthError("bad_pass", "the relay returned a pass that does not verify with its key") from None
        if claims.peer_key != peer_key.public_raw:
            raise AuthError("bad_pass", "the relay returned a pass for another peer key")
        for warning in response.warnings:
            log.warning("relay: %s", warning)
        return cls(
            token=response.access_pass,
            claims=claims,
            relay_public=relay_public,
            clock_offset_s=response.server_time - time.time(),
            received_mono=time.monotonic(),
            lifetime_s=max(0.0, claims.expires_at - response.server_time),
        )

    @property
    def expires_mono(self) -> float:
        return self.received_mono + self.lifetime_s


class AccessPassHolder:
    """Keeps a valid pass, calling ``obtain(previous)`` for a new one once ``refresh_fraction``
    of its lifetime has passed (``previous`` is None at first: log in with the token; otherwise
    the callback may use the relay's refresh route, which spares HF's rate-limited whoami).

    A failed refresh while the pass is still valid only logs and retries after ``retry_s``:
    a relay restart must not stop training. Thread-safe; a refresh request signed with the
    current pass (re-entering :meth:`current`) gets the current pass.
    """

    def __init__(
        self,
        obtain: Callable[[AccessPass | None], AccessPass],
        *,
        refresh_fraction: float = 0.5,
        retry_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < refresh_fraction < 1:
            raise ValueError("refresh_fraction must be in (0, 1)")
        self._obtain, self._fraction, self._retry_s, self._clock = obtain, refresh_fraction, retry_s, clock
        self._lock = threading.RLock()
        self._pass: AccessPass | None = None
        self._due = 0.0
        self._refreshing = False

    def current(self) -> AccessPass:
        with self._lock:
            now = self._clock()
            if self._refreshing:  # the refresh request itself is being signed
                if self._pass is None:
                    raise AuthError(
                        "no_pass",
                        "the first login must not be a signed request",
                        f"Send {LOGIN_PATH} without SignedAuth (it is skipped for that path).",
                    )
                return self._pass
            if self._pass is None or now >= self._due:
                self._refresh(now)
            assert self._pass is not None
            return self._pass

    def invalidate(self) -> None:
        """Force a new pass on next use (e.g. after the relay answered ``pass_expired``)."""
        with self._lock:
            self._due = 0.0

    def _refresh(self, now: float) -> None:
        self._refreshing = True
        try:
            new = self._obtain(self._pass)
        except Exception as exc:
            if self._pass is not None and now < self._pass.expires_mono - self._retry_s:
                log.warning("access pass refresh failed (%s); retrying in %.0fs", type(exc).__name__, self._retry_s)
                self._due = now + self._retry_s
                return
            raise
        finally:
            self._refreshing = False
        self._pass = new
        self._due = self._clock() + self._fraction * new.lifetime_s
        log.debug("access pass for %s valid for %.0fs", new.claims.username, new.lifetime_s)


class SignedAuth(requests.auth.AuthBase):
    """Signs every prepared request with the peer key and verifies the relay's signature on
    2xx answers (a hook raises :class:`RelaySignatureInvalid`).

    Bodies: bytes/str/None are hashed here. An iterable (streamed) body must come with the
    caller's precomputed ``X-Collab-Body-Sha256`` header (:func:`container_body_sha256`), because
    hashing it here would consume it. Requests to ``unsigned_paths`` (the login) pass untouched.
    ``verify_responses=False`` skips the response check (tests).
    """

    def __init__(
        self,
        peer_key: PeerKey,
        holder: AccessPassHolder,
        *,
        verify_responses: bool = True,
        unsigned_paths: Iterable[str] = (LOGIN_PATH,),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.peer_key, self.holder, self.verify_responses, self.clock = peer_key, holder, verify_responses, clock
        self.unsigned_paths = frozenset(unsigned_paths)

    def __call__(self, r: requests.PreparedRequest) -> requests.PreparedRequest:
        if r.path_url.split("?", 1)[0] in self.unsigned_paths:
            return r
        access = self.holder.current()
        body_sha256 = _body_sha256(r)
        timestamp = str(int(self.clock() + access.clock_offset_s))
        nonce = b64u(os.urandom(16))
        content_type = _header(r, "Content-Type")
        message = request_message(
            access.claims.relay_key_id, r.method or "GET", r.path_url, content_type, timestamp, nonce, body_sha256
        )
        r.headers[PASS_HEADER] = access.token
        r.headers[TIMESTAMP_HEADER] = timestamp
        r.headers[NONCE_HEADER] = nonce
        r.headers[BODY_SHA256_HEADER] = body_sha256
        r.headers[SIGNATURE_HEADER] = b64u(self.peer_key.sign(message))
        if self.verify_responses:
            r.register_hook("response", _ResponseCheck(access.relay_public, nonce))
        return r

    def __repr__(self) -> str:
        return f"SignedAuth({self.peer_key!r})"


class _ResponseCheck:
    """A response hook bound to one request's nonce."""

    def __init__(self, relay_public: Ed25519PublicKey, nonce: str) -> None:
        self.relay_public, self.nonce = relay_public, nonce

    def __call__(self, response: requests.Response, *args: object, **kwargs: object) -> requests.Response:
        if 200 <= response.status_code < 300:
            header = response.headers.get(RELAY_SIGNATURE_HEADER)
            body = response.content if header and ";covers=body;" in header else None
            verify_relay_signature(
                self.relay_public, header, request_nonce=self.nonce, body=body, headers=response.headers
            )
        return response


def _header(r: requests.PreparedRequest, name: str) -> str:
    """A request header as the relay will read it: requests sends a bytes value as it is, and
    aiohttp decodes it as UTF-8 with surrogateescape (so the signed message has the same bytes)."""
    value = r.headers.get(name, "")
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value


def _body_sha256(r: requests.PreparedRequest) -> str:
    body = r.body
    if body is None:
        return EMPTY_SHA256
    if isinstance(body, str):
        try:
            body = body.encode("ascii")
        except UnicodeEncodeError:
            raise AuthError(
                "unsignable_body", "a non-ASCII str body is ambiguous to sign", "Send bytes (e.g. schema.dumps())."
            ) from None
    if isinstance(body, (bytes, bytearray, memoryview)):
        return hashlib.sha256(body).hexdigest()
    claimed = _header(r, BODY_SHA256_HEADER)
    if not _HEX64_RE.fullmatch(claimed):
        raise AuthError(
            "unsignable_body",
            f"a streamed body needs its precomputed hash in the {BODY_SHA256_HEADER} header",
            "Use toolkit.wire.auth.container_body_sha256().",
        )
    return claimed
