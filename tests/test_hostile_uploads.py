"""Issue 17, the upload findings: a refused upload moved the parameters silently, and a ban took
back less than the record said. Same in-process hf-mode relay as ``tests/test_hostile_peers.py``;
the model is ``toolkit.models:Vector`` with two reducer chunks and SGD at lr 1 from zeros, so the
new parameters are exactly minus the mean gradient and every stray value is visible."""

from __future__ import annotations

import numpy as np
import pytest

from relay_server.rounds.reducer import CHUNK_ELEMS
from tests.support.peers import SignedPeer, signed_container
from tests.support.relays import InProcessRelay, snapshot
from toolkit.wire.auth import digest_metadata
from toolkit.wire.protocol import GradientMeta, Heartbeat
from toolkit.wire.tensor_container import encode_header

NUM = CHUNK_ELEMS + 4096  # two chunks: the first is reduced before the second arrives
TWO_CHUNKS = {"model": {"factory": "toolkit.models:Vector", "kwargs": {"numel": NUM}}}


def open_round(relay: InProcessRelay) -> tuple[SignedPeer, SignedPeer]:
    """Alice and bob each report 5 samples: a round of 10 opens, waiting for both."""
    alice, bob = SignedPeer.login(relay, "alice").join("alice-nb"), SignedPeer.login(relay, "bob").join("bob-nb")
    for peer in (alice, bob):
        peer.client.heartbeat(peer.peer_id, Heartbeat(version=0, samples=5, samples_per_s=10.0))
    assert relay.status()["round"]["expected_peers"] == 2
    return alice, bob


def params_after(relay: InProcessRelay, peer: SignedPeer, step: int) -> np.ndarray:
    out = np.empty(NUM, np.float32)
    assert peer.client.download_params(out, min_step=step, wait_s=30, peer_id=peer.peer_id) == step
    return out


def reducer_state(relay: InProcessRelay) -> tuple:
    state = snapshot(relay)
    return state["sum"], state["weights"]


def test_a_refused_upload_leaves_nothing_in_the_step(relay_factory) -> None:
    """Bob's upload had NaN in chunk 2 and got 422 "this contribution is dropped", but chunk 1
    had been reduced and stayed: after alice's honest upload chunk 1 was off by up to 127.9 and
    the record showed only alice. Now nothing of bob's upload enters the sum, the step is exactly
    alice's, and the record says bob's upload was refused."""
    relay = relay_factory(**TWO_CHUNKS)
    alice, bob = open_round(relay)
    before = reducer_state(relay)
    poisoned = np.full(NUM, 1000.0, np.float32)
    poisoned[CHUNK_ELEMS + 3] = np.nan
    response = bob.upload(poisoned, samples=5)
    body = response.json()
    assert (response.status_code, body["error"]) == (422, "non_finite")
    assert "Nothing of this upload was counted" in body["hint"]  # and that is now true:
    assert reducer_state(relay) == before
    assert alice.upload(np.full(NUM, 5.0, np.float32), samples=5).status_code == 200
    bob.client.leave(bob.peer_id)  # the round stops waiting for bob (a refused body is not waited for anyway)
    params = params_after(relay, alice, 1)
    np.testing.assert_array_equal(params, np.full(NUM, -1.0, np.float32))  # exactly alice's mean, both chunks
    record = relay.status()["recent_rounds"][-1]
    assert (record["contributors"], record["samples"]) == (1, 5)
    assert record["outcomes"] == {bob.peer_id: "refused"}


def test_a_digest_mismatch_in_the_second_chunk_counts_for_nothing(relay_factory) -> None:
    """Same attack through the signature: chunk 2 does not match its signed digest (401)."""
    relay = relay_factory(**TWO_CHUNKS)
    alice, bob = open_round(relay)
    before = reducer_state(relay)
    grad = np.full(NUM, 1000.0, np.float32)
    tensors = [("payload", grad)]
    meta = GradientMeta(peer_id=bob.peer_id, step=0, version=0, samples=5, loss_sum=1.0)
    head = encode_header(tensors, {"collab": meta.dumps().decode(), "codec": "none", **digest_metadata(tensors)})
    altered = grad.copy()
    altered[-1] = 999.0  # in the second chunk: the first one verified (and used to be reduced)
    response = bob.send(signed_container(bob, head, head + altered.tobytes(),
                                          f"/api/rounds/0/gradient?peer_id={bob.peer_id}"))
    assert (response.status_code, response.json()["error"]) == (401, "chunk_digest_mismatch"), response.text
    assert reducer_state(relay) == before
    assert alice.upload(np.full(NUM, 5.0, np.float32), samples=5).status_code == 200
    bob.client.leave(bob.peer_id)
    np.testing.assert_array_equal(params_after(relay, alice, 1), np.full(NUM, -1.0, np.float32))


@pytest.mark.parametrize("aggregation", ["mean", "centered_clip"])
def test_a_ban_after_the_upload_counted_says_what_it_could_take_back(relay_factory, aggregation: str) -> None:
    """A ban rolls back nothing silently: with the mean bob's committed gradient stays (the answer
    and the record say "banned_kept", with the rollback hint); CenteredClip takes it out and the
    record says "banned_removed" -- and the step shows which happened."""
    relay = relay_factory(**TWO_CHUNKS, rounds={"aggregation": aggregation, "heartbeat_interval_s": 1.0,
                                                "peer_ttl_s": 600.0, "deadline_initial_s": 600.0,
                                                "deadline_floor_s": 600.0, "deadline_ceiling_s": 600.0})
    alice, bob = open_round(relay)
    assert bob.upload(np.full(NUM, 15.0, np.float32), samples=5).status_code == 200  # bob's mean: 3
    answer = relay.admin("POST", "/bans", json={"username": "bob", "reason": "test"}).json()
    try:
        kept = aggregation == "mean"
        assert (answer["contributions_kept"], answer["contributions_removed"]) == ((1, 0) if kept else (0, 1))
        assert ("roll back" in answer.get("hint", "")) == kept
        assert alice.upload(np.full(NUM, 5.0, np.float32), samples=5).status_code == 200  # alice's mean: 1
        params = params_after(relay, alice, 1)
        want = -(15.0 + 5.0) / 10 if kept else -1.0
        np.testing.assert_allclose(params, np.full(NUM, want, np.float32), rtol=1e-6)
        record = relay.status()["recent_rounds"][-1]
        assert record["outcomes"] == {bob.peer_id: "banned_kept" if kept else "banned_removed"}
        assert record["samples"] == (10 if kept else 5)
    finally:
        relay.admin("DELETE", "/bans/bob")
