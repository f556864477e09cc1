"""Identity, access passes, signed requests and signed responses: one named test per attack.

Verifier-level tests build real ``requests`` prepared requests signed by the peer's
``SignedAuth`` and feed them to the relay's ``RequestVerifier`` under a fake clock. End-to-end
tests run a real aiohttp server (the relay's error middleware + ``auth_middleware`` + the login
routes) in a thread, a real ``requests`` session, and the local HF stand-in for ``whoami``.
"""

from __future__ import annotations

import dataclasses

import asyncio
import hashlib
import json
import logging
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import pytest
import requests
from aiohttp import web
from cryptography.exceptions import InvalidSignature
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay_server.auth.access import LOGIN_ROUTE, LoginService, PassIssuer
from relay_server.auth.verify import (
    BODY_STREAM_KEY,
    IDENTITY_KEY,
    AuthRejected,
    ChunkDigests,
    NonceCache,
    RequestVerifier,
    VerifiedBodyStream,
    auth_middleware,
    container_digests,
    read_container_head,
    sign_response,
    sign_response_headers,
)
from relay_server.core.errors import ApiError
from relay_server.auth.identity import AllowList, HfIdentityVerifier
from relay_server.auth.relay_key import KEY_FILE, RelayKey
from tests.conftest import Clock, wait_until
from tests.hf_standin import HfStandin, StandinResponse
from tests.support.relays import InProcessRelay
from toolkit.wire.auth import (
    BODY_SHA256_HEADER,
    CONTAINER_TYPE,
    NONCE_HEADER,
    PASS_HEADER,
    RELAY_SIGNATURE_HEADER,
    PassClaims,
    b64u,
    container_body_sha256,
    decode_pass,
    digest_metadata,
    unb64u,
    verify_pass,
    verify_relay_signature,
)
from toolkit.errors import (
    AuthError,
    ProtocolError,
    RelayKeyChanged,
    RelayKeyError,
    RelaySignatureInvalid,
)
from toolkit.wire.protocol import LoginRequest, LoginResponse
from toolkit.signing import (
    AccessPass,
    AccessPassHolder,
    PeerKey,
    RelayKeyPins,
    SignedAuth,
)
from toolkit.wire.tensor_container import AsyncContainerReader, encode_header, iter_encoded

RELAY_URL = "http://relay.test"
SKEW = 60.0


def pass_for(response: LoginResponse, peer: PeerKey, url: str = RELAY_URL) -> AccessPass:
    return AccessPass.from_login(response, peer_key=peer, relay_url=url, pins=RelayKeyPins())


def raw_pass(token: str, relay_key: RelayKey, lifetime_s: float = 600) -> AccessPass:
    """An AccessPass around any token (forgeries included), skipping the peer's own checks."""
    claims, _, _ = decode_pass(token)
    return AccessPass(token=token, claims=claims, relay_public=relay_key.public, clock_offset_s=0.0,
                      received_mono=time.monotonic(), lifetime_s=lifetime_s)


@dataclass
class Env:
    """A relay verifier and an honest peer 'alice', sharing one fake wall clock."""

    clock: Clock = field(default_factory=lambda: Clock(float(int(time.time()))))
    relay_key: RelayKey = field(default_factory=RelayKey.generate)
    peer: PeerKey = field(default_factory=PeerKey)
    banned: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.verifier = RequestVerifier(self.relay_key, max_skew_s=SKEW, is_banned=self.banned.__contains__,
                                        clock=self.clock)
        self.issuer = PassIssuer(self.relay_key, ttl_s=600, clock=self.clock)
        self.access = pass_for(self.issuer.issue("alice", self.peer.public_raw), self.peer)
        self.access = AccessPass(token=self.access.token, claims=self.access.claims,
                                 relay_public=self.access.relay_public, clock_offset_s=0.0,
                                 received_mono=self.access.received_mono, lifetime_s=self.access.lifetime_s)
        self.auth = self.auth_with(self.access)

    def auth_with(self, access: AccessPass, peer: PeerKey | None = None, clock=None) -> SignedAuth:
        return SignedAuth(peer or self.peer, AccessPassHolder(lambda previous: access), clock=clock or self.clock)

    def signed(self, method: str = "POST", path: str = "/api/peers/p1/heartbeat", body: bytes | None = b'{"a":1}',
               auth: SignedAuth | None = None, content_type: str = "application/json") -> requests.PreparedRequest:
        headers = {"Content-Type": content_type} if body is not None else {}
        prepared = requests.Request(method, RELAY_URL + path, data=body, headers=headers).prepare()
        return (auth or self.auth)(prepared)

    def verify(self, r: requests.PreparedRequest) -> PassClaims:
        return self.verifier.verify(method=r.method, path_qs=r.path_url, headers=r.headers, body=r.body or b"")

    def rejected(self, r: requests.PreparedRequest) -> AuthRejected:
        with pytest.raises(AuthRejected) as info:
            self.verify(r)
        return info.value


@pytest.fixture
def env() -> Env:
    return Env()


# --- verifier level: one test per attack ----------------------------------------------------------
def test_valid_signed_request_is_accepted(env: Env) -> None:
    claims = env.verify(env.signed())
    assert claims.username == "alice" and claims.peer_key == env.peer.public_raw
    assert env.verify(env.signed("GET", "/api/params?min_step=3&wait=0", body=None)).username == "alice"


def test_missing_auth_headers_rejected(env: Env) -> None:
    r = env.signed()
    del r.headers[NONCE_HEADER]
    error = env.rejected(r)
    assert (error.status, error.code) == (401, "missing_auth") and error.hint


def test_malformed_pass_rejected(env: Env) -> None:
    for bad in ["x", "!!!!", b64u(b"\x01" * 10), b64u(b"\x02" + b"\0" * 200), "A" * 600]:
        r = env.signed()
        r.headers[PASS_HEADER] = bad
        error = env.rejected(r)
        assert (error.status, error.code) == (401, "malformed_pass"), bad


def test_forged_pass_rejected(env: Env) -> None:
    """An attacker signs a pass claiming this relay's key id with a key of its own."""
    attacker = RelayKey.generate()
    claims = PassClaims(env.relay_key.key_id, int(env.clock()), int(env.clock()) + 600, int(env.clock()),
                        env.peer.public_raw, "alice")
    body = claims.encode_claims()
    forged = b64u(body + attacker.sign(PassClaims.signed_message(body)))
    error = env.rejected(env.signed(auth=env.auth_with(raw_pass(forged, env.relay_key))))
    assert (error.status, error.code) == (401, "forged_pass")


def test_tampered_pass_rejected(env: Env) -> None:
    """A genuine pass with its username edited ("alice" -> "admin") no longer verifies."""
    claims, body, signature = decode_pass(env.access.token)
    edited = b64u(body.replace(b"alice", b"admin") + signature)
    error = env.rejected(env.signed(auth=env.auth_with(raw_pass(edited, env.relay_key))))
    assert (error.status, error.code) == (401, "forged_pass")


def test_expired_pass_rejected(env: Env) -> None:
    r = env.signed()
    env.verify(r)
    env.clock.now += 601  # the request timestamps follow the clock: only the pass is too old
    error = env.rejected(env.signed())
    assert (error.status, error.code) == (401, "pass_expired")


def test_pass_from_another_relay_rejected(env: Env) -> None:
    other = PassIssuer(RelayKey.generate(), ttl_s=600, clock=env.clock).issue("alice", env.peer.public_raw)
    error = env.rejected(env.signed(auth=env.auth_with(pass_for(other, env.peer))))
    assert (error.status, error.code) == (401, "pass_wrong_relay")


def test_stolen_pass_with_another_key_rejected(env: Env) -> None:
    """Mallory replays alice's pass but can only sign with her own key."""
    error = env.rejected(env.signed(auth=env.auth_with(env.access, peer=PeerKey())))
    assert (error.status, error.code) == (401, "bad_signature")


def test_tampered_body_rejected(env: Env) -> None:
    r = env.signed(body=b'{"samples":32}')
    r.body = b'{"samples":3200}'
    error = env.rejected(r)
    assert (error.status, error.code) == (401, "body_mismatch")
    r.headers[BODY_SHA256_HEADER] = hashlib.sha256(r.body).hexdigest()  # and fix the claimed hash too
    error = env.rejected(r)
    assert (error.status, error.code) == (401, "bad_signature")


def test_tampered_path_method_or_content_type_rejected(env: Env) -> None:
    r = env.signed(path="/api/peers/p1/heartbeat")
    for attack in ("path", "method", "content_type"):
        forged = r.copy()
        if attack == "path":
            forged.prepare_url(RELAY_URL + "/api/peers/p2/heartbeat", None)
        elif attack == "method":
            forged.method = "PUT"
        else:
            forged.headers["Content-Type"] = CONTAINER_TYPE
        error = env.rejected(forged)
        assert (error.status, error.code) == (401, "bad_signature"), attack


def test_replayed_nonce_rejected(env: Env) -> None:
    r = env.signed()
    env.verify(r)
    error = env.rejected(r)
    assert (error.status, error.code) == (401, "replayed_nonce")
    env.clock.now += 2 * SKEW + 1  # once the nonce is forgotten, the timestamp is stale: never accepted
    assert env.rejected(r).code == "stale_timestamp"


def test_replay_after_relay_restart_rejected(env: Env) -> None:
    """A restart empties the nonce cache; requests signed before it are refused anyway."""
    r = env.signed()
    env.verify(r)
    env.clock.now += 5
    restarted = RequestVerifier(env.relay_key, max_skew_s=SKEW, clock=env.clock)
    with pytest.raises(AuthRejected) as info:
        restarted.verify(method=r.method, path_qs=r.path_url, headers=r.headers, body=r.body)
    assert info.value.code == "stale_timestamp"
    fresh = env.signed()
    assert restarted.verify(method=fresh.method, path_qs=fresh.path_url, headers=fresh.headers, body=fresh.body)


def test_stale_timestamp_rejected(env: Env) -> None:
    env.clock.now += 2 * SKEW  # the relay has been up a while: "55 s ago" is after its start
    for offset in (-SKEW - 5, SKEW + 5):
        late = env.auth_with(env.access, clock=lambda: env.clock() + offset)
        error = env.rejected(env.signed(auth=late))
        assert (error.status, error.code) == (401, "stale_timestamp")
    within = env.auth_with(env.access, clock=lambda: env.clock() - SKEW + 5)
    env.verify(env.signed(auth=within))


def test_banned_user_rejected(env: Env) -> None:
    env.verify(env.signed())
    env.banned.add("alice")  # a ban applies at once, to passes already issued
    error = env.rejected(env.signed())
    assert (error.status, error.code) == (403, "user_banned")


def test_nonce_cache_is_bounded_and_expires() -> None:
    cache = NonceCache(10.0, max_entries=3, max_per_user=2)
    cache.add("a", "alice", 0.0)
    cache.add("b", "alice", 1.0)
    with pytest.raises(AuthRejected) as info:
        cache.add("c", "alice", 2.0)
    assert info.value.status == 429
    cache.add("c", "bob", 2.0)
    with pytest.raises(AuthRejected) as info:
        cache.add("d", "carol", 3.0)
    assert (info.value.status, info.value.code) == (503, "nonce_cache_full")
    cache.add("d", "carol", 10.5)  # "a" expired at 10.0, freeing one slot
    assert len(cache) == 3
    with pytest.raises(AuthRejected):
        cache.add("b", "alice", 10.6)  # "b" is remembered until 11.0


# --- streamed bodies: container header hash + chunk digests ---------------------------------------
def _container(values: np.ndarray, chunk_bytes: int) -> tuple[list, dict[str, str], bytes]:
    tensors = [("grad", values)]
    metadata = {"collab": "{}", **digest_metadata(tensors, chunk_bytes)}
    return tensors, metadata, b"".join(bytes(p) for p in iter_encoded(tensors, metadata))


async def _read_verified(body: bytes, chunk_elems: int, used: list[np.ndarray]) -> None:
    stream = asyncio.StreamReader()
    stream.feed_data(body)
    stream.feed_eof()
    head = await read_container_head(stream)
    reader = AsyncContainerReader(VerifiedBodyStream(stream, head, container_digests(head)), 1 << 30)
    header = await reader.read_header()
    async for _, chunk in reader.iter_chunks(header.entry("grad"), chunk_elems):
        used.append(chunk.copy())


@pytest.mark.parametrize("chunk_elems", [1024, 700])  # aligned with the digests, and not
def test_chunk_digests_accept_an_intact_upload(chunk_elems: int) -> None:
    values = np.arange(3 * 1024 + 5, dtype=np.float32)
    tensors, metadata, body = _container(values, 4096)
    assert container_body_sha256(tensors, metadata) == hashlib.sha256(encode_header(tensors, metadata)).hexdigest()
    used: list[np.ndarray] = []
    asyncio.run(_read_verified(body, chunk_elems, used))
    np.testing.assert_array_equal(np.concatenate(used), values)


def test_bad_chunk_digest_detected_before_use() -> None:
    values = np.ones(3 * 1024, dtype=np.float32)
    _, _, body = _container(values, 4096)
    tampered = bytearray(body)
    tampered[len(body) - 2 * 4096 + 10] ^= 0xFF  # one byte in data chunk 1 (of 0, 1, 2)
    used: list[np.ndarray] = []
    with pytest.raises(AuthRejected) as info:
        asyncio.run(_read_verified(bytes(tampered), 1024, used))
    assert (info.value.status, info.value.code) == (401, "chunk_digest_mismatch")
    assert len(used) == 1 and np.all(used[0] == 1.0)  # chunk 0 was used; the bad chunk 1 never was


def test_chunk_digest_metadata_is_validated() -> None:
    sizes = [3 * 4096]
    good = digest_metadata([("grad", np.zeros(3 * 1024, np.float32))], 4096)
    ChunkDigests(sizes, good)
    for metadata, code in [({}, "missing_chunk_digests"),
                           ({**good, "collab_chunk_bytes": str(1 << 30)}, "bad_chunk_digests"),
                           ({**good, "collab_chunk_bytes": "12"}, "bad_chunk_digests"),
                           ({**good, "collab_chunk_sha256": good["collab_chunk_sha256"][:-43]}, "bad_chunk_digests"),
                           ({**good, "collab_chunk_sha256": "%%"}, "bad_chunk_digests")]:
        with pytest.raises(AuthRejected) as info:
            ChunkDigests(sizes, metadata)
        assert info.value.code == code


# --- relay key, responses, pins, pass holder ----------------------------------------------------
def test_relay_key_created_0600_and_reloaded(tmp_path) -> None:
    first = RelayKey.load_or_create(tmp_path / "data")
    path = tmp_path / "data" / KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert RelayKey.load_or_create(tmp_path / "data").key_id == first.key_id
    assert "PRIVATE" not in repr(first) and first.key_id in repr(first)
    path.write_bytes(b"not a key")
    with pytest.raises(RelayKeyError):
        RelayKey.load_or_create(tmp_path / "data")


def test_relay_signature_binds_body_and_nonce() -> None:
    key = RelayKey.generate()
    header = sign_response(key, b'{"step":3}', request_nonce="n" * 22)
    verify_relay_signature(key.public, header, request_nonce="n" * 22, body=b'{"step":3}')
    for kwargs in [dict(request_nonce="n" * 22, body=b'{"step":4}'),      # altered answer
                   dict(request_nonce="m" * 22, body=b'{"step":3}')]:     # replayed for another request
        with pytest.raises(RelaySignatureInvalid):
            verify_relay_signature(key.public, header, **kwargs)
    with pytest.raises(RelaySignatureInvalid):
        verify_relay_signature(RelayKey.generate().public, header, request_nonce="n" * 22, body=b'{"step":3}')
    with pytest.raises(RelaySignatureInvalid):
        verify_relay_signature(key.public, None, request_nonce="n" * 22, body=b"")


def test_relay_key_pin_detects_a_changed_key(tmp_path) -> None:
    a, b = RelayKey.generate(), RelayKey.generate()
    pins = RelayKeyPins(tmp_path / "pins.json")
    pins.check(RELAY_URL, a.public_b64)
    pins.check(RELAY_URL + "/", a.public_b64)
    with pytest.raises(RelayKeyChanged):
        RelayKeyPins(tmp_path / "pins.json").check(RELAY_URL, b.public_b64)  # survives a restart
    with pytest.raises(RelayKeyChanged):
        RelayKeyPins(expected={"http://other.test": a.key_id}).check("http://other.test", b.public_b64)


def test_access_pass_holder_refreshes_before_expiry(env: Env) -> None:
    mono = Clock(1000.0)
    calls: list[AccessPass | None] = []
    issued: list[AccessPass] = []
    failing = {"now": False}

    def obtain(previous: AccessPass | None) -> AccessPass:
        calls.append(previous)
        if failing["now"]:
            raise ConnectionError("relay restarting")
        # A pass's expiry counts from its receipt on the holder's clock (not the machine's uptime).
        issued.append(dataclasses.replace(env.access, received_mono=mono.now))  # lifetime 600 s
        return issued[-1]

    holder = AccessPassHolder(obtain, refresh_fraction=0.5, retry_s=5, clock=mono)
    holder.current()
    mono.now += 299
    holder.current()
    assert len(calls) == 1
    mono.now += 2  # past half-life: refresh, handing the previous pass to the callback
    assert holder.current() is issued[1]
    assert calls[-1] is issued[0] and len(calls) == 2
    failing["now"] = True
    mono.now += 301
    assert holder.current() is issued[1]  # still valid: keep going, retry later
    assert len(calls) == 3
    holder.current()
    assert len(calls) == 3  # retry_s not yet elapsed


# --- end to end: real server, real requests, HF stand-in ---------------------------------------------


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """The relay's error rendering (relay_server.api.app.error_middleware, which imports torch)."""
    try:
        return await handler(request)
    except ApiError as exc:
        return web.json_response({"error": exc.code, "message": exc.message, "hint": exc.hint}, status=exc.status)
    except ProtocolError as exc:
        return web.json_response({"error": exc.code, "message": exc.message, "hint": exc.hint}, status=400)


@dataclass
class Relay:
    url: str
    used_chunks: list[np.ndarray]
    banned: set[str]


@contextmanager
def relay(hub: HfStandin, allow: AllowList, **identity_kwargs) -> Iterator[Relay]:
    key, banned, used = RelayKey.generate(), set(), []
    verifier = RequestVerifier(key, max_skew_s=SKEW, is_banned=banned.__contains__)
    identity = HfIdentityVerifier(allow, endpoint=hub.url, **identity_kwargs)
    service = LoginService(identity, PassIssuer(key, ttl_s=600), is_banned=banned.__contains__)

    async def status(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"identity": request[IDENTITY_KEY], "body": (await request.read()).decode()})

    async def upload(request: web.Request) -> web.Response:
        reader = AsyncContainerReader(request.get(BODY_STREAM_KEY, request.content), 1 << 24)
        header = await reader.read_header()
        async for _, chunk in reader.iter_chunks(header.entry("grad"), 1024):
            used.append(chunk.copy())
        return web.json_response({"chunks": len(used)})

    async def params(request: web.Request) -> web.StreamResponse:
        data = np.arange(8, dtype=np.float32).tobytes()
        response = web.StreamResponse(headers={"X-Collab-Step": "7", "X-Collab-Sha256": hashlib.sha256(data).hexdigest()})
        sign_response_headers(request, response, ["X-Collab-Step", "X-Collab-Sha256"])
        await response.prepare(request)
        await response.write(data)
        return response

    middleware = auth_middleware(verifier, {"/api/status", LOGIN_ROUTE}, container_routes={("PUT", "/api/upload")},
                                 container_limit=lambda: 1 << 20)  # the route, not the Content-Type, picks the hashing
    app = web.Application(middlewares=[error_middleware, middleware])
    for method, path, handler in [("GET", "/api/status", status), ("POST", "/api/echo", echo),
                                  ("PUT", "/api/upload", upload), ("GET", "/api/params", params),
                                  *service.routes()]:
        app.router.add_route(method, path, handler)
    with InProcessRelay(app=app) as served:  # the relay's serve_app, on port 0
        yield Relay(served.url, used, banned)


def peer_session(url: str, token: str, peer: PeerKey | None = None, refresh_fraction: float = 0.5) -> requests.Session:
    """What RelayClient will do: log in once with the token, refresh with the signed route."""
    peer, pins, session = peer or PeerKey(), RelayKeyPins(), requests.Session()
    session.obtained = []  # type: ignore[attr-defined]  # the "previous" pass of each obtain call

    def obtain(previous: AccessPass | None) -> AccessPass:
        session.obtained.append(previous)  # type: ignore[attr-defined]
        if previous is None:
            body = LoginRequest(hf_token=token, peer_public_key=peer.public_b64).dumps()
            response = session.post(url + LOGIN_ROUTE, data=body, headers={"Content-Type": "application/json"}, timeout=10)
        else:
            response = session.post(url + "/api/auth/refresh", data=b"{}", headers={"Content-Type": "application/json"},
                                    timeout=10)
        if response.status_code != 200:
            raise RuntimeError(response.json()["error"])
        return AccessPass.from_login(LoginResponse.from_json(response.json()), peer_key=peer, relay_url=url, pins=pins)

    session.auth = SignedAuth(peer, AccessPassHolder(obtain, refresh_fraction=refresh_fraction))
    return session


def login_error(url: str, token: str) -> tuple[int, dict]:
    body = LoginRequest(hf_token=token, peer_public_key=PeerKey().public_b64).dumps()
    response = requests.post(url + LOGIN_ROUTE, data=body, timeout=10)
    return response.status_code, response.json()


def test_login_flow_end_to_end(hf_standin: HfStandin) -> None:
    hf_standin.add_user("hf_alice_token_1234", "alice")
    with relay(hf_standin, AllowList(users=frozenset({"Alice"}))) as r:
        assert requests.get(r.url + "/api/status", timeout=10).json() == {"ok": True}  # public
        unsigned = requests.post(r.url + "/api/echo", data=b"{}", timeout=10)
        assert (unsigned.status_code, unsigned.json()["error"]) == (401, "missing_auth")
        session = peer_session(r.url, "hf_alice_token_1234")
        answer = session.post(r.url + "/api/echo", data=b'{"x":1}', headers={"Content-Type": "application/json"},
                              timeout=10)
        assert answer.status_code == 200, answer.text
        assert answer.json()["identity"]["username"] == "alice" and RELAY_SIGNATURE_HEADER in answer.headers
        params = session.get(r.url + "/api/params", stream=True, timeout=10)  # signed headers, hook-verified
        assert hashlib.sha256(params.raw.read()).hexdigest() == params.headers["X-Collab-Sha256"]
        refreshed = session.post(r.url + "/api/auth/refresh", data=b"{}",
                                 headers={"Content-Type": "application/json"}, timeout=10)
        assert refreshed.status_code == 200 and refreshed.json()["username"] == "alice"
        assert hf_standin.calls.count(("GET", "/api/whoami-v2", True)) == 1  # the token was used once


def test_holder_refreshes_through_the_signed_route(hf_standin: HfStandin) -> None:
    """The refresh request is signed with the pass it replaces; HF is not asked again."""
    hf_standin.add_user("hf_alice_token_1234", "alice")
    with relay(hf_standin, AllowList(users=frozenset({"alice"}))) as r:
        session = peer_session(r.url, "hf_alice_token_1234", refresh_fraction=1e-4)  # due after 60 ms
        assert session.post(r.url + "/api/echo", data=b"{}", timeout=10).status_code == 200
        time.sleep(0.1)
        assert session.post(r.url + "/api/echo", data=b"{}", timeout=10).status_code == 200
        login, refresh = session.obtained  # login (no previous pass), then one refresh (previous pass)
        assert login is None and refresh is not None and refresh.claims.username == "alice"
        assert hf_standin.calls.count(("GET", "/api/whoami-v2", True)) == 1


def test_replayed_request_rejected_by_server(hf_standin: HfStandin) -> None:
    hf_standin.add_user("hf_alice_token_1234", "alice")
    with relay(hf_standin, AllowList(users=frozenset({"alice"}))) as r:
        session = peer_session(r.url, "hf_alice_token_1234")
        first = session.post(r.url + "/api/echo", data=b"{}", timeout=10)
        assert first.status_code == 200
        replay = requests.post(r.url + "/api/echo", data=b"{}", headers=dict(first.request.headers), timeout=10)
        assert (replay.status_code, replay.json()["error"]) == (401, "replayed_nonce")
        assert session.post(r.url + "/api/echo", data=b"{}", timeout=10).status_code == 200  # still serving


class SizedChunks:
    """An iterable body with a length, like toolkit.transfer.SizedBody (hashing it would consume it)."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def __len__(self) -> int:
        return len(self.payload)

    def __iter__(self) -> Iterator[bytes]:
        return iter([self.payload[i:i + 5000] for i in range(0, len(self.payload), 5000)])


def test_signed_streamed_upload_and_tampered_chunk_through_server(hf_standin: HfStandin) -> None:
    hf_standin.add_user("hf_alice_token_1234", "alice")
    values = np.ones(3 * 1024, dtype=np.float32)
    tensors, metadata, body = _container(values, 4096)
    body_hash = container_body_sha256(tensors, metadata)
    with relay(hf_standin, AllowList(users=frozenset({"alice"}))) as r:
        session = peer_session(r.url, "hf_alice_token_1234")

        def put(payload: bytes) -> requests.Response:
            return session.put(r.url + "/api/upload", data=SizedChunks(payload), timeout=10,
                               headers={"Content-Type": CONTAINER_TYPE, BODY_SHA256_HEADER: body_hash})

        ok = put(body)
        assert ok.status_code == 200, ok.text
        assert len(r.used_chunks) == 3
        r.used_chunks.clear()
        tampered = bytearray(body)
        tampered[-4096 - 1] ^= 0xFF  # last byte of data chunk 1
        bad = put(bytes(tampered))
        assert (bad.status_code, bad.json()["error"]) == (401, "chunk_digest_mismatch")
        assert len(r.used_chunks) == 1  # chunk 0 only: the altered chunk never reached the handler


def test_streamed_body_without_hash_is_not_signed() -> None:
    env = Env()
    r = requests.Request("PUT", RELAY_URL + "/api/upload", data=iter([b"x"]),
                         headers={"Content-Type": CONTAINER_TYPE}).prepare()
    with pytest.raises(AuthError):
        env.auth(r)


def test_org_member_allowed(hf_standin: HfStandin) -> None:
    hf_standin.add_user("hf_bob_token_12345", "bob", orgs=("other", "Collab-Org"))
    with relay(hf_standin, AllowList(orgs=frozenset({"collab-org"}))) as r:
        session = peer_session(r.url, "hf_bob_token_12345")
        assert session.post(r.url + "/api/echo", data=b"{}", timeout=10).json()["identity"]["username"] == "bob"


def test_non_allowlisted_user_login_refused(hf_standin: HfStandin) -> None:
    hf_standin.add_user("hf_carol_token_123", "carol", orgs=("other",))
    with relay(hf_standin, AllowList(users=frozenset({"alice"}), orgs=frozenset({"collab-org"}))) as r:
        status, body = login_error(r.url, "hf_carol_token_123")
    assert (status, body["error"]) == (403, "not_allowlisted") and "carol" in body["message"] and body["hint"]


def test_invalid_token_login_refused(hf_standin: HfStandin) -> None:
    with relay(hf_standin, AllowList(any_user=True)) as r:
        assert login_error(r.url, "hf_not_a_real_token")[1]["error"] == "invalid_hf_token"
        assert login_error(r.url, "short")[1]["error"] == "invalid_hf_token"  # refused before calling HF


def test_org_token_and_banned_user_login_refused(hf_standin: HfStandin) -> None:
    hf_standin.add_user("hf_org_token_12345", "collab-org", kind="org")
    hf_standin.add_user("hf_dave_token_1234", "dave")
    with relay(hf_standin, AllowList(any_user=True)) as r:
        status, body = login_error(r.url, "hf_org_token_12345")
        assert (status, body["error"]) == (403, "not_a_user_token")
        r.banned.add("dave")
        status, body = login_error(r.url, "hf_dave_token_1234")
        assert (status, body["error"]) == (403, "user_banned")


def test_identity_provider_failures_are_503_with_hints(hf_standin: HfStandin, monkeypatch) -> None:
    import huggingface_hub.constants as constants

    hf_standin.add_user("hf_alice_token_1234", "alice")
    with relay(hf_standin, AllowList(any_user=True), timeout_s=0.5) as r:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        status, body = login_error(r.url, "hf_alice_token_1234")
        assert (status, body["error"]) == (503, "identity_unavailable") and "HF_HUB_OFFLINE" in body["hint"]
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        answered, released = threading.Event(), []

        def stuck(request) -> StandinResponse:  # answers only once the relay has answered the peer
            released.append(answered.wait(60))
            return StandinResponse(200, {})

        hf_standin.add_route("GET", r"/api/whoami-v2", stuck)
        status, body = login_error(r.url, "hf_alice_token_1234")
        answered.set()
        assert (status, body["error"]) == (503, "identity_unavailable")
        wait_until(lambda: released, 60, "the stuck identity call to return")
        assert all(released), "the relay waited for the identity provider past its timeout"


def test_token_never_logged(hf_standin: HfStandin, caplog, capfd, tmp_path) -> None:
    good, bad = "hf_SECRETgoodTOKEN0001", "hf_SECRETbadTOKEN0002"
    hf_standin.add_user(good, "alice", role="write")
    caplog.set_level(logging.DEBUG)
    for name in ("huggingface_hub", "httpx2", "httpcore2", "urllib3", "aiohttp"):
        logging.getLogger(name).setLevel(logging.DEBUG)
    with relay(hf_standin, AllowList(users=frozenset({"alice"}))) as r:
        status, body = login_error(r.url, bad)
        assert status == 401
        session = peer_session(r.url, good)
        assert session.post(r.url + "/api/echo", data=b"{}", timeout=10).status_code == 200
        texts = [str(body), repr(LoginRequest(hf_token=good, peer_public_key="k"))]
    assert caplog.records, "logging was captured"
    texts += [caplog.text] + [r.getMessage() + str(r.exc_text or "") for r in caplog.records]
    texts += list(capfd.readouterr())
    for text in texts:
        assert "SECRET" not in text
    assert any("alice" in r.getMessage() for r in caplog.records)  # the logs do say who logged in


# --- cost and fuzzing ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_per_request_sign_and_verify_cost(env: Env, capsys) -> None:
    """Peer sign + relay verify of a small JSON request, timed (a benchmark: slow, off the default
    run, whose machines are shared). Run with -s to see the numbers."""
    n = 300
    requests_ = [requests.Request("POST", RELAY_URL + "/api/peers/p/heartbeat", data=b'{"samples":1}',
                                  headers={"Content-Type": "application/json"}).prepare() for _ in range(n)]
    t0 = time.perf_counter()
    for r in requests_:
        env.auth(r)
    t1 = time.perf_counter()
    for r in requests_:
        env.verify(r)
    t2 = time.perf_counter()
    sign_us, verify_us = (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6
    with capsys.disabled():
        print(f"\n[auth cost] sign {sign_us:.0f} us/request, verify {verify_us:.0f} us/request")
    assert sign_us + verify_us < 5000  # generous: a shared 2-core machine


_HEADER_TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=120)
_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"


def fuzz(strategy: st.SearchStrategy, examples: int = 1000, slow_examples: int = 20_000):
    """Two tests from one body: ``examples`` in the default run, ``slow_examples`` under -m slow."""
    def decorate(body):
        common = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
        fast = settings(max_examples=examples, **common)(given(strategy)(body))
        slow = pytest.mark.slow(settings(max_examples=slow_examples, **common)(given(strategy)(body)))
        return fast, slow
    return decorate


def _mutate(text: str, position: int, replacement: str | None) -> str:
    """Replace ``text`` (if ``replacement`` is given) or change one of its characters."""
    if replacement is not None:
        return replacement
    if not text:
        return "A"
    i = position % len(text)
    swapped = _B64[(_B64.find(text[i]) + 1 + position // len(text) % 60) % len(_B64)]
    return text[:i] + swapped + text[i + 1:]


_FUZZ_ENV = Env()
_BASE = _FUZZ_ENV.signed(path="/api/rounds/3/gradient?peer_id=p1", body=b'{"samples":32}')
_MUTABLE = ["pass", "timestamp", "nonce", "body_sha256", "signature", "body", "path", "method", "content_type"]
_HEADER_OF = {"pass": PASS_HEADER, "timestamp": "X-Collab-Timestamp", "nonce": NONCE_HEADER,
              "body_sha256": BODY_SHA256_HEADER, "signature": "X-Collab-Signature", "content_type": "Content-Type"}


def _mutated_request_rejected(case: tuple[str, int, str | None]) -> None:
    """Any change to any signed part of a valid request gets a typed 4xx, nothing else."""
    part, position, replacement = case
    headers, method, path, body = dict(_BASE.headers), _BASE.method, _BASE.path_url, _BASE.body
    if part in _HEADER_OF:
        headers[_HEADER_OF[part]] = _mutate(headers[_HEADER_OF[part]], position, replacement)
    elif part == "body":
        body = _mutate(body.decode(), position, replacement).encode()
    elif part == "path":
        path = _mutate(path, position, replacement)
    else:
        method = _mutate(method, position, replacement)
    if (headers, method, path, body) == (dict(_BASE.headers), _BASE.method, _BASE.path_url, _BASE.body):
        return  # the mutation happened to be a no-op
    with pytest.raises(AuthRejected) as info:
        _FUZZ_ENV.verifier.verify(method=method, path_qs=path, headers=headers, body=body)
    assert info.value.status in (401, 403)


test_fuzz_mutated_signed_request_rejected, test_fuzz_mutated_signed_request_rejected_slow = fuzz(
    st.tuples(st.sampled_from(_MUTABLE), st.integers(0, 100_000), st.one_of(st.none(), _HEADER_TEXT))
)(_mutated_request_rejected)


def _pass_decoder(case: tuple[int, bytes | str]) -> None:
    """Arbitrary or bit-flipped passes: only ValueError; a changed pass never verifies."""
    flip, raw = case
    original = unb64u(_FUZZ_ENV.access.token)
    if isinstance(raw, str):
        token = raw
    elif flip >= 0:
        mutated = bytearray(original)
        mutated[flip % len(mutated)] ^= 1 << (flip // len(mutated) % 8)
        token = b64u(bytes(mutated) + raw[:3])  # a flipped bit, sometimes trailing bytes too
    else:
        token = b64u(raw)
    try:
        decode_pass(token)
    except ValueError:
        return
    try:
        verify_pass(token, _FUZZ_ENV.relay_key.public)
    except InvalidSignature:
        return
    assert unb64u(token) == original, "a modified pass verified"


test_fuzz_pass_decoder, test_fuzz_pass_decoder_slow = fuzz(
    st.tuples(st.integers(-1, 10_000), st.one_of(st.binary(max_size=200), _HEADER_TEXT))
)(_pass_decoder)


def _chunk_metadata(case: tuple[str | None, str | None, list[int]]) -> None:
    chunk_bytes, chunk_digests, sizes = case
    metadata = {k: v for k, v in (("collab_chunk_bytes", chunk_bytes), ("collab_chunk_sha256", chunk_digests)) if v is not None}
    try:
        digests = ChunkDigests(sizes, metadata)
    except AuthRejected:
        return
    assert len(digests.digests) == len(digests.lengths) and sum(digests.lengths) == sum(sizes)


test_fuzz_chunk_digest_metadata, test_fuzz_chunk_digest_metadata_slow = fuzz(st.tuples(
    st.one_of(st.none(), st.integers(-1, 1 << 25).map(str), _HEADER_TEXT),
    st.one_of(st.none(), st.binary(max_size=160).map(b64u), _HEADER_TEXT),
    st.lists(st.integers(0, 1 << 16), max_size=4)))(_chunk_metadata)


def _login_decoder(raw: bytes) -> None:
    try:
        message = LoginRequest.loads(raw)
    except ProtocolError:
        return
    assert len(message.hf_token) <= 512 and len(message.peer_public_key) <= 64


_JSON_VALUE = st.one_of(st.none(), st.integers(), _HEADER_TEXT, st.integers(500, 600).map(lambda n: "t" * n))
test_fuzz_login_request_decoder, test_fuzz_login_request_decoder_slow = fuzz(st.one_of(
    st.binary(max_size=300),
    st.tuples(_JSON_VALUE, _JSON_VALUE, st.booleans()).map(
        lambda t: json.dumps({"hf_token": t[0], "peer_public_key": t[1], **({"x": 1} if t[2] else {})}).encode())))(
    _login_decoder)


def _relay_signature_header(header: str) -> None:
    with pytest.raises(RelaySignatureInvalid):
        verify_relay_signature(_FUZZ_ENV.relay_key.public, header, request_nonce="n" * 22, body=b"")


test_fuzz_relay_signature_header, test_fuzz_relay_signature_header_slow = fuzz(
    _HEADER_TEXT, examples=300, slow_examples=5000)(_relay_signature_header)
