"""A sliced round spoken by hand against a real relay and a real aggregator: tickets, hostile
slice uploads and internal calls. Every refusal is the same JSON error a relay gives, nothing
refused enters a sum (the SGD step at the end is exactly the one valid gradient), and both
servers keep serving."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import requests

from relay_server.backbone.tickets import encode_ticket
from relay_server.harness.thread import RelayThread
from tests.support.peers import RawPeer, raw_http
from toolkit.client import RelayClient
from toolkit.wire.auth import unb64u
from toolkit.wire.protocol import GradientMeta, Ticket
from toolkit.wire.tensor_container import encode_header

OVERRIDES = {
    "optimizer": {"name": "sgd", "lr": 1.0, "weight_decay": 0.0, "momentum": 0.0},
    "run": {"target_batch": 10, "max_staleness": 0},
    "rounds": {
        "heartbeat_interval_s": 1.0,
        "peer_ttl_s": 120.0,
        "deadline_initial_s": 120.0,
        "deadline_floor_s": 60.0,
        "deadline_ceiling_s": 120.0,
    },
    "aggregators": {"heartbeat_interval_s": 0.5, "ttl_s": 10.0, "replan_interval_s": 1000.0},
}


def container(grad: np.ndarray, meta: GradientMeta, name: str = "payload") -> bytes:
    return encode_header([(name, grad)], {"collab": meta.dumps().decode()}) + grad.tobytes()


def head_sha(body: bytes) -> str:
    n = int.from_bytes(body[:8], "little")
    return hashlib.sha256(body[: 8 + n]).hexdigest()


def answer(response: requests.Response | tuple[int, dict]) -> tuple[int, str]:
    if isinstance(response, tuple):  # raw_http's answer
        return response[0], response[1].get("error", "")
    body = response.json()
    assert set(body) >= {"error", "message", "hint"} if response.status_code >= 400 else True, body
    return response.status_code, body.get("error", "")


def relay_state(relay: RelayThread) -> tuple:
    s = relay.status()
    r = s["round"]
    return s["step"], r and (r["round_id"], r["expected_peers"], r["received_peers"])


def test_hostile_slice_uploads_and_internal_calls(serve_relay, start_aggregators):
    relay = serve_relay(OVERRIDES)  # in this process: the aggregator is the process under test
    (agg,) = start_aggregators(relay, "agg")
    peer = RawPeer(relay).join("raw")
    num_params = relay.status()["num_params"]
    client = RelayClient(relay.url)
    before = np.empty(num_params, dtype=np.float32)
    client.params.download_params(before)

    # A computing peer with nothing to send yet: the relay plans, then slices the vector.
    requests.post(
        f"{relay.url}/api/peers/{peer.peer_id}/heartbeat",
        timeout=10,
        json={"version": 0, "samples": 0, "samples_per_s": 10.0},
    )
    relay.wait_for(lambda s: len(s["plan"]["slices"]) == 2, what="a plan with the aggregator")
    assert peer.heartbeat(10).status_code == 200
    status = relay.wait_for(lambda s: s["round"] is not None, what="a sliced round")
    r = status["round"]
    mine = next(s for s in r["slices"] if s["url"] == agg.url)
    relays = next(s for s in r["slices"] if s["url"] == "")
    grad = np.random.default_rng(0).standard_normal(num_params).astype(np.float32)
    meta = GradientMeta(peer_id=peer.peer_id, step=0, version=0, samples=10, loss_sum=1.0)
    parts = {(s["start"], s["end"]): container(grad[s["start"] : s["end"]], meta) for s in (mine, relays)}
    digests = [
        {"start": s["start"], "end": s["end"], "header_sha256": head_sha(parts[(s["start"], s["end"])])}
        for s in r["slices"]
    ]

    def ticket(**changes) -> requests.Response:
        body = {"round_id": r["round_id"], "version": 0, "samples": 10, "loss_sum": 1.0, "slices": digests} | changes
        return requests.post(
            f"{relay.url}/api/rounds/0/ticket", params={"peer_id": peer.peer_id}, json=body, timeout=10
        )

    refused_tickets = {
        "more samples than reported": (ticket(samples=11), 422, "samples_exceed_report"),
        "not this round's slices": (ticket(slices=digests[:1]), 422, "bad_slices"),
        "another round": (ticket(round_id="0" * 16), 409, "round_closed"),
        "a version from the future": (ticket(version=3), 409, "stale_gradient"),
        "not json": (
            requests.post(f"{relay.url}/api/rounds/0/ticket", params={"peer_id": peer.peer_id}, data=b"{", timeout=10),
            400,
            "bad_json",
        ),
    }
    for what, (response, status_code, code) in refused_tickets.items():
        assert answer(response) == (status_code, code), (what, response.text)
    granted = ticket()
    assert granted.status_code == 200, granted.text
    good_ticket = granted.json()["ticket"]
    parsed = Ticket.loads(unb64u(good_ticket))
    state = relay_state(relay)

    body = parts[(mine["start"], mine["end"])]

    def put(data, ticket_header: str | None = good_ticket, step: int = 0, **headers) -> requests.Response:
        if ticket_header is not None:
            headers["X-Collab-Ticket"] = ticket_header
        return requests.put(agg.url + f"/api/rounds/{step}/gradient", data=data, headers=headers, timeout=30)

    forged = encode_ticket(Ticket(**{**parsed.__dict__, "samples": 9}))
    poisoned = grad.copy()
    poisoned[mine["start"] + 1] = np.nan
    # Open runs bind the header only (signed runs list chunk digests in it, binding the data too).
    nan_body = container(poisoned[mine["start"] : mine["end"]], meta)
    other_meta = GradientMeta(peer_id=peer.peer_id, step=0, version=0, samples=10, loss_sum=2.0)
    hostile = {
        "no ticket": (put(body, None), 401, "missing_ticket"),
        "garbage ticket": (put(body, "!!"), 401, "malformed_ticket"),
        "forged ticket": (put(body, forged), 403, "forged_ticket"),
        "ticket for another step": (put(body, step=1), 400, "bad_ticket"),
        "another container than the ticket's": (
            put(container(grad[mine["start"] : mine["end"]], other_meta)),
            403,
            "ticket_mismatch",
        ),
        "nan under the ticket's header": (put(nan_body), 422, "non_finite"),
        "the relay's slice": (put(parts[(relays["start"], relays["end"])]), 403, "ticket_mismatch"),
        "chunked body": (put(iter([body])), 411, "length_required"),
        "declared too big": (
            raw_http(
                agg.port,
                f"PUT /api/rounds/0/gradient HTTP/1.1\r\nHost: a\r\n"
                f"X-Collab-Ticket: {good_ticket}\r\nContent-Length: {10**9}",
            ),
            413,
            "body_too_large",
        ),
        "bytes that are not the ticket's container": (put(b"\x00" * 64), 403, "ticket_mismatch"),
        "the ticket's header, data cut short": (put(body[:-4]), 400, "length_mismatch"),
        "wrong path step": (requests.put(agg.url + "/api/rounds/x/gradient", data=body, timeout=10), 400, "bad_path"),
        "params without a slice": (requests.get(agg.url + "/api/params", timeout=10), 400, "bad_query"),
        "params of another slice": (
            requests.get(agg.url + "/api/params", params={"start": 0, "end": 1}, timeout=10),
            409,
            "wrong_slice",
        ),
        "finalize without the token": (
            requests.post(agg.url + "/api/admin/finalize", json={}, timeout=10),
            401,
            "admin_auth_required",
        ),
        "state with a wrong token": (
            requests.get(
                agg.url + "/api/admin/state",
                params={"step": 0},
                timeout=10,
                headers={"Authorization": "Bearer " + "x" * 40},
            ),
            401,
            "bad_admin_token",
        ),
        "relay register without the token": (
            requests.post(
                relay.url + "/api/admin/aggregators/register",
                json={"name": "evil", "url": "http://x", "protocol": 3},
                timeout=10,
            ),
            401,
            "admin_auth_required",
        ),
    }
    for what, (response, status_code, code) in hostile.items():
        assert answer(response) == (status_code, code), (what, getattr(response, "text", response))
        assert relay_state(relay) == state, what
    assert agg.proc.poll() is None

    # The one valid gradient, its slices to their owners, then done: a step of exactly that gradient.
    assert put(body).status_code == 200
    assert answer(put(body)) == (409, "duplicate_upload")
    response = requests.put(
        relay.url + "/api/rounds/0/gradient",
        data=parts[(relays["start"], relays["end"])],
        headers={"X-Collab-Ticket": good_ticket},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    done = requests.post(
        f"{relay.url}/api/rounds/0/done",
        params={"peer_id": peer.peer_id},
        timeout=10,
        json={"round_id": r["round_id"], "delivered": [mine["start"], relays["start"]]},
    )
    assert done.status_code == 200 and done.json()["accepted_samples"] == 10, done.text
    manifest = (
        relay.wait_for(lambda s: s["step"] == 1, what="step 1")
        and requests.get(relay.url + "/api/params", params={"min_step": 1}, timeout=10).json()
    )
    assert manifest["step"] == 1 and len(manifest["slices"]) == 2, manifest
    after = before.copy()
    assert client.params.download_params(after, min_step=1, have=0) == 1  # each slice checked against the manifest
    np.testing.assert_allclose(after, before - grad / 10, rtol=1e-6, atol=1e-7)
    assert json.loads(json.dumps(relay.status()["recent_rounds"][-1]))["contributors"] == 1
    client.close()
