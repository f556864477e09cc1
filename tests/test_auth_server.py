"""Identity, access passes and signed requests end to end: a real aiohttp server (the relay's error
middleware, ``auth_middleware`` and the login routes) in a thread, a real ``requests`` session, and
the local HF stand-in for ``whoami``.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pytest
import requests
from aiohttp import web

from relay_server.auth.access import LOGIN_ROUTE, LoginService, PassIssuer
from relay_server.auth.identity import AllowList, HfIdentityVerifier
from relay_server.auth.relay_key import RelayKey
from relay_server.auth.verify import (
    BODY_STREAM_KEY,
    IDENTITY_KEY,
    RequestVerifier,
    auth_middleware,
    sign_response_headers,
)
from relay_server.core.errors import ApiError
from relay_server.harness.hf_standin import HfStandin, StandinResponse
from relay_server.harness.process import wait_until
from relay_server.harness.thread import RelayThread
from tests.support.auth import RELAY_URL, SKEW, Env, signed_container
from toolkit.errors import (
    AuthError,
    ProtocolError,
)
from toolkit.signing import (
    AccessPass,
    AccessPassHolder,
    PeerKey,
    RelayKeyPins,
    SignedAuth,
)
from toolkit.wire.auth import (
    BODY_SHA256_HEADER,
    CONTAINER_TYPE,
    RELAY_SIGNATURE_HEADER,
    container_body_sha256,
)
from toolkit.wire.protocol import LoginRequest, LoginResponse
from toolkit.wire.tensor_container import AsyncContainerReader


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
        response = web.StreamResponse(
            headers={"X-Collab-Step": "7", "X-Collab-Sha256": hashlib.sha256(data).hexdigest()}
        )
        sign_response_headers(request, response, ["X-Collab-Step", "X-Collab-Sha256"])
        await response.prepare(request)
        await response.write(data)
        return response

    middleware = auth_middleware(
        verifier,
        {"/api/status", LOGIN_ROUTE},
        container_routes={("PUT", "/api/upload")},
        container_limit=lambda: 1 << 20,
    )  # the route, not the Content-Type, picks the hashing
    app = web.Application(middlewares=[error_middleware, middleware])
    for method, path, handler in [
        ("GET", "/api/status", status),
        ("POST", "/api/echo", echo),
        ("PUT", "/api/upload", upload),
        ("GET", "/api/params", params),
        *service.routes(),
    ]:
        app.router.add_route(method, path, handler)
    with RelayThread(app=app).start() as served:  # the relay's serve_app, on port 0
        yield Relay(served.url, used, banned)


def peer_session(url: str, token: str, peer: PeerKey | None = None, refresh_fraction: float = 0.5) -> requests.Session:
    """What RelayClient will do: log in once with the token, refresh with the signed route."""
    peer, pins, session = peer or PeerKey(), RelayKeyPins(), requests.Session()
    session.obtained = []  # type: ignore[attr-defined]  # the "previous" pass of each obtain call

    def obtain(previous: AccessPass | None) -> AccessPass:
        session.obtained.append(previous)  # type: ignore[attr-defined]
        if previous is None:
            body = LoginRequest(hf_token=token, peer_public_key=peer.public_b64).dumps()
            response = session.post(
                url + LOGIN_ROUTE, data=body, headers={"Content-Type": "application/json"}, timeout=10
            )
        else:
            response = session.post(
                url + "/api/auth/refresh", data=b"{}", headers={"Content-Type": "application/json"}, timeout=10
            )
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
        answer = session.post(
            r.url + "/api/echo", data=b'{"x":1}', headers={"Content-Type": "application/json"}, timeout=10
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["identity"]["username"] == "alice" and RELAY_SIGNATURE_HEADER in answer.headers
        params = session.get(r.url + "/api/params", stream=True, timeout=10)  # signed headers, hook-verified
        assert hashlib.sha256(params.raw.read()).hexdigest() == params.headers["X-Collab-Sha256"]
        refreshed = session.post(
            r.url + "/api/auth/refresh", data=b"{}", headers={"Content-Type": "application/json"}, timeout=10
        )
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
        return iter([self.payload[i : i + 5000] for i in range(0, len(self.payload), 5000)])


def test_signed_streamed_upload_and_tampered_chunk_through_server(hf_standin: HfStandin) -> None:
    hf_standin.add_user("hf_alice_token_1234", "alice")
    values = np.ones(3 * 1024, dtype=np.float32)
    tensors, metadata, body = signed_container(values, 4096)
    body_hash = container_body_sha256(tensors, metadata)
    with relay(hf_standin, AllowList(users=frozenset({"alice"}))) as r:
        session = peer_session(r.url, "hf_alice_token_1234")

        def put(payload: bytes) -> requests.Response:
            return session.put(
                r.url + "/api/upload",
                data=SizedChunks(payload),
                timeout=10,
                headers={"Content-Type": CONTAINER_TYPE, BODY_SHA256_HEADER: body_hash},
            )

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
    r = requests.Request(
        "PUT", RELAY_URL + "/api/upload", data=iter([b"x"]), headers={"Content-Type": CONTAINER_TYPE}
    ).prepare()
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
