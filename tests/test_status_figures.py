"""The figures ``/api/status`` and every heartbeat answer give are the relay's own (issue 35).

A DMoE run's dashboard once showed 32,574 samples/s, the sum of its peers' self-reports, while its
rounds applied 0.8: the collaboration's samples/s is now what the relay's rounds applied over the
time they took, and a peer's self-report is listed as such, capped where the peer's own progress
reports make it implausible. Peers are listed in their role. (The browser's view of the same
figures on a real DMoE run: tests/test_dashboard.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import requests

from relay_server.harness.process import wait_until
from relay_server.rounds.throughput import measured_samples_per_s
from tests.support.peers import OVERRIDES, SAMPLES, RawPeer
from toolkit.wire.protocol import PROTOCOL_VERSION

ABSURD = 5e6  # samples/s: what a peer with a broken clock (or a liar) may claim; the schema allows up to 1e7


def run_rounds(relay, peer: RawPeer, rounds: int) -> None:
    """``rounds`` real rounds of SAMPLES samples each, every heartbeat claiming ABSURD samples/s."""
    num_params = relay.status()["num_params"]
    for step in range(rounds):
        answer = peer.heartbeat(SAMPLES, version=step, samples_per_s=ABSURD)
        assert answer.ok, answer.text
        wait_until(lambda: relay.status()["round"], 30, f"round {step}")
        grad = np.full(num_params, 0.001, np.float32)
        upload = peer.upload(peer.container(grad, peer.meta(step=step, version=step, samples=SAMPLES)), step=step)
        assert upload.ok, upload.text
        wait_until(lambda: relay.status()["step"] > step, 30, f"step {step + 1}")


def test_samples_per_s_is_what_the_rounds_applied_not_what_peers_claim(serve_relay) -> None:
    relay = serve_relay(OVERRIDES)
    peer = RawPeer(relay).join("braggart")
    run_rounds(relay, peer, 4)
    status = relay.status()
    rounds = status["recent_rounds"]
    assert [r["samples"] for r in rounds] == [SAMPLES] * 4
    # 3 rounds' samples after the first round's end, over at least the time they took (longer once idle)
    rounds_rate = 3 * SAMPLES / (rounds[-1]["finalized_at"] - rounds[0]["finalized_at"])
    assert status["samples_per_s_rounds"] == 3
    assert 0 < status["samples_per_s"] <= rounds_rate * 1.000001, (status["samples_per_s"], rounds_rate)
    state = peer.heartbeat(0, version=4, samples_per_s=ABSURD).json()  # what the peers' panels show
    assert 0 < state["samples_per_s"] <= rounds_rate * 1.000001
    # The claim is listed as the peer's own, cut to 10x what its reports' growth (40 samples) makes plausible.
    (me,) = status["peers"]
    assert me["role"] == "trainer" and me["samples_per_s_capped"] is True
    assert 0 < me["samples_per_s"] < ABSURD
    assert status["reported_samples_per_s"] == pytest.approx(me["samples_per_s"])


def test_an_expert_host_is_listed_as_a_host_without_a_trainers_figures(serve_relay) -> None:
    """A host joins saying so (``toolkit.moe.host`` does): no device "unknown", no samples/s."""
    relay = serve_relay(OVERRIDES)
    joined = requests.post(
        relay.url + "/api/peers/join",
        timeout=10,
        json={"peer_name": "gpu-box", "protocol": PROTOCOL_VERSION, "device": {"role": "expert_host"}},
    ).json()
    requests.post(
        f"{relay.url}/api/peers/{joined['peer_id']}/heartbeat",
        timeout=10,
        json={"version": 0, "samples": 0, "samples_per_s": 123.0},
    ).raise_for_status()
    (host,) = relay.status()["peers"]
    assert (host["role"], host["device"], host["samples_per_s"], host["experts_hosted"]) == ("expert_host", "", 0.0, 0)
    assert relay.status()["reported_samples_per_s"] == 0.0


def test_a_stalled_run_s_measured_rate_falls_with_the_wait() -> None:
    """Five rounds of 10 samples in 10 s: 5 samples/s while rounds keep coming; once none finished
    for longer than those rounds took, the wait counts (20 s idle: 50 samples over 20 s)."""
    points = [(100.0 + 2 * i, 10) for i in range(6)]
    assert measured_samples_per_s(points) == (pytest.approx(5.0), 5)
    assert measured_samples_per_s(points, now=112.0)[0] == pytest.approx(5.0)
    assert measured_samples_per_s(points, now=130.0)[0] == pytest.approx(2.5)
    assert measured_samples_per_s(points[:1]) == (None, 0)
