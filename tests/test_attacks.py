"""One named test per attack, each through a REAL relay process in hf mode.

Every test asserts three things: the exact refusal (HTTP status and error code, with a message
and a hint), that the relay keeps serving (``GET /api/status`` answers 200), and that the
collaboration is unchanged. "Unchanged" means something because the module first opens a round
with a legitimate signed peer (alice, 10 samples reported, the round waiting for her upload).
The module's last test then finishes that round with alice's one valid upload and checks the
applied SGD step is exactly hers: nothing any attack sent entered the reduction.

One relay (and one local Hugging Face stand-in) serves the whole module, its poll limit lowered
so the flood test (which runs after the round closed) trips within a second.
"""

from __future__ import annotations

import hashlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
import requests

from relay_server.api.app import PUBLIC_ROUTES
from relay_server.api.moderation import TOKEN_FILE
from relay_server.auth.relay_key import RelayKey
from relay_server.harness.hf_standin import HfStandin
from relay_server.harness.process import RelayProcess
from tests.support.peers import FLOOD_LIMITS, SAMPLES, TOKENS, SignedPeer, hf_relay, raw_http, round_state, standin
from toolkit.client import RelayClient
from toolkit.errors import RelayRejected
from toolkit.signing import AccessPass, AccessPassHolder, PeerKey, SignedAuth
from toolkit.wire.auth import (
    BODY_SHA256_HEADER,
    CONTAINER_TYPE,
    NONCE_HEADER,
    PASS_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    PassClaims,
    b64u,
    decode_pass,
    digest_metadata,
)
from toolkit.wire.protocol import PARAMS_REF_TYPE, PROTOCOL_VERSION, ROUTES, GradientMeta, Heartbeat, ParamsRef
from toolkit.wire.tensor_container import encode_header

# one worker builds its relay process and peers (the module-scoped world) once (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("attacks")


# --- passes minted by hand (the relay and the signed peers: tests/support/peers.py) -----------------
def minted_pass(
    key: RelayKey, user: str, peer: PeerKey, *, issued: int, expires: int, key_id: str | None = None
) -> str:
    """A pass signed by ``key`` (the relay's own, another relay's, or a forger's)."""
    claims = PassClaims(key_id or key.key_id, issued, expires, issued, peer.public_raw, user)
    body = claims.encode_claims()
    return b64u(body + key.sign(PassClaims.signed_message(body)))


def auth_with_pass(token: str, peer: PeerKey, relay_key: RelayKey, clock=time.time) -> SignedAuth:
    claims, _, _ = decode_pass(token)
    access = AccessPass(
        token=token,
        claims=claims,
        relay_public=relay_key.public,
        clock_offset_s=0.0,
        received_mono=time.monotonic(),
        lifetime_s=600.0,
    )
    return SignedAuth(peer, AccessPassHolder(lambda previous: access), clock=clock)


def collab_state(relay: RelayProcess) -> tuple:
    """Everything an attack must not change: the open round (test_bad_input's round_state) plus
    who is registered, the leaderboard and the round log."""
    status = relay.status()
    return (
        round_state(relay),
        sorted(p["peer_id"] for p in status["peers"]),
        [(e["username"], e["samples"]) for e in status["leaderboard"]],
        len(status["recent_rounds"]),
    )


@dataclass
class World:
    relay: RelayProcess
    hub: HfStandin
    alice: SignedPeer
    bob: SignedPeer
    relay_key: RelayKey  # read from the data dir, as someone with the relay's disk could
    admin_token: str
    num_params: int
    before_params: np.ndarray


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Iterator[World]:
    directory = tmp_path_factory.mktemp("attacks")
    hub = standin()
    relay = None
    cache = socket.socket()  # the run's HTTP cache, where nothing listens: peers fall back to the relay,
    cache.bind(("127.0.0.1", 0))  # and the relay hands out the immutable URLs the issue-41 attacks try
    try:
        relay = hf_relay(
            directory, hub, {"server": {"public_params_url": f"http://127.0.0.1:{cache.getsockname()[1]}"}}
        )
        alice = SignedPeer.login(relay, "alice").join("alice-notebook")
        bob = SignedPeer.login(relay, "bob").join("bob-notebook")
        num_params = relay.status()["num_params"]
        before = np.empty(num_params, dtype=np.float32)
        assert alice.client.params.download_params(before, peer_id=alice.peer_id) == 0
        alice.client.heartbeat(alice.peer_id, Heartbeat(version=0, samples=SAMPLES, samples_per_s=10.0))
        round_ = relay.status()["round"]
        assert round_ and (round_["expected_peers"], round_["received_peers"]) == (1, 0)  # waiting for alice
        yield World(
            relay,
            hub,
            alice,
            bob,
            RelayKey.load_or_create(relay.data_dir),
            (relay.data_dir / TOKEN_FILE).read_text().strip(),
            num_params,
            before,
        )
    finally:
        if relay is not None:
            relay.stop()
        hub.stop()
        cache.close()


@pytest.fixture
def unchanged(world: World) -> Iterator[None]:
    """Wraps each attack: afterwards the relay serves and the collaboration is as before."""
    before = collab_state(world.relay)
    yield
    assert requests.get(world.relay.url + "/api/status", timeout=10).status_code == 200
    assert collab_state(world.relay) == before


def error_of(response: requests.Response | tuple[int, dict], *, hint: bool = True) -> tuple[int, str]:
    """``(status, error code)`` of a refusal, after checking it is the usual error body (a message,
    and a hint unless ``hint=False``, where the relay has none to give)."""
    status, body = (response.status_code, response.json()) if isinstance(response, requests.Response) else response
    assert body.get("message") and "hint" in body and (body["hint"] or not hint), body
    return status, body.get("error", "")


def hb_path(world: World) -> str:
    return f"/api/peers/{world.alice.peer_id}/heartbeat"


# --- passes ----------------------------------------------------------------------------------------
def test_forged_pass(world: World, unchanged) -> None:
    """Right key id, wrong signer: someone minting passes without the relay's key."""
    forger, peer = RelayKey.generate(), PeerKey()
    now = int(time.time())
    token = minted_pass(forger, "alice", peer, issued=now, expires=now + 600, key_id=world.relay_key.key_id)
    auth = auth_with_pass(token, peer, forger)
    response = world.alice.send(world.alice.prepared("POST", hb_path(world), world.alice.heartbeat_body(), auth=auth))
    assert error_of(response) == (401, "forged_pass")


def test_expired_pass(world: World, unchanged) -> None:
    """A genuine pass (made with the relay's own key from its data dir) that expired."""
    peer, now = PeerKey(), int(time.time())
    token = minted_pass(world.relay_key, "alice", peer, issued=now - 4000, expires=now - 10)
    auth = auth_with_pass(token, peer, world.relay_key)
    assert error_of(world.alice.send(world.alice.prepared("GET", "/api/progress", auth=auth))) == (401, "pass_expired")


def test_pass_from_another_relay(world: World, tmp_path) -> None:
    """A valid pass of another relay (its key generated in its own data dir, as a relay does)."""
    before = collab_state(world.relay)
    other = RelayKey.load_or_create(tmp_path / "other-relay-data")
    peer, now = PeerKey(), int(time.time())
    auth = auth_with_pass(minted_pass(other, "alice", peer, issued=now, expires=now + 600), peer, other)
    response = world.alice.send(world.alice.prepared("POST", hb_path(world), world.alice.heartbeat_body(), auth=auth))
    assert error_of(response) == (401, "pass_wrong_relay")
    assert world.relay.status() and collab_state(world.relay) == before


def test_stolen_pass_signed_with_another_key(world: World, unchanged) -> None:
    """Alice's real pass, but the thief does not hold her private key."""
    thief = SignedAuth(PeerKey(), world.alice.auth.holder)
    response = world.alice.send(world.alice.prepared("POST", hb_path(world), world.alice.heartbeat_body(), auth=thief))
    assert error_of(response) == (401, "bad_signature")


# --- requests ---------------------------------------------------------------------------------------
def test_tampered_body(world: World, unchanged) -> None:
    """Signed for 10 samples, altered to claim 1000 in transit."""
    prepared = world.alice.prepared("POST", hb_path(world), world.alice.heartbeat_body(SAMPLES))
    prepared.body = world.alice.heartbeat_body(1000)
    prepared.prepare_content_length(prepared.body)
    assert error_of(world.alice.send(prepared)) == (401, "body_mismatch")


def test_replayed_nonce(world: World, unchanged) -> None:
    prepared = world.alice.prepared("GET", "/api/progress")
    assert world.alice.send(prepared.copy()).status_code == 200  # the original (relay signature checked)
    assert error_of(world.alice.send(prepared)) == (401, "replayed_nonce")


def test_stale_timestamp(world: World, unchanged) -> None:
    late = SignedAuth(world.alice.auth.peer_key, world.alice.auth.holder, clock=lambda: time.time() - 3600)
    response = world.alice.send(world.alice.prepared("POST", hb_path(world), world.alice.heartbeat_body(), auth=late))
    assert error_of(response) == (401, "stale_timestamp")


def test_unsigned_request(world: World, unchanged) -> None:
    response = requests.post(
        world.relay.url + hb_path(world),
        data=world.alice.heartbeat_body(),
        timeout=10,
        headers={"Content-Type": "application/json"},
    )
    assert error_of(response) == (401, "missing_auth")


def test_other_users_peer_id(world: World, unchanged) -> None:
    """Bob, properly logged in, heartbeats as alice's peer."""
    response = world.bob.send(world.bob.prepared("POST", hb_path(world), world.bob.heartbeat_body()))
    assert error_of(response) == (403, "not_your_peer")


# --- users ------------------------------------------------------------------------------------------
def admin(world: World, method: str, path: str, **kwargs: Any) -> requests.Response:
    return requests.request(
        method,
        world.relay.url + "/api/admin" + path,
        timeout=30,
        headers={"Authorization": f"Bearer {world.admin_token}"},
        **kwargs,
    )


def test_banned_user(world: World) -> None:
    """Banned mid-session: the pass bob already holds stops working at once, so does a new login,
    and bob's peer is gone; alice's round is untouched by all of it."""
    round_before = round_state(world.relay)
    response = admin(world, "POST", "/bans", json={"username": "bob", "reason": "test"})
    assert response.status_code == 200 and response.json()["peers_dropped"] == 1, response.text
    try:
        before = collab_state(world.relay)
        step, samples, peers, open_round = before[0]
        assert world.bob.peer_id not in before[1] and peers == round_before[2] - 1
        assert (step, samples, open_round) == (round_before[0], round_before[1], round_before[3])
        assert error_of(world.bob.send(world.bob.prepared("GET", "/api/progress"))) == (403, "user_banned")
        with pytest.raises(RelayRejected) as login:
            RelayClient(world.relay.url, retries=0).login(TOKENS["bob"])
        assert (login.value.status, login.value.code) == (403, "user_banned")
        assert requests.get(world.relay.url + "/api/status", timeout=10).status_code == 200
        assert collab_state(world.relay) == before
    finally:
        assert admin(world, "DELETE", "/bans/bob").status_code == 200
    world.bob.join("bob-notebook")  # unbanned: the same pass works again


def test_non_allowlisted_user(world: World, unchanged) -> None:
    with pytest.raises(RelayRejected) as login:
        RelayClient(world.relay.url, retries=0).login(TOKENS["mallory"])
    assert (login.value.status, login.value.code) == (403, "not_allowlisted") and login.value.hint


def test_invalid_hf_token(world: World, unchanged) -> None:
    with pytest.raises(RelayRejected) as login:
        RelayClient(world.relay.url, retries=0).login("hf_not_a_real_token_000")
    assert (login.value.status, login.value.code) == (401, "invalid_hf_token")


def test_peer_pass_cannot_moderate(world: World, unchanged) -> None:
    """Admin routes want the admin token; a valid peer pass (or a guessed token) is not it."""
    response = world.alice.send(world.alice.prepared("GET", "/api/admin/contributions"))
    assert error_of(response) == (401, "admin_auth_required")
    response = requests.post(
        world.relay.url + "/api/admin/bans",
        json={"username": "alice", "reason": "x"},
        headers={"Authorization": "Bearer " + "A" * 43},
        timeout=10,
    )
    assert error_of(response) == (401, "bad_admin_token")


# --- bodies -----------------------------------------------------------------------------------------
def test_oversized_body(world: World, unchanged) -> None:
    """A signed 300 kB JSON body, and a signed upload declaring a terabyte."""
    big = b'{"pad": "' + b"x" * 300_000 + b'"}'
    response = world.alice.send(world.alice.prepared("POST", hb_path(world), big))
    assert response.status_code == 413 and response.json()["error"] == "request_entity_too_large"

    grad = np.zeros(world.num_params, np.float32)
    tensors = [("payload", grad)]
    meta = GradientMeta(peer_id=world.alice.peer_id, step=0, version=0, samples=SAMPLES, loss_sum=0.0)
    metadata = {"collab": meta.dumps().decode(), "codec": "none", **digest_metadata(tensors)}
    head = encode_header(tensors, metadata)
    prepared = requests.Request(
        "PUT",
        f"{world.relay.url}/api/rounds/0/gradient?peer_id={world.alice.peer_id}",
        data=iter([head]),
        headers={"Content-Type": CONTAINER_TYPE, BODY_SHA256_HEADER: hashlib.sha256(head).hexdigest()},
    ).prepare()
    world.alice.auth(prepared)
    lines = [f"PUT {prepared.path_url} HTTP/1.1", "Host: x", f"Content-Length: {10**12}"]
    lines += [f"{k}: {v}" for k, v in prepared.headers.items() if k.lower().startswith(("x-collab", "content-type"))]
    assert error_of(raw_http(world.relay.port, "\r\n".join(lines), head), hint=False) == (413, "body_too_large")


def test_wrong_shape(world: World, unchanged) -> None:
    assert error_of(world.alice.upload(np.zeros(world.num_params - 1, np.float32))) == (422, "bad_tensor")


def test_nan_gradient(world: World, unchanged) -> None:
    grad = np.ones(world.num_params, np.float32)
    grad[3] = np.nan
    assert error_of(world.alice.upload(grad)) == (422, "non_finite")


def test_more_samples_than_reported(world: World, unchanged) -> None:
    """The weight cap: an upload may not claim more samples than its last heartbeat reported."""
    response = world.alice.upload(np.ones(world.num_params, np.float32), samples=SAMPLES * 100)
    assert error_of(response) == (422, "samples_exceed_report")


def test_malformed_json(world: World, unchanged) -> None:
    assert error_of(world.alice.send(world.alice.prepared("POST", "/api/peers/join", b"{oops"))) == (400, "bad_json")
    not_a_name = b'{"peer_name": 5, "protocol": %d}' % PROTOCOL_VERSION
    response = world.alice.send(world.alice.prepared("POST", "/api/peers/join", not_a_name))
    assert error_of(response) == (400, "bad_schema")


def test_malformed_headers(world: World, unchanged) -> None:
    """Each auth header broken in turn, on an otherwise valid signed request."""

    def with_header(name: str, value: str | None) -> requests.PreparedRequest:
        prepared = world.alice.prepared("POST", hb_path(world), world.alice.heartbeat_body())
        if value is None:
            del prepared.headers[name]
        else:
            prepared.headers[name] = value
        return prepared

    cases = [
        (PASS_HEADER, "not*base64", 401, "malformed_pass"),
        (PASS_HEADER, "A" * 600, 401, "malformed_pass"),
        (PASS_HEADER, b64u(bytes(range(120))), 401, "malformed_pass"),
        (TIMESTAMP_HEADER, "yesterday", 401, "malformed_auth"),
        (TIMESTAMP_HEADER, "1" * 40, 401, "malformed_auth"),
        (NONCE_HEADER, "short", 401, "malformed_auth"),
        (BODY_SHA256_HEADER, "z" * 64, 401, "malformed_auth"),
        (SIGNATURE_HEADER, "!!!", 401, "malformed_auth"),
        (SIGNATURE_HEADER, None, 401, "missing_auth"),
        ("Content-Type", "text/plain", 401, "bad_signature"),  # the signature covers the content type
    ]
    for name, value, status, code in cases:
        assert error_of(world.alice.send(with_header(name, value))) == (status, code)
    # Raw bytes no client library would send: non-ASCII in the pass, and a header line without a colon.
    prepared = world.alice.prepared("GET", "/api/progress")
    lines = [f"GET {prepared.path_url} HTTP/1.1", "Host: x", f"{PASS_HEADER}: \xe9t\xe9"]
    lines += [
        f"{k}: {v}" for k, v in prepared.headers.items() if k.lower().startswith("x-collab") and k != PASS_HEADER
    ]
    assert error_of(raw_http(world.relay.port, "\r\n".join(lines))) == (401, "malformed_pass")
    with socket.create_connection(("127.0.0.1", world.relay.port), timeout=10) as sock:
        sock.sendall(b"GET /api/progress HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
        assert sock.recv(200).startswith(b"HTTP/1.0 400")  # aiohttp's parser answers before any handler


def test_timestamp_with_a_non_ascii_digit(world: World, unchanged) -> None:
    prepared = world.alice.prepared("GET", "/api/progress")
    lines = [f"GET {prepared.path_url} HTTP/1.1", "Host: x"]
    lines += [
        f"{k}: {v}" for k, v in prepared.headers.items() if k.lower().startswith("x-collab") and k != TIMESTAMP_HEADER
    ]
    response = raw_http(world.relay.port, "\r\n".join(lines + [f"{TIMESTAMP_HEADER}: \xb2"]))
    assert error_of(response) == (401, "malformed_auth")


# --- what a non-member can read (issue 41): the organizer's report, parameter URLs, Range ------------
HUGE = "9" * 5000  # more digits than Python converts to an int (4300): once a 500


def public_reads(world: World) -> dict[str, requests.Response]:
    """Every public GET route without a path parameter, read by a client that never logged in (the
    app's own list: a public route added later is read here too), and the dashboard's script."""
    paths = sorted(p for p in PUBLIC_ROUTES if "{" not in p and p not in ("/static", ROUTES["login"]))
    return {p: requests.get(world.relay.url + p, timeout=30) for p in [*paths, "/static/app.js"]}


def signed_ref(world: World) -> ParamsRef:
    """The current version's ref, as the relay hands it to a logged-in peer (alice)."""
    response = world.alice.send(world.alice.prepared("GET", ROUTES["params"] + "?ref=1"))
    assert response.status_code == 200 and response.headers["Content-Type"].startswith(PARAMS_REF_TYPE)
    return ParamsRef.loads(response.content)


def test_the_egress_report_is_the_organizers(world: World, unchanged) -> None:
    """It was public and listed every body URL with its sha256; now only the admin token reads it
    (a member's pass does not)."""
    url = world.relay.url + ROUTES["params_egress"]
    assert error_of(requests.get(url, timeout=10)) == (401, "admin_auth_required")
    assert error_of(world.alice.send(world.alice.prepared("GET", ROUTES["params_egress"]))) == (
        401,
        "admin_auth_required",
    )
    report = admin(world, "GET", ROUTES["params_egress"].removeprefix("/api/admin"))
    assert report.status_code == 200 and report.json()["refs"] >= 1


def test_no_url_a_non_member_can_learn_downloads_the_parameters(world: World, unchanged) -> None:
    """A client that never logged in got the parameters of this hf run at /api/params/v/0/<sha256>/full
    (the sha256 was on the public egress report). Now a body's URL is a capability only the signed
    ref names: nothing a public route answers contains it, and every URL built from what a
    non-member may know -- the sha256 itself included -- is a 403 that says to log in."""
    ref = signed_ref(world)
    capability = urlsplit(ref.url).path
    tag = capability.split("/")[5]
    assert tag != ref.sha256 and capability == f"/api/params/v/{ref.step}/{tag}/full"
    assert error_of(requests.get(world.relay.url + ROUTES["params"], params={"ref": 1}, timeout=10)) == (
        401,
        "missing_auth",
    )
    reads = public_reads(world)
    assert all(r.status_code < 500 for r in reads.values()), {p: r.status_code for p, r in reads.items()}
    public_text = "".join(r.text for r in reads.values())
    assert tag not in public_text
    guesses = {ref.sha256, *re.findall(r"[0-9a-f]{64}", public_text)}
    for guess in guesses:
        for kind in ("full", "delta"):
            for method in ("GET", "HEAD"):
                refused = requests.request(
                    method, f"{world.relay.url}/api/params/v/{ref.step}/{guess}/{kind}", timeout=10
                )
                assert refused.status_code == 403 and "public" not in refused.headers.get("Cache-Control", "")
                if method == "GET":
                    assert error_of(refused) == (403, "params_url_not_issued")
    # the capability itself needs no pass (a shared cache fills itself with it) and is the version
    body = requests.get(world.relay.url + capability, timeout=30)
    assert body.status_code == 200 and body.headers["X-Collab-Sha256"] == ref.sha256
    assert hashlib.sha256(body.content[-4 * world.num_params :]).hexdigest() == ref.sha256


def test_hostile_range_headers_never_answer_500(world: World, unchanged) -> None:
    """``Range: bytes=<5000 digits>-`` answered 500 (Python's int() refuses more than 4300 digits).
    Now, as RFC 9110 section 14 says: a first position past the end is 416 with a hint, a suffix or
    last position past it means to the end (206), an invalid or foreign one is ignored (200). Every
    public route (and the dashboard's files, served with ranges by aiohttp) is asked the same: none
    answers 500."""
    capability = world.relay.url + urlsplit(signed_ref(world).url).path
    whole = requests.get(capability, timeout=30).content
    size = len(whole)

    def get(value: str, url: str = capability) -> requests.Response:
        return requests.get(url, headers={"Range": value}, timeout=30)

    past = get(f"bytes={HUGE}-")
    assert error_of(past) == (416, "range_not_satisfiable") and past.headers["Content-Range"] == f"bytes */{size}"
    for value in (f"bytes=-{HUGE}", f"bytes=0-{HUGE}", f"BYTES=-{HUGE}"):
        answer = get(value)
        assert (answer.status_code, answer.content) == (206, whole), value[:40]
        assert answer.headers["Content-Range"] == f"bytes 0-{size - 1}/{size}"
    shifted = get("bytes=" + "0" * 5000 + "1-")  # leading zeros are still the position 1
    assert (shifted.status_code, shifted.content) == (206, whole[1:])
    ignored = (f"bytes={HUGE}-{HUGE[:2000]}", "bytes=abc", "bytes=--", "bytes=0-1,5-9", "items=0-9", "bytes=", HUGE)
    for value in ignored:
        answer = get(value)
        assert (answer.status_code, answer.content) == (200, whole), value[:40]
    hostile = (f"bytes={HUGE}-", f"bytes=-{HUGE}", f"bytes=0-{HUGE}", "bytes=abc", "bytes=0-1,5-9")
    for path, plain in public_reads(world).items():  # each answers as without the header, or 206/416
        for value in hostile:
            status = get(value, world.relay.url + path).status_code
            assert status < 500 and status in (plain.status_code, 206, 416), (path, value[:40], status)


# --- the round survived all of the above --------------------------------------------------------------
def test_round_after_all_attacks_applies_exactly_alices_gradient(world: World) -> None:
    """Run last (file order): alice's one valid upload finalizes the round, and the new parameters
    are exactly before - grad / samples (SGD, lr 1): no refused byte reached the sum."""
    assert round_state(world.relay)[3][2:] == (1, 0)
    grad_sum = np.random.default_rng(7).standard_normal(world.num_params).astype(np.float32)
    response = world.alice.upload(grad_sum)
    assert response.status_code == 200, response.text
    after = np.empty(world.num_params, dtype=np.float32)
    assert world.alice.client.params.download_params(after, min_step=1, wait_s=30, peer_id=world.alice.peer_id) == 1
    np.testing.assert_allclose(after, world.before_params - grad_sum / np.float32(SAMPLES), rtol=1e-6, atol=1e-7)
    assert [e["username"] for e in world.relay.status()["leaderboard"]] == ["alice"]


# --- a flood ------------------------------------------------------------------------------------------
def test_flood_is_rate_limited_while_a_peer_keeps_training(world: World) -> None:
    """Eve (allowlisted, signing every request properly) floods heartbeats: she gets 429 with a
    hint and Retry-After, while alice's CollaborativeOptimizer keeps training round after round,
    and the dashboard's status poll and the organizer's admin API keep answering. The module's
    relay runs with poll limits of 30/s, bursts of 60 (defaults: 50/s, 500), so the flood trips
    within a second."""

    from tests.peer_worker import make_dataset
    from toolkit.optimizer import CollaborativeOptimizer

    finish_open_round(world)
    trainer = RelayClient(world.relay.url, retries=2, backoff_s=0.2)
    trainer.login(TOKENS["alice"])
    run = trainer.get_run()
    from toolkit.models import build_model

    model = build_model(run.model)
    opt = CollaborativeOptimizer(
        model, client=trainer, batch_size_per_step=5, peer_name="alice-trainer", report_interval_s=0.1
    )
    data, start_step, steps = make_dataset(), opt.version, 6
    errors: list[str] = []

    def train() -> None:  # a well-behaved notebook: ~12 micro-batches/s at most
        try:
            i = 0
            while opt.version < start_step + steps:
                batch = data[(i * 5) % 4000 : (i * 5) % 4000 + 5]
                opt.zero_grad()
                (model.loss(batch) * 0.01).backward()  # the module's SGD lr is 1: keep the steps small
                opt.step()
                if opt.last_error is not None:
                    errors.append(opt.last_error.code)
                    opt.last_error = None
                i += 1
                time.sleep(0.08)
        except BaseException as exc:  # surfaced below
            errors.append(repr(exc))

    thread = threading.Thread(target=train, name="alice-trainer", daemon=True)
    eve = SignedPeer.login(world.relay, "eve").join("eve-flood")
    codes: dict[int, int] = {}
    first_429, flood_started = None, time.monotonic()
    thread.start()
    try:
        while thread.is_alive() and time.monotonic() - flood_started < 120:
            response = eve.send(eve.prepared("POST", f"/api/peers/{eve.peer_id}/heartbeat", eve.heartbeat_body(0)))
            codes[response.status_code] = codes.get(response.status_code, 0) + 1
            if response.status_code == 429 and first_429 is None:
                first_429 = response
                assert requests.get(world.relay.url + "/api/status", timeout=10).status_code == 200  # dashboard
                assert admin(world, "GET", "/contributions").status_code == 200  # organizer
    finally:
        thread.join(timeout=60)
        opt.close()
    flood_s = time.monotonic() - flood_started
    assert not thread.is_alive() and opt.version >= start_step + steps, (opt.version, errors)
    assert "rate_limited" not in errors, errors  # alice never felt the flood
    assert first_429 is not None, f"the flood was never limited: {codes}"
    body = first_429.json()
    assert body["error"] == "rate_limited" and body["hint"] and int(first_429.headers["Retry-After"]) >= 1
    # whatever pace the flood reached on this machine, eve got no more than her bucket allows
    assert codes.get(200, 0) <= FLOOD_LIMITS["poll_burst"] + (flood_s + 1) * FLOOD_LIMITS["poll_per_s"], codes
    log = world.relay.log_path.read_text()
    assert "refusing heartbeat/progress requests from user:eve" in log and "user:alice" not in log


def finish_open_round(world: World) -> None:
    """If the module's round still waits for the raw alice peer (this test run alone), let her
    deliver so the round closes and real training can start."""
    r = world.relay.status()["round"]
    if r is not None and r["received_peers"] == 0:
        assert world.alice.upload(np.zeros(world.num_params, np.float32)).status_code == 200
    world.relay.wait_for(lambda s: s["round"] is None, what="the module's round to close")
