"""Issue 17, the upload findings: a refused upload moved the parameters silently, and a ban took
back less than the record said. Same in-process hf-mode relay as ``tests/test_hostile_peers.py``;
the model is ``toolkit.models:Vector`` with two reducer chunks and SGD at lr 1 from zeros, so the
new parameters are exactly minus the mean gradient and every stray value is visible."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from relay_server.api.context import COLLAB
from relay_server.backbone.slice_owner import SliceOwner
from relay_server.core.config import OptimizerSection
from relay_server.harness.process import wait_until
from relay_server.harness.thread import RelayThread
from relay_server.rounds.master import MasterState, NonFiniteStep
from relay_server.rounds.publisher import Publisher
from relay_server.rounds.reducer import CHUNK_ELEMS
from relay_server.rounds.store import RoundLog, Store
from tests.support.peers import SignedPeer, signed_container
from tests.support.relays import snapshot
from toolkit.wire.auth import digest_metadata
from toolkit.wire.compression import get_codec, run_codecs
from toolkit.wire.protocol import GradientMeta, Heartbeat, ParamSpec, StatusReport
from toolkit.wire.tensor_container import encode_header

NUM = CHUNK_ELEMS + 4096  # two chunks: the first is reduced before the second arrives
TWO_CHUNKS = {"model": {"factory": "toolkit.models:Vector", "kwargs": {"numel": NUM}}}


def open_round(relay: RelayThread) -> tuple[SignedPeer, SignedPeer]:
    """Alice and bob each report 5 samples: a round of 10 opens, waiting for both."""
    alice, bob = SignedPeer.login(relay, "alice").join("alice-nb"), SignedPeer.login(relay, "bob").join("bob-nb")
    for peer in (alice, bob):
        peer.client.heartbeat(peer.peer_id, Heartbeat(version=0, samples=5, samples_per_s=10.0))
    assert relay.status()["round"]["expected_peers"] == 2
    return alice, bob


def params_after(relay: RelayThread, peer: SignedPeer, step: int) -> np.ndarray:
    out = np.empty(NUM, np.float32)
    assert peer.client.params.download_params(out, min_step=step, wait_s=30, peer_id=peer.peer_id) == step
    return out


def reducer_state(relay: RelayThread) -> tuple:
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
    response = bob.send(
        signed_container(bob, head, head + altered.tobytes(), f"/api/rounds/0/gradient?peer_id={bob.peer_id}")
    )
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
    relay = relay_factory(
        **TWO_CHUNKS,
        rounds={
            "aggregation": aggregation,
            "heartbeat_interval_s": 1.0,
            "peer_ttl_s": 600.0,
            "deadline_initial_s": 600.0,
            "deadline_floor_s": 600.0,
            "deadline_ceiling_s": 600.0,
        },
    )
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


# --- issue 41: nothing non-finite is ever published ---------------------------------------------
RUN = {"target_batch": 10, "max_staleness": 0, "precision": ""}


def two_peers_of(relay: RelayThread, user: str) -> tuple[SignedPeer, SignedPeer]:
    """Two notebooks of one volunteer, 5 samples each: a round of 10 opens, waiting for both."""
    peers = SignedPeer.login(relay, user).join(f"{user}-1"), SignedPeer.login(relay, user).join(f"{user}-2")
    for peer in peers:
        peer.client.heartbeat(peer.peer_id, Heartbeat(version=0, samples=5, samples_per_s=10.0))
    assert relay.status()["round"]["expected_peers"] == 2
    return peers


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_two_finite_uploads_whose_float32_sum_overflows_are_refused(relay_factory, codec: str) -> None:
    """Two peers of one user each sent 3e38 per value -- finite, so accepted -- and the float32
    sum overflowed: the relay published a version of infinities. With int8 the decoded values
    (up to FLT_MAX by the codec's own bound) were not even checked. Now each chunk's norm is
    bounded as it is staged: both uploads are refused whole, the reduction is as before, the
    relay keeps serving, and the next honest uploads make exactly their step."""
    relay = relay_factory(**TWO_CHUNKS, run=RUN | {"compression": codec})
    first, second = two_peers_of(relay, "eve")
    before = reducer_state(relay)
    for peer in (first, second):
        response = peer.upload(np.full(NUM, 3e38, np.float32), codec=codec, samples=5)
        assert (response.status_code, response.json()["error"]) == (422, "gradient_too_large"), response.text
        assert "Nothing of this upload was counted" in response.json()["hint"]
    assert reducer_state(relay) == before
    status = relay.status()  # still serializes
    assert status["step"] == 0 and status["refused_steps"] == 0
    for peer, value in ((first, 5.0), (second, 15.0)):  # the same round takes their honest uploads
        assert peer.upload(np.full(NUM, value, np.float32), codec=codec, samples=5).status_code == 200
    params = params_after(relay, first, 1)
    assert np.isfinite(params).all()
    want = np.full(NUM, -2.0, np.float32)  # -(5 + 15) / 10
    if codec == "none":
        np.testing.assert_array_equal(params, want)
    else:  # int8 rounds each value to its block's scale: within 1e-5 here
        np.testing.assert_allclose(params, want, rtol=1e-5)
    record = relay.status()["recent_rounds"][-1]
    assert (record["contributors"], record["samples"]) == (2, 10)


def test_one_upload_whose_squares_overflow_float32_cannot_blind_the_status(relay_factory) -> None:
    """1e22 per value is finite, but its square is not in float32: the accepted upload made the
    step's grad_norm inf, the round log stored it, and every GET /api/status failed from then on.
    Now the upload is refused (its chunk norm is past 1.8e19), the honest peer's round applies
    alone, and its record carries a finite grad_norm."""
    relay = relay_factory(**TWO_CHUNKS)
    alice, bob = open_round(relay)
    response = alice.upload(np.full(NUM, 1e22, np.float32), samples=5)
    assert (response.status_code, response.json()["error"]) == (422, "gradient_too_large"), response.text
    assert bob.upload(np.full(NUM, 5.0, np.float32), samples=5).status_code == 200
    alice.client.leave(alice.peer_id)
    np.testing.assert_array_equal(params_after(relay, bob, 1), np.full(NUM, -1.0, np.float32))
    record = relay.status()["recent_rounds"][-1]
    assert record["grad_norm"] == pytest.approx(np.sqrt(NUM), rel=1e-6)
    assert record["outcomes"] == {alice.peer_id: "refused"}


def test_an_inf_grad_norm_already_in_the_round_log_cannot_break_the_status(relay_factory) -> None:
    """A data dir written before the fix may hold the attack's inf grad_norm: the status shows
    it as null, and a record committed now stores NULL rather than inf."""
    relay = relay_factory(**TWO_CHUNKS)
    store = relay.app[COLLAB].store
    relay.call(
        lambda: store.db.execute(
            "INSERT INTO rounds (step, finalized_at, contributors, samples, loss, duration_s, deadline_s, finalized_by, "
            "lr, grad_norm) VALUES (1, 0, 1, 5, 1e308 * 10, 1.0, 1.0, 'all_arrived', 1.0, 1e308 * 10)"
        )
    )
    record = relay.status()["recent_rounds"][-1]
    assert (record["step"], record["loss"], record["grad_norm"]) == (1, None, None)
    relay.call(
        lambda: store.commit(
            2,
            "0" * 64,
            RoundLog(
                contributions={},
                loss=math.inf,
                duration_s=1.0,
                deadline_s=1.0,
                finalized_by="all_arrived",
                lr=1.0,
                grad_norm=math.nan,
            ),
        )
    )
    assert relay.call(lambda: store.recent_rounds()[-1][3]) is None  # loss, as stored


def test_the_status_report_serializes_whatever_number_reaches_it() -> None:
    """The last guard: should any statistic still be NaN or Inf, ``GET /api/status`` shows null
    there instead of failing for every observer (json.dumps with allow_nan=False raised)."""
    report = StatusReport(
        run_name="r",
        step=1,
        total_steps=0,
        finished=False,
        target_batch=10,
        num_params=4,
        samples_accumulated=0,
        samples_per_s=math.inf,
        eta_s=None,
        loss=math.nan,
        num_peers=0,
        peers=[],
        recent_rounds=[],
        round=None,
        auth_mode="hf",
        uptime_s=1.0,
    )
    body = json.loads(report.dumps())
    assert (body["samples_per_s"], body["loss"], body["step"]) == (None, None, 1)


def test_a_step_that_would_overflow_the_parameters_is_refused_counted_and_not_applied(relay_factory) -> None:
    """Accepted, bounded uploads can still make a step overflow -- here through the run's own
    learning rate (1e30 times a mean of 2e9). The relay checks the new parameters and optimizer
    state before committing: the step is refused and counted, nothing is published, the master
    is exactly as before, and the next round on the same version applies exactly."""
    lr = 1e30
    relay = relay_factory(**TWO_CHUNKS, optimizer={"name": "sgd", "lr": lr, "weight_decay": 0.0, "momentum": 0.0})
    alice, bob = open_round(relay)
    before = snapshot(relay)
    for peer in (alice, bob):
        assert peer.upload(np.full(NUM, 1e10, np.float32), samples=5).status_code == 200
    status = relay.wait_for(lambda s: s["refused_steps"] == 1 and s["round"] is None, what="the refused step")
    assert status["step"] == 0 and status["recent_rounds"] == []
    # the round's sum is zeroed on the reducer's thread, off the critical path, after the round
    # closes: wait for that (a sum never zeroed times out here), then compare everything
    after = wait_until(lambda: (taken := snapshot(relay))["sum"] == before["sum"] and taken, 30, "the sum zeroed")
    for key in ("sum", "weights", "step", "rounds_logged", "contributions"):  # as before the round opened
        assert after[key] == before[key], key
    np.testing.assert_array_equal(params_after(relay, alice, 0), np.zeros(NUM, np.float32))
    for peer in (alice, bob):  # the next round, on version 0 again, with gradients this lr can take
        peer.client.heartbeat(peer.peer_id, Heartbeat(version=0, samples=5, samples_per_s=10.0))
    relay.wait_for(lambda s: s["round"] is not None, what="the next round")
    for peer in (alice, bob):
        assert peer.upload(np.full(NUM, 5e-30, np.float32), samples=5).status_code == 200
    param = torch.zeros(NUM, requires_grad=True)  # the step the relay must make, by torch itself
    param.grad = torch.from_numpy((np.full(NUM, 5e-30, np.float32) * 2) / np.float32(10))
    torch.optim.SGD([param], lr=lr).step()
    np.testing.assert_array_equal(params_after(relay, alice, 1), param.detach().numpy())
    assert relay.status()["refused_steps"] == 1


def test_local_sgd_pseudo_gradients_whose_sum_overflows_are_refused(relay_factory) -> None:
    """Same attack on ``run.mode = "local_sgd"``, whose peers upload pseudo-gradients with a
    low-bit codec: two int8 uploads decoding to 3e38 per value are refused whole, the outer step
    that follows applies only the honest pseudo-gradients, exactly (outer SGD at lr 1)."""
    relay = relay_factory(
        **TWO_CHUNKS,
        run=RUN | {"mode": "local_sgd", "compression": "int8"},
        local_sgd={"inner_steps": 3, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False},
    )
    first, second = two_peers_of(relay, "eve")
    before = reducer_state(relay)
    for peer in (first, second):
        response = peer.upload(np.full(NUM, 3e38, np.float32), codec="int8", samples=5)
        assert (response.status_code, response.json()["error"]) == (422, "gradient_too_large"), response.text
    assert reducer_state(relay) == before
    assert relay.status()["local_sgd"]["outer_round"] == 0
    for peer in (first, second):
        assert peer.upload(np.full(NUM, 0.5, np.float32), codec="int8", samples=5).status_code == 200
    params = params_after(relay, first, 1)
    np.testing.assert_allclose(params, np.full(NUM, -0.1, np.float32), rtol=1e-5)  # -(0.5 + 0.5) / 10
    assert relay.status()["recent_rounds"][-1]["grad_norm"] == pytest.approx(0.1 * np.sqrt(NUM), rel=1e-5)


# --- the master's refusal, on its own: real optimizer, real store and state files ---------------
LAYOUT = [ParamSpec(name="w", shape=[4, 2], offset=0), ParamSpec(name="b", shape=[8], offset=8)]
ADAMW = OptimizerSection(name="adamw", lr=0.01, weight_decay=0.1)


def adam_master(codec: str, directory) -> tuple[MasterState, Publisher]:
    """An AdamW master one honest step in (so its state is not empty), version 1 on disk."""
    master = MasterState(LAYOUT, np.linspace(-1, 1, 16).astype(np.float32), ADAMW, total_steps=0)
    publisher = Publisher(Store(directory), get_codec(codec), master)
    publisher.write(0, {})
    master.grad.fill_(0.5)
    publisher.write(publisher.apply_step().step, {})
    return master, publisher


def state_of(master: MasterState, publisher: Publisher) -> dict:
    return {name: value.tobytes() for name, value in master.export_state().items()} | {
        "public": publisher.public.tobytes(),
        "step": master.step,
    }


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_a_step_that_overflows_adams_state_leaves_the_master_exactly_as_it_was(tmp_path, codec: str) -> None:
    """1e21 per value is a finite gradient with a finite float64 norm, and AdamW's parameters
    stay finite (m / sqrt(v) -> 0), but ``exp_avg_sq`` (0.001 g * g) is inf in float32:
    published, that state would poison every later step. (The reducer refuses such uploads, so
    this is the check behind the bound.) The step is refused, the parameters, both moments, the
    step counters and the public copy are exactly as before (reloaded from version 1's file),
    and the next honest step is the one a master that never saw the attack makes."""
    master, publisher = adam_master(codec, tmp_path / "attacked")
    twin, twin_publisher = adam_master(codec, tmp_path / "twin")
    before = state_of(master, publisher)
    master.grad.fill_(1e21)
    with pytest.raises(NonFiniteStep, match="exp_avg_sq") as refused:
        publisher.apply_step()
    assert refused.value.touched
    assert state_of(master, publisher) == before
    for m, p in ((master, publisher), (twin, twin_publisher)):
        m.grad.fill_(0.25)
        p.write(p.apply_step().step, {})
    assert state_of(master, publisher) == state_of(twin, twin_publisher)


def test_the_steps_norm_is_finite_where_float32_squares_overflow(tmp_path) -> None:
    """A mean gradient of 1e20 per value: finite, but float32 ``vector_norm`` said inf (and the
    round log stored it). In float64 it is 4e20 and the SGD step is applied."""
    sgd = OptimizerSection(name="sgd", lr=1.0, weight_decay=0.0, momentum=0.0)
    master = MasterState(LAYOUT, np.zeros(16, np.float32), sgd, total_steps=0)
    master.grad.fill_(1e20)
    report = master.apply_gradient()
    assert report.grad_norm == pytest.approx(4e20, rel=1e-6) and report.step == 1
    np.testing.assert_array_equal(master.flat.numpy(), np.full(16, -1e20, np.float32))


def test_a_slice_whose_step_would_overflow_is_published_unchanged(tmp_path) -> None:
    """A slice owner steps in lock-step with the others (the relay commits every slice's next
    version together): a refused step publishes the slice unchanged as that version -- the same
    bytes as before, counted -- and never a non-finite one."""
    owner = SliceOwner(
        LAYOUT,
        {"params": np.linspace(-1, 1, 16).astype(np.float32)},
        start=0,
        end=16,
        step=0,
        optimizer=ADAMW,
        total_steps=0,
        codecs=run_codecs("none"),
        store=Store(tmp_path),
    )
    first = owner.write_initial()
    before = state_of(owner.master, owner.publisher)
    owner.master.grad.fill_(1e21)
    version, report = owner.apply_round(meaned=True)
    assert (version.step, report.step, owner.refused_steps) == (1, 1, 1)
    assert version.sha256 == first.sha256
    assert state_of(owner.master, owner.publisher) == before | {"step": 1}
