"""Integration: a real relay and real peer processes on 127.0.0.1. The relay is a process where
the test kills and restarts it, and is served in this process otherwise (conftest's ``serve_relay``)."""

from __future__ import annotations

import hashlib
import os
import signal
import sqlite3
import time

import numpy as np
import pytest
import torch

from tests.peer_worker import make_dataset
from tests.support.training import MODEL_KWARGS, relay_params, rounds_from_events, train_together
from toolkit.client import RelayClient
from toolkit.models import build_model
from toolkit.models.flat import flatten, load_flat
from toolkit.wire.protocol import PROTOCOL_VERSION, Heartbeat, JoinRequest, ModelSpec


def test_applied_update_is_the_exact_sample_weighted_mean(serve_relay, launch_peer):
    relay = serve_relay(
        {"optimizer": {"name": "sgd", "lr": 1.0, "weight_decay": 0.0, "momentum": 0.0}, "run": {"target_batch": 150}}
    )
    _, before = relay_params(relay.url)
    # 20 ms per micro-batch: the round fills in ~250 ms, so a peer the scheduler held back for a few
    # tens of milliseconds at its start still reports before it opens (all three must be in it).
    peers = [
        launch_peer(
            relay.url, f"p{i}", seed=i, batch_size=b, steps=1, extra=("--wait-peers", "3", "--sleep-per-batch", "0.02")
        )
        for i, b in enumerate((3, 5, 7))
    ]
    for peer in peers:
        assert peer.wait() == 0, peer.log_path.read_text()[-2000:]
    step, after = relay_params(relay.url, min_step=1)
    ids = rounds_from_events(peers)[0]
    assert len(ids) >= 150 and len({p.name for p in peers if any(e["event"] == "round" for e in p.events())}) == 3

    model = build_model(ModelSpec(factory="toolkit.models:MLP", kwargs=MODEL_KWARGS))
    load_flat(model, before)
    model.loss(make_dataset()[ids]).backward()
    mean_grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
    np.testing.assert_allclose(after, before - mean_grad, rtol=1e-5, atol=1e-6)
    assert relay.status()["recent_rounds"][0]["samples"] == len(ids)


def test_three_peers_equal_one_process_with_the_same_global_batch(serve_relay, launch_peer):
    steps = 5
    relay = serve_relay({"run": {"target_batch": 48}})
    _, initial = relay_params(relay.url)
    _, final, rounds = train_together(relay, launch_peer, steps=steps, batch_sizes=(4, 6, 8), seed=10)
    # Samples a peer computed on a version whose round closed without it are dropped (strict
    # max_staleness=0); they are in no round, so the reference below does not see them either.

    # The reference: one process, same initial parameters, same global batches, same AdamW.
    data = make_dataset()
    model = build_model(ModelSpec(factory="toolkit.models:MLP", kwargs=MODEL_KWARGS))
    load_flat(model, initial)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=0.01,
        betas=(0.9, 0.99),
        eps=1e-8,
    )
    for step in range(steps):
        opt.zero_grad()
        model.loss(data[rounds[step]]).backward()
        opt.step()
    reference = flatten(model)
    relative = np.linalg.norm(final - reference) / np.linalg.norm(reference)
    assert relative <= 1e-5, relative
    assert np.linalg.norm(final - initial) / np.linalg.norm(initial) > 1e-3  # it did train


def test_peer_killed_mid_round_does_not_block_the_others(serve_relay, launch_peer):
    # A 20 s upload window and a 2 s peer TTL: if the round closes well before 20 s, it was
    # because the relay noticed the dead peer, not because the deadline passed.
    relay = serve_relay(
        {
            "run": {"target_batch": 96, "max_staleness": 1},
            "rounds": {"deadline_floor_s": 20.0, "deadline_initial_s": 20.0},
        }
    )
    paced = ("--wait-peers", "3", "--sleep-per-batch", "0.02")
    survivors = [launch_peer(relay.url, f"p{i}", seed=i, batch_size=4, steps=6, extra=paced) for i in range(2)]
    victim = launch_peer(
        relay.url, "victim", seed=9, batch_size=4, steps=6, extra=(*paced, "--freeze-before-upload", "2")
    )
    status = relay.wait_for(
        lambda s: (
            s["round"] is not None
            and s["round"]["step"] >= 2
            and s["round"]["expected_peers"] == 3
            and s["round"]["received_peers"] == 2
            and any(e["event"] == "freezing" for e in victim.events())
        ),
        what="a round waiting for the frozen victim",
    )
    waiting_step = status["round"]["step"]
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait()
    status = relay.wait_for(lambda s: s["step"] > waiting_step, timeout_s=30, what="the round to finalize")
    record = next(r for r in status["recent_rounds"] if r["step"] == waiting_step + 1)
    assert record["contributors"] == 2 and record["finalized_by"] == "all_arrived", record
    assert record["duration_s"] < record["deadline_s"] / 2, record
    for peer in survivors:
        assert peer.wait() == 0, peer.log_path.read_text()[-2000:]
    assert all(p["name"] != "victim" for p in relay.status()["peers"])


def test_late_joiner_gets_current_parameters_and_contributes(serve_relay, launch_peer):
    relay = serve_relay({"run": {"target_batch": 32}})
    early = [launch_peer(relay.url, f"p{i}", seed=i, batch_size=4, steps=10_000) for i in range(2)]
    relay.wait_for(lambda s: s["step"] >= 3, what="step 3")
    late = launch_peer(relay.url, "late", seed=7, batch_size=4, steps=10_000)
    relay.wait_for(
        lambda s: any(e["event"] == "round" for e in late.events()),
        timeout_s=120,
        what="the late joiner's first contribution",
    )
    for peer in [*early, late]:
        peer.proc.terminate()  # SIGTERM = leave cleanly, like closing the tab
        assert peer.wait() == 0, peer.log_path.read_text()[-2000:]
    joined = next(e for e in late.events() if e["event"] == "joined")
    assert joined["step"] >= 3
    # The parameters it started from are exactly the relay's for that version.
    from safetensors.numpy import load_file

    stored = load_file(str(relay.data_dir / "state" / f"step-{joined['step']:08d}.safetensors"))["params"]
    assert hashlib.sha256(stored.tobytes()).hexdigest() == joined["sha"]
    first = min(e["step"] for e in late.events() if e["event"] == "round")
    assert first >= joined["step"]
    with sqlite3.connect(relay.data_dir / "relay.sqlite") as db:
        credited = db.execute("SELECT samples_contributed FROM peers WHERE name = 'late'").fetchone()[0]
    assert credited > 0  # the relay applied and credited its samples


def test_relay_killed_and_restarted_loses_no_step(start_relay, launch_peer):
    relay = start_relay({"run": {"target_batch": 32}})
    peers = [launch_peer(relay.url, f"p{i}", seed=i, batch_size=4, steps=8) for i in range(2)]
    relay.wait_for(lambda s: s["step"] >= 3, what="step 3")
    relay.kill()
    persisted = relay.durable_step()
    time.sleep(1.0)
    relay.start()
    assert relay.status()["step"] == persisted  # resumed exactly where the durable state was
    for peer in peers:
        assert peer.wait(timeout_s=120) == 0, peer.log_path.read_text()[-3000:]
    steps = relay.round_steps()
    assert steps == list(range(1, max(steps) + 1)) and max(steps) >= 8  # contiguous: none lost, none twice
    for peer in peers:
        versions = [e["step"] for e in peer.events() if e["event"] == "version"]
        assert versions == sorted(set(versions)), versions  # never went backwards or repeated
    assert os.path.exists(relay.data_dir / "state" / f"step-{max(steps):08d}.safetensors")


def test_delayed_updates_overlap_rounds_with_compute_and_stay_consistent(serve_relay, launch_peer):
    # One step of staleness allowed: peers keep computing on version v while round v runs.
    relay = serve_relay({"run": {"target_batch": 32, "max_staleness": 1}})
    peers = [
        launch_peer(relay.url, f"p{i}", seed=i, batch_size=4, steps=6, extra=("--delayed", "--wait-peers", "2"))
        for i in range(2)
    ]
    for peer in peers:
        assert peer.wait() == 0, peer.log_path.read_text()[-2000:]
    from safetensors.numpy import load_file

    for peer in peers:
        versions = [e for e in peer.events() if e["event"] == "version"]
        assert versions and versions[-1]["step"] >= 6
        for event in versions[-2:]:  # the parameters it loaded are exactly the relay's for that version
            path = relay.data_dir / "state" / f"step-{event['step']:08d}.safetensors"
            if path.exists():  # older versions are pruned (keep_checkpoints)
                assert hashlib.sha256(load_file(str(path))["params"].tobytes()).hexdigest() == event["sha"]
    rounds = [r for r in relay.status()["recent_rounds"] if r["step"] >= 1]
    assert all(r["loss"] is not None for r in rounds) and rounds[-1]["loss"] < rounds[0]["loss"]
    # Regression: the two threads' progress reports once raced, and the relay refused honest uploads.
    assert not any("samples_exceed_report" in p.log_path.read_text() for p in peers)


@pytest.mark.parametrize("policy, opens_after", [("reported", 4), ("projected", 3)])
def test_a_round_opens_when_the_target_is_in_sight(serve_relay, policy: str, opens_after: int) -> None:
    """Three peers adding micro-batches of 8 toward a target of 32, reporting in turn. "reported"
    opens at 32 reported (each other peer then adds the batch it was computing: up to 48 applied);
    "projected" counts those batches in flight and opens at 24 reported (about 32 applied)."""
    relay = serve_relay({"run": {"target_batch": 32}, "rounds": {"open_round": policy}})
    client = RelayClient(relay.url)
    peers = [client.join(JoinRequest(peer_name=f"p{i}", protocol=PROTOCOL_VERSION)).peer_id for i in range(3)]
    opened = None
    for n, (who, samples) in enumerate([(0, 8), (1, 8), (2, 8), (0, 16), (1, 16)], start=1):
        state = client.heartbeat(peers[who], Heartbeat(version=0, samples=samples, samples_per_s=10.0))
        if state.round is not None:
            opened = n
            break
    client.close()
    assert opened == opens_after
