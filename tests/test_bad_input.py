"""Hostile and broken input against a real relay process: every request gets a 4xx JSON error
with a message, the relay keeps serving, and the open round is untouched.

The round's gradient buffer is checked the strongest way there is: after all the bad uploads,
one valid upload finalizes the round and the applied SGD update must be exactly that upload's.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable

import numpy as np
import pytest
import requests

from relay_server.harness.process import RelayProcess
from tests.support.peers import RawPeer, raw_http, round_state
from tests.support.processes import spawn_relay
from toolkit.client import RelayClient
from toolkit.wire.tensor_container import encode_header

# Two 1M-element chunks: big enough that "a later chunk" exists (rounds.CHUNK_ELEMS = 2**20).
OVERRIDES = {
    "model": {"factory": "toolkit.models:MLP", "kwargs": {"sizes": [8, 2048, 512, 1]}},
    "optimizer": {"name": "sgd", "lr": 1.0, "weight_decay": 0.0, "momentum": 0.0},
    "run": {"target_batch": 10, "max_staleness": 0},
    "rounds": {
        "heartbeat_interval_s": 1.0,
        "peer_ttl_s": 120.0,
        "deadline_initial_s": 120.0,
        "deadline_floor_s": 60.0,
        "deadline_ceiling_s": 120.0,
    },
}


def relay_params(relay: RelayProcess, num_params: int, min_step: int = 0) -> np.ndarray:
    client = RelayClient(relay.url)
    out = np.empty(num_params, dtype=np.float32)
    assert client.params.download_params(out, min_step=min_step, wait_s=30) is not None
    client.close()
    return out


@pytest.fixture(scope="module")
def relay(tmp_path_factory) -> RelayProcess:
    relay = spawn_relay(tmp_path_factory.mktemp("bad-input"), OVERRIDES)
    yield relay
    relay.stop()


def bad_requests(peer: RawPeer, num_params: int) -> dict[str, tuple[Callable[[], tuple[int, dict]], int, str]]:
    """name -> (send it, expected HTTP status, expected error code)."""
    good = np.random.default_rng(0).standard_normal(num_params).astype(np.float32)
    url, port, pid = peer.relay.url, peer.relay.port, peer.peer_id

    def put(body, step=0, peer_id=None):
        return lambda: _status_json(peer.upload(body, step, peer_id))

    def post(path, raw: bytes | str):
        return lambda: _status_json(
            requests.post(url + path, data=raw, timeout=10, headers={"Content-Type": "application/json"})
        )

    def poisoned(value: float, at: int) -> np.ndarray:
        grad = good.copy()
        grad[at] = value
        return grad

    container = peer.container(good)
    header_len = struct.unpack("<Q", container[:8])[0]
    hb = f"/api/peers/{pid}/heartbeat"
    return {
        # gradient uploads
        "nan_in_gradient": (put(peer.container(poisoned(np.nan, 5))), 422, "non_finite"),
        "inf_in_gradient": (put(peer.container(poisoned(np.inf, 7))), 422, "non_finite"),
        "wrong_length": (put(peer.container(good[:-1])), 422, "bad_tensor"),
        "wrong_dtype": (put(peer.container(good.astype(np.float16))), 422, "bad_tensor"),
        "wrong_tensor_name": (put(peer.container(good, name="weights")), 422, "bad_tensor"),
        "missing_metadata": (put(encode_header([("payload", good)]) + good.tobytes()), 400, "bad_meta"),
        "metadata_names_another_peer": (put(peer.container(good, peer.meta(peer_id="f" * 32))), 422, "bad_meta"),
        "metadata_for_another_round": (put(peer.container(good, peer.meta(step=1))), 422, "bad_meta"),
        "more_samples_than_reported": (put(peer.container(good, peer.meta(samples=11))), 422, "samples_exceed_report"),
        "gradient_from_a_future_version": (put(peer.container(good, peer.meta(version=5))), 409, "stale_gradient"),
        "round_not_open": (put(container, step=3), 409, "round_closed"),
        "unknown_peer": (put(container, peer_id="0" * 32), 404, "unknown_peer"),
        "step_not_a_number": (
            lambda: _status_json(
                requests.put(f"{url}/api/rounds/abc/gradient", data=container, params={"peer_id": pid}, timeout=10)
            ),
            400,
            "bad_path",
        ),
        "header_not_json": (put(struct.pack("<Q", 16) + b"{not json at all" + good.tobytes()), 400, "bad_tensor"),
        "header_length_absurd": (put(struct.pack("<Q", 2**40) + container[8:]), 400, "bad_tensor"),
        "byte_range_disagrees_with_shape": (
            put(
                container[:8]
                + container[8 : 8 + header_len].replace(f"[{num_params}]".encode(), f"[{num_params - 1}]".encode(), 1)
                + container[8 + header_len :]
            ),
            400,
            "bad_tensor",
        ),
        "body_longer_than_its_header_says": (put(container + b"\0" * 64), 400, "length_mismatch"),
        "chunked_body_without_length": (put(iter([container])), 411, "length_required"),
        "oversized_body": (
            lambda: raw_http(
                port, f"PUT /api/rounds/0/gradient?peer_id={pid} HTTP/1.1\r\nHost: x\r\nContent-Length: {10**12}"
            ),
            413,
            "body_too_large",
        ),
        # JSON requests
        "join_not_json": (post("/api/peers/join", "{oops"), 400, "bad_json"),
        "join_missing_field": (post("/api/peers/join", '{"peer_name": "x"}'), 400, "bad_schema"),
        "join_unknown_field": (
            post("/api/peers/join", json.dumps({"peer_name": "x", "protocol": 1, "admin": 1})),
            400,
            "bad_schema",
        ),
        "join_name_too_long": (
            post("/api/peers/join", json.dumps({"peer_name": "x" * 500, "protocol": 1})),
            400,
            "bad_schema",
        ),
        "join_array_not_object": (post("/api/peers/join", "[1, 2]"), 400, "bad_schema"),
        "join_nested_too_deep": (
            post("/api/peers/join", json.dumps({"peer_name": "x", "protocol": 1, "device": _nested(20)})),
            400,
            "bad_schema",
        ),
        "join_wrong_protocol": (
            post("/api/peers/join", json.dumps({"peer_name": "x", "protocol": 999})),
            400,
            "protocol_mismatch",
        ),
        "heartbeat_nan": (post(hb, '{"version": 0, "samples": 5, "samples_per_s": NaN}'), 400, "bad_schema"),
        "heartbeat_negative_samples": (
            post(hb, '{"version": 0, "samples": -5, "samples_per_s": 1}'),
            400,
            "bad_schema",
        ),
        "heartbeat_samples_as_text": (
            post(hb, '{"version": 0, "samples": "5", "samples_per_s": 1}'),
            400,
            "bad_schema",
        ),
        "heartbeat_bool_as_int": (post(hb, '{"version": true, "samples": 5, "samples_per_s": 1}'), 400, "bad_schema"),
        "heartbeat_version_ahead": (
            post(hb, '{"version": 99, "samples": 5, "samples_per_s": 1}'),
            409,
            "version_ahead",
        ),
        "heartbeat_unknown_peer": (
            post("/api/peers/nobody/heartbeat", '{"version": 0, "samples": 5, "samples_per_s": 1}'),
            404,
            "unknown_peer",
        ),
        "json_body_too_large": (post(hb, '{"pad": "' + "x" * 300_000 + '"}'), 413, "body_too_large"),
        "unknown_route": (lambda: _status_json(requests.get(url + "/api/nope", timeout=10)), 404, "not_found"),
        "wrong_method": (
            lambda: _status_json(requests.delete(url + "/api/status", timeout=10)),
            405,
            "method_not_allowed",
        ),
    }


def _nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"x": value}
    return value


def _status_json(response: requests.Response) -> tuple[int, dict]:
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, {"raw": response.text[:200]}


def test_bad_requests_get_4xx_json_and_leave_the_round_untouched(relay):
    num_params = requests.get(relay.url + "/api/run", timeout=10).json()["num_params"]
    peer = RawPeer(relay).join("raw")
    assert peer.heartbeat(samples=10).status_code == 200
    before_params = relay_params(relay, num_params)
    before = round_state(relay)
    assert before[3] is not None and before[3][2:] == (1, 0)  # a round is open, waiting for us

    failures = []
    for name, (send, status, code) in bad_requests(peer, num_params).items():
        got_status, body = send()
        if got_status != status or body.get("error") != code or not body.get("message"):
            failures.append(f"{name}: HTTP {got_status} {body} (wanted {status} {code})")
        after = round_state(relay)
        if after != before:
            failures.append(f"{name}: round state changed {before} -> {after}")
    assert not failures, "\n".join(failures)

    # None of it leaked into the reduction: one valid upload gives exactly its own SGD update.
    grad_sum = np.random.default_rng(1).standard_normal(num_params).astype(np.float32)
    response = peer.upload(peer.container(grad_sum))
    assert response.status_code == 200, response.text
    after_params = relay_params(relay, num_params, min_step=1)
    expected = before_params - grad_sum / np.float32(10)
    np.testing.assert_allclose(after_params, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.integration
@pytest.mark.parametrize("failure", ["peer_dies_mid_upload", "nan_in_second_chunk"])
def test_an_upload_that_stops_midway_counts_for_nothing(tmp_path, failure):
    """Issue 17: a contribution counts whole or not at all. An upload cut off (or refused for a
    NaN) in its second chunk leaves nothing of its first chunk in the step, and the round's
    record says it was refused."""
    relay = spawn_relay(tmp_path, OVERRIDES)
    try:
        num_params = requests.get(relay.url + "/api/run", timeout=10).json()["num_params"]
        chunk = 1 << 20
        a, b = RawPeer(relay).join("a"), RawPeer(relay).join("b")
        a.heartbeat(samples=10)
        b.heartbeat(samples=10)
        assert relay.status()["round"]["expected_peers"] == 2
        before_params = relay_params(relay, num_params)
        rng = np.random.default_rng(2)
        grad_a, grad_b = (rng.standard_normal(num_params).astype(np.float32) for _ in range(2))

        if failure == "peer_dies_mid_upload":
            body = a.container(grad_a)
            data_start = len(body) - grad_a.nbytes
            cut = data_start + chunk * 4 + 1000  # chunk 0 whole, chunk 1 partly
            raw_http(
                relay.port,
                f"PUT /api/rounds/0/gradient?peer_id={a.peer_id} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}",
                body[:cut],
                close_after_send=True,
            )
        else:
            poisoned = grad_a.copy()
            poisoned[chunk + 3] = np.nan
            assert a.upload(a.container(poisoned)).json()["error"] == "non_finite"
        relay.wait_for(lambda s: s["round"]["expected_peers"] == 1, what="the failed upload to be dropped")
        assert b.upload(b.container(grad_b)).status_code == 200
        after_params = relay_params(relay, num_params, min_step=1)

        mean = grad_b / np.float32(10)  # nothing of a's chunk 0, though it arrived whole and valid
        np.testing.assert_allclose(after_params, before_params - mean, rtol=1e-5, atol=1e-6)
        record = relay.status()["recent_rounds"][-1]
        assert record["contributors"] == 1 and record["samples"] == 10
        assert record["outcomes"] == {a.peer_id: "refused"}
        assert requests.get(relay.url + "/api/status", timeout=10).status_code == 200
    finally:
        relay.stop()
