"""Issue 17: what an allowlisted, authenticated peer can still try against the relay -- each attack
written as it was found, and each now failing.

The relay runs in this process (the real app of ``create_app``, served on a real port, in hf mode
against the local Hugging Face stand-in), so a test can take a snapshot of the WHOLE state --
registry with last-seen times, departed peers, the open round, the reducer's sums, shard leases,
transfer measurements, the round log -- and prove that a refused request changed none of it.
Clients are the toolkit's own signed clients (``tests/support/peers.py``'s ``SignedPeer``); the relay
is conftest's ``relay_factory`` (``relay_server.harness.thread.RelayThread``).
The second file, ``tests/test_hostile_uploads.py``, holds the upload and moderation attacks.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
from aiohttp import web

from relay_server.api.app import PUBLIC_ROUTES
from relay_server.api.moderation import ADMIN_PREFIX, TOKEN_FILE
from relay_server.auth.verify import ChunkDigests
from relay_server.harness.thread import RelayThread
from tests.support.peers import ALLOWED, TOKENS, SignedPeer, signed_container
from tests.support.relays import snapshot
from toolkit.errors import ProtocolError
from toolkit.wire import payloads
from toolkit.wire.auth import b64u, digest_metadata
from toolkit.wire.protocol import (
    PROTOCOL_VERSION,
    ROUTES,
    DoneRequest,
    GradientMeta,
    Heartbeat,
    JoinRequest,
    PipelineDone,
    PipelineResult,
    PipelineTicketRequest,
    ShardLeaseRequest,
    ShardReport,
    ShardUpdate,
    SliceDigest,
    StageRequest,
    TicketRequest,
)
from toolkit.wire.tensor_container import encode_header, parse_header


# --- the whole state, as plain data (tests/support/relays.py's snapshot), once it settled -----------
def settled_snapshot(relay: RelayThread, timeout_s: float = 10.0) -> dict[str, Any]:
    """A snapshot that stays the same for 0.5 s (housekeeping -- lease expiry after a leave --
    runs on timers): only a state that does not move on its own can show a request moved it."""
    deadline = time.monotonic() + timeout_s
    previous = snapshot(relay)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        current = snapshot(relay)
        if current == previous:
            return current
        previous = current
    raise AssertionError("the relay's state keeps moving on its own: a snapshot cannot prove anything")


# --- peer-scoped routes, from the router ------------------------------------------------------------
QUERY_PEER_ROUTES = {
    ("PUT", ROUTES["gradient"]),
    ("GET", ROUTES["params"]),
    ("POST", ROUTES["ticket"]),
    ("POST", ROUTES["done"]),
}  # the peer id rides in the query string
NOT_PEER_SCOPED = {  # signed routes that act on no peer but the caller's own (or on none)
    ("POST", ROUTES["join"]): "creates the caller's own peer",
    ("GET", ROUTES["progress"]): "reads the collaboration",
    ("GET", ROUTES["state"]): "reads the latest version",
    ("POST", ROUTES["refresh"]): "the caller's own pass",
    ("GET", ROUTES["tokenizer"]): "reads the run's tokenizer",
    ("GET", ROUTES["moe_spec"]): "reads the run's [moe] section",
    ("GET", ROUTES["moe_directory"]): "reads the expert directory",
}


def router_routes(app: web.Application) -> set[tuple[str, str]]:
    out = set()
    for route in app.router.routes():
        resource = route.resource
        if resource is None or route.method == "HEAD":
            continue
        out.add((route.method, resource.canonical))
    return out


@dataclasses.dataclass
class Scene:
    relay: RelayThread
    alice: SignedPeer
    bob: SignedPeer


def _json(peer: SignedPeer, method: str, path: str, body: bytes | None = None) -> requests.PreparedRequest:
    return peer.prepared(method, path, body)


def _upload_as(scene: Scene) -> requests.PreparedRequest:
    """Bob's correctly signed whole-vector upload naming alice's peer."""
    n = scene.relay.status()["num_params"]
    grad = np.ones(n, np.float32)
    tensors = [("payload", grad)]
    meta = GradientMeta(peer_id=scene.alice.peer_id, step=0, version=0, samples=5, loss_sum=1.0)
    metadata = {"collab": meta.dumps().decode(), "codec": "none", **digest_metadata(tensors)}
    head = encode_header(tensors, metadata)
    return signed_container(
        scene.bob, head, head + grad.tobytes(), f"/api/rounds/0/gradient?peer_id={scene.alice.peer_id}"
    )


TENSORS = "application/octet-stream"
MOE = {"enabled": True, "grid": [2, 2], "expert": {"kind": "ffn", "d": 8, "hidden": 16}}


def _checkpoint_as(scene: Scene) -> requests.PreparedRequest:
    """Bob's correctly signed (streamed, chunk digests) expert checkpoint as alice's host."""
    tensors = [("p.up.weight", np.zeros((4, 8), np.float32))]
    metadata = {"updates": "1", **digest_metadata(tensors)}
    head = encode_header(tensors, metadata)
    return signed_container(
        scene.bob,
        head,
        head + tensors[0][1].tobytes(),
        f"/api/moe/hosts/{scene.alice.peer_id}/experts/ffn0.0.0/checkpoint",
    )


def _result_as(scene: Scene) -> requests.PreparedRequest:
    """Bob's correctly signed (streamed, chunk digests) pipeline task result as alice's worker."""
    tensors = [("y", np.zeros((4, 8), np.float32))]
    metadata = {"result": PipelineResult(task_id="t1").dumps().decode(), **digest_metadata(tensors)}
    head = encode_header(tensors, metadata)
    return signed_container(
        scene.bob, head, head + tensors[0][1].tobytes(), f"/api/pipeline/workers/{scene.alice.peer_id}/tasks/t1"
    )


def _requests_on_alice(scene: Scene) -> dict[tuple[str, str], list[Callable[[], requests.PreparedRequest]]]:
    """For each peer-scoped route, bob's request(s) acting on alice's peer."""
    a, bob = scene.alice.peer_id, scene.bob
    hb = Heartbeat(version=0, samples=5, samples_per_s=10.0).dumps()
    progress = ShardReport(updates=[ShardUpdate(source="web", shard="x", samples=3)]).dumps()
    release = ShardReport(updates=[ShardUpdate(source="web", shard="x", release=True)]).dumps()
    expert_body = payloads.call_body(np.zeros((2, 8), np.float32))
    ticket = TicketRequest(
        round_id="r" * 16,
        version=0,
        samples=5,
        loss_sum=1.0,
        slices=[SliceDigest(start=0, end=1, header_sha256="0" * 64)],
    ).dumps()
    pipeline_ticket = PipelineTicketRequest(
        round_id="r" * 16, stage=0, microbatches=[0], header_sha256="0" * 64
    ).dumps()
    return {
        ("POST", ROUTES["heartbeat"]): [lambda: _json(bob, "POST", f"/api/peers/{a}/heartbeat", hb)],
        ("POST", ROUTES["leave"]): [lambda: _json(bob, "POST", f"/api/peers/{a}/leave")],
        ("POST", ROUTES["shard_lease"]): [
            lambda: _json(bob, "POST", f"/api/peers/{a}/shards/lease", ShardLeaseRequest(source="web").dumps())
        ],
        ("POST", ROUTES["shard_report"]): [
            lambda: _json(bob, "POST", f"/api/peers/{a}/shards/report", progress),
            lambda: _json(bob, "POST", f"/api/peers/{a}/shards/report", release),
        ],
        ("PUT", ROUTES["gradient"]): [lambda: _upload_as(scene)],
        ("GET", ROUTES["params"]): [
            lambda: _json(bob, "GET", f"/api/params?peer_id={a}&min_step=0"),
            lambda: _json(bob, "GET", f"/api/params?peer_id={a}&start=0&end=1"),
        ],
        ("POST", ROUTES["ticket"]): [lambda: _json(bob, "POST", f"/api/rounds/0/ticket?peer_id={a}", ticket)],
        ("POST", ROUTES["done"]): [
            lambda: _json(
                bob, "POST", f"/api/rounds/0/done?peer_id={a}", DoneRequest(round_id="r" * 16, delivered=[0]).dumps()
            )
        ],
        # mixture-of-experts: acting as alice's trainer or alice's expert host
        ("PUT", ROUTES["moe_call"]): [
            lambda: bob.prepared(
                "PUT", f"/api/moe/peers/{a}/calls/ffn0.0.0?kind=forward&call_id=c1", expert_body, content_type=TENSORS
            )
        ],
        ("POST", ROUTES["moe_lease"]): [lambda: _json(bob, "POST", f"/api/moe/hosts/{a}/lease?capacity=4")],
        ("GET", ROUTES["moe_tasks"]): [lambda: _json(bob, "GET", f"/api/moe/hosts/{a}/tasks?wait=0")],
        ("PUT", ROUTES["moe_result"]): [
            lambda: bob.prepared("PUT", f"/api/moe/hosts/{a}/tasks/t1", expert_body, content_type=TENSORS)
        ],
        ("PUT", ROUTES["moe_checkpoint"]): [lambda: _checkpoint_as(scene)],
        ("GET", ROUTES["moe_checkpoint"]): [
            lambda: _json(bob, "GET", f"/api/moe/hosts/{a}/experts/ffn0.0.0/checkpoint")
        ],
        # the staged pipeline: acting as alice's stage worker
        ("POST", ROUTES["pipeline_stage"]): [
            lambda: _json(bob, "POST", f"/api/pipeline/workers/{a}/stage", StageRequest().dumps())
        ],
        ("GET", ROUTES["pipeline_work"]): [lambda: _json(bob, "GET", f"/api/pipeline/workers/{a}/work?wait=0")],
        ("PUT", ROUTES["pipeline_result"]): [lambda: _result_as(scene)],
        ("POST", ROUTES["pipeline_ticket"]): [
            lambda: _json(bob, "POST", f"/api/pipeline/workers/{a}/rounds/0/ticket", pipeline_ticket)
        ],
        ("POST", ROUTES["pipeline_done"]): [
            lambda: _json(
                bob,
                "POST",
                f"/api/pipeline/workers/{a}/rounds/0/done",
                PipelineDone(round_id="r" * 16, contributor=a, delivered=True).dumps(),
            )
        ],
        ("GET", ROUTES["pipeline_credit"]): [lambda: _json(bob, "GET", f"/api/pipeline/workers/{a}/credit")],
    }


def test_every_signed_route_is_classified(relay_factory) -> None:
    """A new route is either peer-scoped (and then in the snapshot test below) or says why not."""
    relay = relay_factory()
    scene = Scene(relay, SignedPeer.login(relay, "alice"), SignedPeer.login(relay, "bob"))
    scoped = set(_requests_on_alice(scene))
    for method, path in router_routes(relay.app):
        if path.startswith(ADMIN_PREFIX) or path in PUBLIC_ROUTES or path.startswith("/static"):
            continue  # the admin token, or nobody's peer
        if "{peer_id}" in path or (method, path) in QUERY_PEER_ROUTES:
            assert (method, path) in scoped, f"peer-scoped route {method} {path} has no refused-request case"
        else:
            assert (method, path) in NOT_PEER_SCOPED or (method, path) in scoped, (
                f"new signed route {method} {path}: add it to the peer-scoped cases or to NOT_PEER_SCOPED"
            )


@pytest.mark.parametrize("alice_state", ["live_and_silent", "departed"])
def test_a_refused_request_on_another_users_peer_changes_nothing(relay_factory, alice_state: str) -> None:
    """Issue 17's first finding: bob, refused with 403, brought alice's departed peer back and
    reset her silent peer's last-seen. Now, on EVERY peer-scoped route, bob's refused request
    leaves the whole state as it was -- alice live (an open round waiting for her, a shard lease
    held) or departed."""
    relay = relay_factory(moe=MOE)  # expert routes with real state behind them
    alice, bob = SignedPeer.login(relay, "alice").join("alice-nb"), SignedPeer.login(relay, "bob").join("bob-nb")
    scene = Scene(relay, alice, bob)
    assert (
        alice.send(
            _json(alice, "POST", f"/api/peers/{alice.peer_id}/shards/lease", ShardLeaseRequest(source="web").dumps())
        ).status_code
        == 200
    )
    assert alice.send(_json(alice, "POST", f"/api/moe/hosts/{alice.peer_id}/lease?capacity=2")).status_code == 200
    hb = Heartbeat(version=0, samples=10, samples_per_s=10.0).dumps()
    assert alice.send(_json(alice, "POST", f"/api/peers/{alice.peer_id}/heartbeat", hb)).status_code == 200
    assert relay.status()["round"]["expected_peers"] == 1  # a round is open, waiting for alice
    if alice_state == "departed":
        assert alice.send(_json(alice, "POST", f"/api/peers/{alice.peer_id}/leave")).status_code == 200
    before = settled_snapshot(relay)
    if alice_state == "departed":
        assert alice.peer_id in before["departed"]
    for route, builders in _requests_on_alice(scene).items():
        for build in builders:
            response = bob.send(build())
            assert (response.status_code, response.json().get("error")) == (403, "not_your_peer"), (
                route,
                response.text,
            )
            assert response.json().get("hint")
            assert snapshot(relay) == before, f"bob's refused {route} changed the relay's state"


# --- sizes: checked against the run's layout before anything proportional is allocated -------------


def test_a_small_header_declaring_2_to_59_floats_is_refused_before_any_allocation(relay_factory) -> None:
    """360 bytes of signed header declared 2^59 floats; the relay built a per-chunk digest list
    from that (MemoryError, 500; at 6.7e7 chunks it blocked the event loop 1.4 s). Now the
    declared size is checked against the run's parameters in its codec first: 413."""
    relay = relay_factory()
    bob = SignedPeer.login(relay, "bob").join("bob-nb")
    before = settled_snapshot(relay)  # after the join's own bookkeeping, which a loaded machine delays
    for numel in (1 << 59, 16_777_216 * 4):  # absurd, and merely bigger than this run's model
        header = {
            "payload": {"dtype": "F32", "shape": [numel], "data_offsets": [0, numel * 4]},
            "__metadata__": {"collab_chunk_bytes": "4096", "collab_chunk_sha256": b64u(b"\0" * 32)},
        }
        raw = json.dumps(header).encode()
        head = len(raw).to_bytes(8, "little") + raw
        assert len(head) < 400
        response = bob.send(signed_container(bob, head, head, f"/api/rounds/0/gradient?peer_id={bob.peer_id}"))
        assert (response.status_code, response.json()["error"]) == (413, "body_too_large"), response.text
    assert requests.get(relay.url + "/api/status", timeout=10).status_code == 200
    assert snapshot(relay) == before


def test_declared_sizes_never_build_anything_proportional() -> None:
    """The digest checker counts chunks arithmetically before any list exists, and a shape whose
    int64 product wraps to 0 no longer passes as an empty tensor."""
    meta = {"collab_chunk_bytes": "4096", "collab_chunk_sha256": b64u(b"\0" * 32)}
    with pytest.raises(Exception) as refused:
        ChunkDigests([1 << 61], meta)  # 2^49 chunks: building their list was the MemoryError
    assert getattr(refused.value, "code", "") == "bad_chunk_digests"
    wrapped = json.dumps({"x": {"dtype": "F32", "shape": [1 << 32, 1 << 32], "data_offsets": [0, 0]}}).encode()
    with pytest.raises(ProtocolError):
        parse_header(len(wrapped).to_bytes(8, "little"), wrapped, 1 << 20)


# --- the signature covers exactly the bytes the relay acts on ---------------------------------------
def test_an_unsigned_json_tail_behind_an_octet_stream_head_is_refused(relay_factory) -> None:
    """Content-Type octet-stream on a JSON route: only the container head was hashed, and the
    handler read the unsigned JSON tail after it (777 samples, 200). The route decides how a
    body is signed now, so this is 415 and nothing changes."""
    relay = relay_factory()
    bob = SignedPeer.login(relay, "bob").join("bob-nb")
    before = snapshot(relay)
    tensors = [("payload", np.zeros(1, np.float32))]
    head = encode_header(tensors, digest_metadata(tensors))  # a valid signed container head...
    tail = Heartbeat(version=0, samples=777, samples_per_s=1.0).dumps()  # ...and an unsigned JSON tail
    response = bob.send(signed_container(bob, head, head + tail, f"/api/peers/{bob.peer_id}/heartbeat", "POST"))
    assert (response.status_code, response.json()["error"]) == (415, "wrong_content_type"), response.text
    assert response.json()["hint"]
    assert snapshot(relay) == before and relay.status()["samples_accumulated"] == 0


def test_anything_after_a_json_document_is_refused(relay_factory) -> None:
    relay = relay_factory()
    bob = SignedPeer.login(relay, "bob").join("bob-nb")
    before = snapshot(relay)
    hb = Heartbeat(version=0, samples=5, samples_per_s=1.0).dumps()
    for body in (hb + hb.replace(b"5", b"7"), hb + b"garbage"):
        response = bob.send(bob.prepared("POST", f"/api/peers/{bob.peer_id}/heartbeat", body))
        assert (response.status_code, response.json()["error"]) == (400, "bad_json"), response.text
    assert snapshot(relay) == before


# --- logs and the dashboard -------------------------------------------------------------------------
def test_a_newline_in_a_peer_name_cannot_forge_a_log_line(relay_factory, caplog) -> None:
    relay = relay_factory()
    forged = "nb\nINFO:relay_server.collaboration.machine:peer admin (alice, H100) joined at step 0"
    with caplog.at_level(logging.INFO, logger="relay_server"):
        SignedPeer.login(relay, "bob").client.join(JoinRequest(peer_name=forged, protocol=PROTOCOL_VERSION))
    joined = [r.getMessage() for r in caplog.records if "joined at step" in r.getMessage()]
    assert joined and all("\n" not in line for line in joined)
    assert any("nb\\x0aINFO:relay_server" in line for line in joined)


def test_a_mistyped_admin_token_never_reaches_the_log(relay_factory, caplog) -> None:
    """aiohttp logs a malformed header's raw bytes ("Error handling request"): a token with a
    stray control byte landed in the log almost whole."""
    relay = relay_factory()
    token = (relay.data_dir / TOKEN_FILE).read_text().strip()
    with caplog.at_level(logging.DEBUG):
        with socket.create_connection(("127.0.0.1", relay.port), timeout=10) as sock:
            sock.sendall(
                f"GET {ADMIN_PREFIX}/bans HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\x01x\r\n\r\n".encode(
                    "latin-1"
                )
            )
            assert sock.recv(4096).startswith(b"HTTP/1.")
        time.sleep(0.2)
    logged = caplog.text + "".join(str(r.exc_info) for r in caplog.records)
    assert token[:12] not in logged and token[-12:] not in logged
    assert "malformed HTTP request" in caplog.text  # the event itself is still logged, one line


def test_the_dashboard_renders_user_text_as_text() -> None:
    static = Path(__file__).resolve().parents[1] / "relay_server" / "api" / "static"
    for path in static.glob("*.js"):
        source = path.read_text()
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
            assert sink not in source.replace("never innerHTML", ""), f"{path.name} uses {sink}"
    assert "node.textContent = String(text)" in (static / "app.js").read_text()


# --- login limits on loopback, and the proxy warning ------------------------------------------------
def _login(relay: RelayThread) -> requests.Response:
    return requests.post(
        relay.url + ROUTES["login"], timeout=10, json={"hf_token": TOKENS["eve"], "peer_public_key": b64u(b"k" * 32)}
    )


def test_logins_from_loopback_are_limited_unless_exempted(relay_factory) -> None:
    """Behind a proxy without X-Forwarded-For every volunteer is 127.0.0.1: an exempt loopback
    made that one bucket unlimited."""
    relay = relay_factory(limits={"login_per_s": 0.01, "login_burst": 3.0})
    codes = []
    for _ in range(5):
        response = _login(relay)
        codes.append(response.status_code)
    assert codes[:3] == [200] * 3 and codes[3:] == [429, 429], codes
    exempt = relay_factory(limits={"login_per_s": 0.01, "login_burst": 3.0, "exempt_loopback_logins": True})
    assert all(_login(exempt).status_code == 200 for _ in range(5))


def test_one_proxy_address_without_forwarded_header_is_warned_about_once(relay_factory, caplog) -> None:
    relay = relay_factory()
    with caplog.at_level(logging.WARNING, logger="relay_server"):
        for user in ALLOWED:
            peer = SignedPeer.login(relay, user)
            assert peer.send(peer.prepared("GET", ROUTES["progress"])).status_code == 200
        peer.send(peer.prepared("GET", ROUTES["progress"]))
    warnings = [r.getMessage() for r in caplog.records if "X-Forwarded-For" in r.getMessage()]
    assert len(warnings) == 1 and "proxy_set_header X-Forwarded-For" in warnings[0]
    caplog.clear()
    forwarded = relay_factory()
    with caplog.at_level(logging.WARNING, logger="relay_server"):
        for i, user in enumerate(ALLOWED):
            peer = SignedPeer.login(forwarded, user)
            prepared = peer.prepared("GET", ROUTES["progress"])
            prepared.headers["X-Forwarded-For"] = f"203.0.113.{i + 1}"
            assert peer.send(prepared).status_code == 200
    assert not [r for r in caplog.records if "X-Forwarded-For" in r.getMessage()]
