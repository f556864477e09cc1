"""Extra aggregator servers: a real relay, real aggregator processes and real peers on 127.0.0.1.

The plan cuts the vector among the relay and the aggregators; peers send each gradient slice to
its owner with the relay's ticket and download each updated slice from its owner, checked
against the relay-signed manifest. SGD with momentum makes every step checkable against one
process, and the momentum buffers must move with the slices for that to hold.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3

import numpy as np
import pytest
import requests
import torch

from relay_server.harness.process import wait_until
from tests.peer_worker import make_dataset
from tests.support.training import (
    FAST_AGGREGATORS,
    MODEL_KWARGS,
    rounds_from_events,
    sliced_plan,
    stored_params,
    train_sliced,
)
from toolkit.client import RelayClient
from toolkit.models import build_model
from toolkit.models.flat import flatten, load_flat
from toolkit.wire.protocol import ModelSpec

ALICE = "hf_alice_token_123456"
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0}


def reference_sgd(initial: np.ndarray, rounds: dict[int, list[int]], steps: int) -> np.ndarray:
    """One process, the same initial parameters, the same global batches, the same SGD."""
    data = make_dataset()
    model = build_model(ModelSpec(factory="toolkit.models:MLP", kwargs=MODEL_KWARGS))
    load_flat(model, initial)
    opt = torch.optim.SGD(model.parameters(), lr=SGD["lr"], momentum=SGD["momentum"])
    for step in range(steps):
        opt.zero_grad()
        model.loss(data[rounds[step]]).backward()
        opt.step()
    return flatten(model)


def divergence(initial: np.ndarray, rounds: dict[int, list[int]], steps: int, data_dirs, relay, peers) -> dict:
    """Where a run stopped matching one process, and what the logs say happened around then (a
    failure message: which step, which owner died or lost a slice, whether the relay stalled)."""
    first = None
    for step in range(1, steps + 1):
        try:
            stored = stored_params(step, data_dirs, initial.size)
        except AssertionError:
            continue
        reference = reference_sgd(initial, rounds, step)
        if np.linalg.norm(stored - reference) / np.linalg.norm(reference) > 1e-5:
            first = step
            break
    marks = ("is dead", "restored from", "stalled", "plan ")
    relay_lines = [line[:200] for line in relay.log_path.read_text().splitlines() if any(m in line for m in marks)]
    peer_lines = [
        line[:200]
        for p in peers
        for line in p.log_path.read_text().splitlines()
        if "slice_lost" in line or "did not take our done" in line
    ]
    with sqlite3.connect(relay.data_dir / "relay.sqlite") as db:
        samples = dict(db.execute("SELECT step, samples FROM rounds"))
    mismatched = {s: (len(ids), samples.get(s + 1)) for s, ids in rounds.items() if len(ids) != samples.get(s + 1)}
    return {
        "first_diverging_version": first,
        "relay": relay_lines[-30:],
        "peers": peer_lines[:10],
        "samples (events, relay) where they differ": mismatched,
    }


def peer_hashes(peers) -> dict[int, set[str]]:
    by_step: dict[int, set[str]] = {}
    for peer in peers:
        for event in peer.events():
            if event["event"] in ("version", "done"):
                by_step.setdefault(event["step"], set()).add(event["sha"])
    return by_step


def signed_params(url: str, min_step: int = 0) -> tuple[int, np.ndarray]:
    """The relay's published version, as a logged-in peer downloads it: the manifest is signed by
    the relay and every slice is checked against it."""
    client = RelayClient(url)
    client.login(ALICE)
    out = np.empty(client.get_run().num_params, dtype=np.float32)
    step = client.params.download_params(out, min_step=min_step, wait_s=30)
    client.close()
    assert step is not None
    return step, out


def test_aggregators_share_the_vector_and_one_dies_mid_run(
    start_relay, start_aggregators, launch_peer, hf_standin, monkeypatch
):
    """Coordinator + 2 aggregators + 3 peers, in a signed run (HF login: tickets from signed
    requests, chunk digests required by the aggregators, the manifest signed by the relay)."""
    hf_standin.add_user(ALICE, "alice")
    monkeypatch.setenv("COLLAB_TEST_TOKEN", ALICE)
    relay = start_relay(
        {
            "auth": {"mode": "hf", "hf_endpoint": hf_standin.url, "allow_users": ["alice"]},
            "optimizer": SGD,
            "run": {"target_batch": 48},
            "aggregators": FAST_AGGREGATORS,
        }
    )
    _, initial = signed_params(relay.url)
    aggregators = start_aggregators(relay, "agg0", "agg1", wait=False)
    # The plan slices the vector among the relay and both aggregators, solved from measurements.
    peers, sliced_at, status = train_sliced(
        relay, aggregators, launch_peer, 4, seed=10, extra=("--hf-token-env", "COLLAB_TEST_TOKEN")
    )
    # The planner re-solves when a measurement changes materially: on a loaded machine the first
    # 3-way plan may predate the peers' first measured download, so wait for the one that has it.
    status = relay.wait_for(
        lambda s: (
            len(sliced_plan(s)) == 3
            and any(i["role"] == "peer" and i["download_source"] == "measured" for i in s["plan"]["inputs"])
        ),
        timeout_s=60,
        what="a 3-way plan solved from a peer's measured download",
    )
    slices = sliced_plan(status)
    assert {s["url"] for s in slices} == {"", *(a.url for a in aggregators)}, slices
    assert slices[0]["start"] == 0 and slices[-1]["end"] == status["num_params"]
    assert all(a["end"] == b["start"] for a, b in zip(slices, slices[1:]))
    assert abs(sum(s["fraction"] for s in slices) - 1) < 1e-9
    inputs = {i["node_id"]: i for i in status["plan"]["inputs"]}
    assert inputs["relay"]["role"] == "relay" and inputs["relay"]["samples_per_s"] == 0
    measured_peers = [i for i in inputs.values() if i["role"] == "peer" and i["download_source"] == "measured"]
    assert measured_peers and all(i["download"] > 0 and i["samples_per_s"] > 0 for i in measured_peers), inputs

    def one_plan():  # a re-plan may land between the two requests: read them until they agree on the version
        plan, now = requests.get(relay.url + "/api/plan", timeout=10).json(), relay.status()
        return (plan, now) if plan["version"] == now["plan"]["version"] else None

    plan, now = wait_until(one_plan, 30, "/api/plan and /api/status on the same plan version")
    assert plan["slices"] == sliced_plan(now)

    # SIGKILL one aggregator mid-run; the others go on.
    victim = aggregators[0]
    victim_id = next(s["aggregator_id"] for s in slices if s["url"] == victim.url)
    before_kill = relay.status()["step"]
    victim.kill()
    status = relay.wait_for(lambda s: s["step"] >= before_kill + 6, timeout_s=90, what="six more steps")
    assert all(s["aggregator_id"] != victim_id for s in status["plan"]["slices"]), status["plan"]
    assert not next(a for a in status["plan"]["aggregators"] if a["aggregator_id"] == victim_id)["alive"]
    for peer in peers:
        peer.proc.terminate()  # leave cleanly
        assert peer.wait() == 0, peer.log_path.read_text()[-3000:]

    # No step lost or applied twice; every peer holds the relay's bits at every version it loaded.
    final_step, final = signed_params(relay.url)
    steps = relay.round_steps()
    assert steps == list(range(1, final_step + 1)), steps
    hashes = peer_hashes(peers)
    assert all(len(shas) == 1 for shas in hashes.values()), hashes
    assert hashes.get(final_step, {hashlib.sha256(final.tobytes()).hexdigest()}) == {
        hashlib.sha256(final.tobytes()).hexdigest()
    }
    for peer in peers:
        versions = [e["step"] for e in peer.events() if e["event"] == "version"]
        assert versions == sorted(set(versions)), versions

    # Up to the kill, training was exactly one process's large-batch SGD (slices moved with momentum).
    data_dirs = [relay.data_dir, *(a.data_dir for a in aggregators)]
    at_kill = stored_params(before_kill, data_dirs, final.size)
    rounds = rounds_from_events(peers)
    reference = reference_sgd(initial, rounds, before_kill)
    relative = np.linalg.norm(at_kill - reference) / np.linalg.norm(reference)
    if relative > 1e-5:
        why = divergence(initial, rounds, before_kill, data_dirs, relay, peers)
        pytest.fail(f"relative difference {relative:.3g} from one process at the kill\n" + json.dumps(why, indent=1))
    assert np.linalg.norm(at_kill - initial) / np.linalg.norm(initial) > 1e-3  # it did train
    assert hashes[before_kill] == {hashlib.sha256(at_kill.tobytes()).hexdigest()}
    info = requests.get(aggregators[1].url + "/api/status", timeout=10).json()
    assert info["upload"] > 0 and info["download"] > 0, info  # the survivor measured its transfers


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["int8", "topk2-64"])
def test_relay_restart_gathers_the_slices_back(start_relay, start_aggregators, launch_peer, compression):
    """SIGKILL the relay while an aggregator owns a slice: the restarted relay pulls that slice's
    state from the aggregator, resumes at the same step, and training goes on with no step lost.
    With lossy compression (int8, sparse topk2): slices travel as deltas, error feedback per slice range."""
    relay = start_relay(
        {"optimizer": SGD, "run": {"target_batch": 32, "compression": compression}, "aggregators": FAST_AGGREGATORS}
    )
    (agg,) = start_aggregators(relay, "agg", wait=False)
    peers = [
        launch_peer(
            relay.url,
            f"p{i}",
            seed=i,
            batch_size=4,
            steps=10_000,
            extra=("--wait-aggregators", "1", "--wait-peers", "2", "--sleep-per-batch", "0.02"),
        )
        for i in range(2)
    ]
    agg.wait_registered()
    status = relay.wait_for(
        lambda s: len(sliced_plan(s)) == 2 and s["step"] >= 3, timeout_s=90, what="steps under a sliced plan"
    )
    relay.kill()
    persisted = relay.durable_step()
    assert persisted >= status["step"]
    relay.start()
    assert relay.status()["step"] == persisted  # every slice came back from its owner: nothing lost
    relay.wait_for(
        lambda s: len(sliced_plan(s)) == 2 and s["step"] >= persisted + 4,
        timeout_s=90,
        what="training to go on, sliced again",
    )
    for peer in peers:
        peer.proc.terminate()
        assert peer.wait() == 0, peer.log_path.read_text()[-3000:]
    steps = relay.round_steps()
    assert steps == list(range(1, max(steps) + 1)), steps
    hashes = peer_hashes(peers)
    assert all(len(shas) == 1 for shas in hashes.values()), hashes
