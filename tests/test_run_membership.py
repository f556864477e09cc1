"""The membership every role shares (:mod:`toolkit.run_membership`): its backoff's bounds and jitter,
a rejoin when the relay forgot the peer id (once, however many threads find out; a trainer then
starts over on the relay's parameters), the recovery policy a role's loop applies, and a leave
that no heartbeat follows. The relays are real (in this
process); a relay that "lost its data dir" is a second relay the peer's proxy switches to, which
never knew the peer id."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

from relay_server.harness.process import wait_until
from tests.support.blip import BlipProxy
from tests.support.clock import Clock
from tests.support.training import params_of, regression_step
from toolkit.client import RelayClient
from toolkit.errors import ProtocolError, RelayRejected, RelayUnreachable
from toolkit.models import build_model
from toolkit.optimizer import CollaborativeOptimizer
from toolkit.run_membership import Backoff, Membership, waits_out
from toolkit.wire.protocol import PROTOCOL_VERSION, Heartbeat, JoinRequest, ModelSpec

SPEC = ModelSpec(factory="toolkit.models:MLP", kwargs={"sizes": [8, 16, 1]})


def request(name: str = "member") -> JoinRequest:
    return JoinRequest(peer_name=name, protocol=PROTOCOL_VERSION, device={"role": "test"})


def names(relay) -> list[str]:
    return [p["name"] for p in relay.status()["peers"]]


def test_backoff_doubles_from_first_to_the_cap_each_wait_jittered_down_by_at_most_its_fraction() -> None:
    backoff = Backoff(first_s=1.0, max_s=8.0, jitter=0.5, rng=random.Random(0))
    waits = [backoff.next() for _ in range(7)]
    ceilings = [1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0]
    assert all(c / 2 <= w <= c for w, c in zip(waits, ceilings)), waits
    assert len(set(waits)) == len(waits)  # jittered: no two hosts (or two failures) wait in step
    backoff.reset()
    assert 0.5 <= backoff.next() <= 1.0 and backoff.failures == 1


def test_backoff_is_deterministic_under_a_seed_and_exact_without_jitter() -> None:
    def draws(seed: int) -> list[float]:
        backoff = Backoff(rng=random.Random(seed))
        return [backoff.next() for _ in range(5)]

    assert draws(7) == draws(7) and draws(7) != draws(8)
    plain = Backoff(first_s=0.25, max_s=1.0, jitter=0.0)
    assert [plain.next() for _ in range(4)] == [0.25, 0.5, 1.0, 1.0]
    with pytest.raises(ValueError, match="first_s <= max_s"):
        Backoff(first_s=2.0, max_s=1.0)
    with pytest.raises(ValueError, match="jitter"):
        Backoff(jitter=1.0)


def test_what_a_role_waits_out_is_the_relay_away_cut_off_busy_or_forgetful_never_a_refusal() -> None:
    waited = [
        RelayUnreachable("relay_unreachable", "no answer"),
        RelayUnreachable("transfer_cut", "the download of slice [0, 8) was cut off"),
        RelayRejected("busy", "try later", status=503),
        RelayRejected("rate_limited", "slow down", status=429),
        RelayRejected("unknown_peer", "who?", status=404),
    ]
    decided_by_the_role = [
        RelayRejected("stage_too_large", "no stage fits", status=409),
        RelayRejected("bad_result", "rows do not match", status=422),
        RelayRejected("banned", "banned", status=403),
        ProtocolError("bad_work", "unreadable"),
    ]
    assert [waits_out(e) for e in waited] == [True] * len(waited)
    assert [waits_out(e) for e in decided_by_the_role] == [False] * len(decided_by_the_role)


def test_a_member_the_relay_forgot_joins_again_once_and_tells_its_role(serve_relay) -> None:
    """The proxy switches from the relay the member joined to one that never knew it (a relay
    that lost its data dir): the next heartbeat gets ``unknown_peer``, the member joins the new
    relay with the same request and calls ``on_rejoin`` with the new id; a second thread that
    found the old id gone as well does not join a second time."""
    first, second = serve_relay(name="first"), serve_relay(name="second")
    proxy = BlipProxy(first.port)
    rejoined: list[str] = []
    clock = Clock(100.0)
    member = Membership(
        RelayClient(proxy.url), request("host-a"), on_rejoin=lambda j: rejoined.append(j.peer_id), clock=clock
    )
    try:
        lost = member.join().peer_id
        assert member.last_beat_at == 100.0 and names(first) == ["host-a"]
        clock.now = 103.0
        assert member.beat().step == 0 and member.last_beat_at == 103.0
        proxy.upstream_port = second.port
        proxy.drop()  # the member's open connection goes; its next one reaches the second relay
        proxy.restore()
        state = member.beat()
        assert member.peer_id != lost and rejoined == [member.peer_id] and member.rejoins == 1
        assert state == member.state and names(second) == ["host-a"]
        member.rejoin(lost)  # the other thread, late: the id it lost was replaced already
        assert member.rejoins == 1 and rejoined == [member.peer_id] and names(second) == ["host-a"]
    finally:
        member.leave()
        member.client.close()
        proxy.close()


def test_recovery_rejoins_on_unknown_peer_and_backs_off_on_anything_else(serve_relay) -> None:
    relay = serve_relay()
    waits: list[float] = []
    member = Membership(RelayClient(relay.url), request(), backoff=Backoff(rng=random.Random(3)))
    try:
        member.join()
        away = RelayUnreachable("relay_unreachable", "no answer")
        assert not member.recover(away, waits.append) and not member.recover(away, waits.append)
        assert len(waits) == 2 and 0.5 <= waits[0] <= 1.0 and 1.0 <= waits[1] <= 2.0
        member.succeeded()
        assert not member.recover(RelayRejected("no_lease", "gone", status=409), waits.append)
        assert 0.5 <= waits[2] <= 1.0  # the success reset the backoff
        # a relay's unknown_peer for the current id: a join, no wait
        member.peer_id = "0" * 32
        assert member.recover(RelayRejected("unknown_peer", "not registered", status=404), waits.append)
        assert len(waits) == 3 and member.rejoins == 1 and len(member.peer_id) == 32 and member.peer_id != "0" * 32
        # the heartbeat thread rejoined first: recovery finds the current id alive and joins no more
        assert member.recover(RelayRejected("unknown_peer", "not registered", status=404), waits.append)
        assert member.rejoins == 1 and len(waits) == 3 and names(relay) == ["member", "member"]
    finally:
        member.leave()
        member.client.close()


def test_keep_alive_reports_the_roles_heartbeat_and_no_heartbeat_follows_the_leave(serve_relay) -> None:
    """The thread sends what the role reports; after ``leave()`` the relay lists the peer as gone
    and no later heartbeat re-admits it (the relay re-admits a peer id it remembers)."""
    relay = serve_relay()
    reports: list[int] = []

    def report() -> Heartbeat:
        reports.append(1)
        return Heartbeat(version=0, samples=3, samples_per_s=42.0)

    member = Membership(RelayClient(relay.url), request("beating"), report=report)
    try:
        member.join()
        member.keep_alive(0.05)
        wait_until(lambda: len(reports) >= 3, 30, "three heartbeats from the thread")
        peer = next(p for p in relay.status()["peers"] if p["name"] == "beating")
        assert peer["samples_per_s"] == 42.0
        member.leave()
        sent = len(reports)
        done = threading.Event()
        done.wait(0.3)  # six intervals: a heartbeat thread still running would have re-admitted it
        assert len(reports) == sent and names(relay) == []
        member.leave()  # once: a second leave sends nothing
    finally:
        member.client.close()


def test_a_trainer_the_relay_forgot_joins_again_and_trains_on_that_relays_parameters(serve_relay) -> None:
    """The trainer (``CollaborativeOptimizer``) is a member the same way: after one step on the
    first relay its proxy switches to a relay that never knew it; its next report joins again, the
    gradient it computed on the first relay's parameters is dropped, the second relay's parameters
    are downloaded in full, and its next micro-batch makes the second relay's first step."""
    config = {
        "run": {"target_batch": 4, "max_staleness": 0},
        "optimizer": {"name": "sgd", "lr": 0.01, "weight_decay": 0.0, "schedule": "constant"},
    }
    first, second = serve_relay(config, name="first"), serve_relay(config, name="second")
    proxy = BlipProxy(first.port)
    model = build_model(SPEC)
    try:
        with CollaborativeOptimizer(
            model, proxy.url, batch_size_per_step=4, report_interval_s=0.0, peer_name="trainer"
        ) as opt:
            regression_step(opt, model, 0)  # the target batch: the first relay's step 1
            lost = opt.peer_id
            assert opt.version == 1 and first.status()["step"] == 1
            proxy.upstream_port = second.port
            proxy.drop()
            proxy.restore()
            regression_step(opt, model, 1)
            assert opt.peer_id != lost and opt.membership.rejoins == 1 and names(second) == ["trainer"]
            assert opt.version == 0 and second.status()["step"] == 0  # nothing of the first relay's counted
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
            np.testing.assert_array_equal(flat, params_of(second.url))
            regression_step(opt, model, 2)
            assert opt.version == 1 and second.status()["step"] == 1 and opt.last_error is None
    finally:
        proxy.close()
