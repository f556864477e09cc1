"""What observers see of a ``run.mode = "local_sgd"`` run (issue 26): the relay's status keeps
each peer's inner steps and busy fraction from its heartbeats, the outer loop's state, and the
training bytes both ways per applied sample; the volunteer's panel says where the peer's inner
loop stands. Real relay (in this process), real toolkit peers, real HTTP.

The byte counts are checked against what the test knows: every upload and every download carries
the 4-byte float32 vector of the run's parameters plus a container header, so the relay's counts
lie between N x 4P and N x (4P + a header's worth).
"""

from __future__ import annotations

import math
import re
import threading

import pytest
import requests

from relay_server.harness.process import wait_until
from tests.support.local_sgd import BATCH, PATIENT, SGD1, batches, join, local_run, train, train_until
from tests.support.peers import RawPeer
from toolkit.errors import ProtocolError
from toolkit.notebook.panel import PeerProgress
from toolkit.wire.protocol import Heartbeat

H = 3
HEADER_ROOM = 1024  # a container header (JSON: the tensor's name, dtype, shape, the round's metadata)


def test_status_shows_each_peers_inner_steps_busy_fraction_and_bytes_per_sample(serve_relay) -> None:
    relay = serve_relay(
        local_run(SGD1 | {"lr": 0.05}, inner_steps=H, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
        | {"run": {"mode": "local_sgd", "target_batch": 10_000, "max_staleness": 0}}
    )
    peers = [join(relay.url) for _ in range(2)]  # each downloads the parameters in full on joining
    num_params = peers[0][1].run.num_params
    errors: list[BaseException] = []

    def two_outer_rounds(model, opt, seed: int) -> None:
        try:
            train_until(model, opt, batches(H, seed=seed), 2)
        except BaseException as exc:  # noqa: BLE001 (re-raised by the test's thread below)
            errors.append(exc)

    # the relay waits for every live peer on the version: both contribute to both rounds
    threads = [threading.Thread(target=two_outer_rounds, args=(m, o, i)) for i, (m, o) in enumerate(peers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    for model, opt in peers:
        assert opt.local_sgd.outer_rounds == 2 and opt.local_sgd.late_rounds == 0
        opt.zero_grad()
        model.loss(batches(1, seed=9)[0]).backward()
        opt.step()  # inner step 1 of H: no outer round

    # After its own report, the relay holds a heartbeat built no earlier than it; the busy fraction
    # only grows while a peer computes or idles (its waiting is over), so the relay's value lies
    # between the peer's before and after.
    before = []
    for _, opt in peers:
        before.append(opt.local_sgd.busy_fraction)
        opt.report_progress()
    status = relay.status()
    after = [opt.local_sgd.busy_fraction for _, opt in peers]
    shown = {p["peer_id"]: p for p in status["peers"]}
    for (_, opt), low, high in zip(peers, before, after):
        peer = shown[opt.peer_id]
        assert peer["inner_steps"] == 1
        assert 0 < low <= peer["busy_fraction"] <= high < 1  # it waited in two outer rounds
    local = status["local_sgd"]
    assert (local["outer_round"], local["inner_steps"], local["inner_seconds"]) == (2, H, 0.0)
    assert local["inner_steps_last_round"] == H  # both pseudo-gradients of round 2 came from H inner steps
    assert min(before) <= local["busy_fraction"] <= max(after)
    assert status["config"]["mode"] == "local_sgd"

    traffic = status["traffic"]
    samples = 2 * 2 * H * BATCH  # rounds x peers x inner steps x batch
    uploads, downloads = 2 * 2, 2 * 3  # each peer: one pseudo-gradient per round; joining and each round's result
    assert traffic["samples"] == samples
    vector = 4 * num_params
    assert uploads * vector < traffic["up_bytes"] <= uploads * (vector + HEADER_ROOM), traffic
    assert downloads * vector < traffic["down_bytes"] <= downloads * (vector + HEADER_ROOM), traffic
    assert traffic["up_bytes_per_sample"] == pytest.approx(traffic["up_bytes"] / samples)
    assert traffic["down_bytes_per_sample"] == pytest.approx(traffic["down_bytes"] / samples)

    # the volunteer's panel: where this peer's inner loop stands
    rows = dict(PeerProgress.from_optimizer(peers[0][1], loss=None, first_contribution_s=None).rows())
    assert re.fullmatch(rf"inner step 1 of {H}, 2 outer rounds counted, 0 late, busy \d+ %", rows["local SGD"])
    for _, opt in peers:
        opt.close()


@pytest.mark.parametrize("busy", [1.5, -0.1, math.nan, math.inf])
def test_a_busy_fraction_out_of_range_or_not_finite_is_refused(busy: float) -> None:
    with pytest.raises(ProtocolError, match="busy_fraction"):
        Heartbeat.from_json(
            {"version": 0, "samples": 0, "samples_per_s": 0.0, "inner_steps": 1, "busy_fraction": busy}
        )


def test_the_relay_refuses_such_a_heartbeat_and_keeps_the_last_good_one(serve_relay) -> None:
    relay = serve_relay(local_run(SGD1, inner_steps=H) | {"rounds": {"peer_ttl_s": 600.0}})
    peer = RawPeer(relay).join("p")
    assert peer.heartbeat(0, inner_steps=2, busy_fraction=0.5).ok
    for bad in ("1.5", "-0.1", "NaN", "Infinity"):  # the last two: JSON extensions Python's parser reads
        response = requests.post(
            f"{relay.url}/api/peers/{peer.peer_id}/heartbeat",
            timeout=10,
            data=f'{{"version": 0, "samples": 0, "samples_per_s": 1.0, "inner_steps": 3, "busy_fraction": {bad}}}',
            headers={"Content-Type": "application/json"},
        )
        assert response.status_code == 400 and "busy_fraction" in response.text, (bad, response.text)
    [shown] = relay.status()["peers"]
    assert (shown["inner_steps"], shown["busy_fraction"]) == (2, 0.5)


def test_every_run_counts_what_the_relay_sends_full_and_delta(serve_relay) -> None:
    """A sync int8 run: a peer one version behind downloads the int8 delta, sent like the full body
    (its length known, so counted; it once went out as a file response the counters saw as 0 bytes)."""
    relay = serve_relay(
        {
            "run": {"target_batch": BATCH, "max_staleness": 0, "compression": "int8"},
            "optimizer": SGD1 | {"lr": 0.1},
            "rounds": PATIENT,
        }
    )
    train(relay.url, batches(2), 2)  # joins (full body), then a delta after each of its two steps
    counted = relay.status()["traffic"]["down_bytes"]
    get = lambda **query: requests.get(relay.url + "/api/params", params={"min_step": 2, **query}, timeout=30)  # noqa: E731
    full, delta = get(), get(have=1)
    assert full.headers["X-Collab-Step"] == delta.headers["X-Collab-Step"] == "2"
    assert b'"kind":"delta"' in delta.content and b'"dtype":"I8"' in delta.content  # int8, not float32
    assert counted == len(full.content) + 2 * len(delta.content)  # the peer took both deltas, no fallback
    # /api/status is shared for up to a second while the step and the peers stay the same
    traffic = wait_until(lambda: (t := relay.status()["traffic"])["down_bytes"] != counted and t, 30, "a new report")
    assert traffic["down_bytes"] == counted + len(full.content) + len(delta.content)
    assert relay.admin("GET", "/params/egress").json()["direct"] == traffic["down_bytes"]
    assert traffic["samples"] == 2 * BATCH and traffic["down_bytes_per_sample"] == traffic["down_bytes"] / (2 * BATCH)
