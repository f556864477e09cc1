"""``[local_sgd] overlap`` (issue 26's communication hidden behind compute): the one-step-delayed
outer update. Real relays on 127.0.0.1 (in-process, or peer processes where one is killed or the
relay is restarted), real clients.

- Three outer rounds of one peer equal, to 1e-5, a replay in this process of the one-step-delayed
  update with the rebases where the peer made them (its inner steps carried onto each new global
  version, the inner momentum kept), and the run ends with the model on the final global
  parameters.
- A peer whose round is in flight reports the version it will rebase onto, and the relay counts
  the last round's contributors as working on the new version, so the next round waits for them;
  a late one is dropped and rebased.
- A peer SIGKILLed mid-round does not stall the other; a relay killed and restarted mid-run loses
  no round; ``close()`` with a round in flight returns, on global parameters.
"""

from __future__ import annotations

import hashlib
import signal
import threading

import numpy as np
import torch
from safetensors.numpy import load_file

from relay_server.harness.process import wait_until
from relay_server.local_sgd.outer_rounds import OuterRoundRule
from relay_server.rounds.peer_registry import Peer, Registry
from tests.support.local_sgd import (
    BATCH,
    PATIENT,
    SGD1,
    batches,
    inner_step,
    join,
    local_run,
    relative_difference,
    train,
)
from tests.support.peers import RawPeer
from tests.support.training import params_of
from toolkit.client import RelayClient
from toolkit.models import build_model
from toolkit.models.flat import flatten, load_flat
from toolkit.optimizer.inner import inner_optimizer
from toolkit.wire.protocol import Heartbeat

OVERLAP = {"inner_steps": 4, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False, "overlap": True}


def test_overlap_is_the_one_step_delayed_update_with_the_peers_rebases(serve_relay) -> None:
    """One peer, H = 4, inner SGD with momentum, outer Nesterov SGD, three outer rounds. After the
    first inner step of each round in flight the test lets the round's result arrive, so the
    peer rebases after 1 or 2 carried steps (it records which); the replay applies the same
    rebases: x <- theta_{t+1} + (x - x_snapshot), pseudo-gradient theta_t - x at each budget end."""
    inner = SGD1 | {"lr": 0.05, "momentum": 0.9}
    h, rounds = 4, 3
    relay = serve_relay(
        local_run(inner, inner_steps=h, outer_lr=0.7, outer_momentum=0.9, nesterov=True, overlap=True)
        | {
            "run": {
                "mode": "local_sgd",
                "target_batch": BATCH,
                "max_staleness": 0,
                "compression": "none",
                "total_steps": rounds,
            }
        }
    )
    data = batches(5)
    init = params_of(relay.url)
    model, opt = join(relay.url)
    local = opt.local_sgd
    assert local is not None and local.overlap
    i = 0
    while not opt.finished:
        inner_step(model, opt, data[i % len(data)])
        i += 1
        if local.snapshot is not None and local.steps == 1:  # a round in flight: let its result arrive
            wait_until(
                lambda: local.snapshot is None or (opt.rounds.pending is not None and opt.rounds.pending.done()),
                60,
                "the outer round's result",
            )
    final = params_of(relay.url, rounds)
    np.testing.assert_array_equal(flatten(model), final)  # the run ended with the model on the global parameters
    assert (local.outer_rounds, local.late_rounds, opt.samples) == (rounds, 0, 0)
    carried = dict(local.rebases)
    assert sorted(carried)[: rounds - 1] == list(range(1, rounds)) and all(1 <= carried[v] < h for v in carried)
    assert 0 < local.busy_fraction <= 1

    replay = build_model(RelayClient(relay.url).get_run().model)
    load_flat(replay, init)
    inner_opt = inner_optimizer(list(replay.named_parameters()), inner)
    theta = torch.nn.Parameter(torch.from_numpy(init.copy()))
    outer = torch.optim.SGD([theta], lr=0.7, momentum=0.9, nesterov=True)
    snapshot, j = None, 0
    for version in range(rounds):  # the inner loop whose pseudo-gradient is on version `version`
        base = theta.detach().clone()
        for step in range(1, h + 1):
            replay.zero_grad()
            replay.loss(data[j % len(data)]).backward()
            inner_opt.step()
            j += 1
            if snapshot is not None and step == carried[version]:
                load_flat(replay, base + (torch.from_numpy(flatten(replay)) - snapshot))
                snapshot = None
        snapshot = torch.from_numpy(flatten(replay).copy())
        theta.grad = base - snapshot
        outer.step()
    assert relative_difference(final, theta.detach().numpy()) <= 1e-5
    assert relative_difference(final, init) > 1e-3
    opt.close()


def test_overlap_a_peer_with_a_round_in_flight_is_waited_for_on_the_next_version(serve_relay) -> None:
    """Both peers' pseudo-gradients on version 0 go out in the background; peer b has not taken a
    step since, so it still holds version 0 -- but it reports version 1, the one it will rebase
    onto, and the outer round on 1 waits for it instead of opening for a alone."""
    relay = serve_relay(
        local_run(SGD1 | {"lr": 0.05}, **OVERLAP | {"inner_steps": 2})
        | {
            "run": {"mode": "local_sgd", "target_batch": 10_000, "max_staleness": 0},
            "local_sgd": {**OVERLAP, "inner_steps": 2, "straggler_wait_s": 600.0},
        }
    )
    data = batches(4)
    (model_a, a), (model_b, b) = join(relay.url, "a"), join(relay.url, "b")
    for peer_model, peer in ((model_a, a), (model_b, b)):
        inner_step(peer_model, peer, data[0])
        inner_step(peer_model, peer, data[1])  # budget spent: round 0 opens once both finished
    wait_until(lambda: relay.status()["step"] == 1, 60, "outer round 0")
    wait_until(lambda: b.rounds.pending is not None and b.rounds.pending.done(), 60, "peer b's round result")
    b.report_progress()  # learns that the relay is at 1 ...
    b.report_progress()  # ... and says so
    assert b.version == 0 and b.local_sgd.snapshot is not None  # not rebased: no step since
    wait_until(
        lambda: {p["name"]: p["version"] for p in relay.status()["peers"]}["b"] == 1,
        10,
        "the relay to list b on version 1",
    )  # (its status is cached for a second)
    wait_until(lambda: a.rounds.pending is not None and a.rounds.pending.done(), 60, "peer a's round result")
    inner_step(model_a, a, data[2])  # rebases onto 1
    inner_step(model_a, a, data[3])  # budget spent on version 1
    assert a.version == 1 and a.local_sgd.flight_version == 1 and a.local_sgd.rebases == [(1, 1)]
    status = relay.status()
    assert status["step"] == 1 and status["round"] is None  # waiting for b, working on 1
    inner_step(model_b, b, data[2])
    inner_step(model_b, b, data[3])
    status = wait_until(lambda: (s := relay.status())["step"] == 2 and s, 60, "outer round 1")
    assert [r["contributors"] for r in status["recent_rounds"]] == [2, 2]
    a.close()
    b.close()
    for peer_model in (model_a, model_b):  # close() left both on the newest global parameters
        np.testing.assert_array_equal(flatten(peer_model), params_of(relay.url, 2))


def test_the_outer_round_waits_for_the_last_rounds_contributors_until_they_report_the_new_version() -> None:
    """A peer that sent its pseudo-gradient to the round that made version 1 works on 1 from then
    on, even before it reports it (with overlap it may not have heard of 1 yet): the round on 1
    waits for it as for a peer that reported 1, and never for a peer that did not contribute."""
    registry, rule = Registry(ttl_s=60.0), OuterRoundRule(target_batch=10_000, straggler_wait_s=600.0)
    a, b, _idle = (
        registry.add(Peer(peer_id=n, name=n, username="u", device={}, precision=None)) for n in ("a", "b", "idle")
    )
    registry.report(a, Heartbeat(version=1, samples=BATCH, samples_per_s=1.0))  # finished on 1
    assert rule.due(registry, 1)  # b and idle are on 0: not waited for
    rule.published(1, ["a", "b"])
    assert not rule.due(registry, 1)  # b made 1 with a: its loop on 1 runs
    registry.report(b, Heartbeat(version=1, samples=0, samples_per_s=1.0))
    assert not rule.due(registry, 1)
    registry.report(b, Heartbeat(version=1, samples=BATCH, samples_per_s=1.0))
    assert rule.due(registry, 1)  # everyone working on 1 finished; idle (on 0, never contributed) is not waited for


def test_overlap_a_late_pseudo_gradient_is_dropped_and_the_peer_rebased(serve_relay) -> None:
    """As without overlap, but the slow peer's late pseudo-gradient is dropped at its budget end and
    the peer rebases at once (nothing carried yet): back on the global parameters exactly."""
    relay = serve_relay(
        local_run(SGD1 | {"lr": 0.05}, **OVERLAP | {"inner_steps": 2})
        | {"run": {"mode": "local_sgd", "target_batch": 2 * BATCH, "max_staleness": 0}}
    )
    data = batches(2)
    (fast_model, fast), (slow_model, slow) = join(relay.url), join(relay.url)
    inner_step(slow_model, slow, data[0])
    inner_step(fast_model, fast, data[0])
    inner_step(fast_model, fast, data[1])  # the round opens for the fast peer's samples alone
    wait_until(lambda: relay.status()["step"] == 1, 60, "the fast peer's outer round")
    inner_step(slow_model, slow, data[1])  # budget spent, on version 0: late
    assert (slow.local_sgd.late_rounds, slow.local_sgd.outer_rounds, slow.version, slow.samples) == (1, 0, 1, 0)
    np.testing.assert_array_equal(flatten(slow_model), params_of(relay.url, 1))
    assert [r["contributors"] for r in relay.status()["recent_rounds"]] == [1]
    fast.close()
    slow.close()


def test_overlap_close_with_a_round_in_flight_returns_on_global_parameters(serve_relay) -> None:
    """A raw peer that reported samples and never uploads holds the round open (patient deadline):
    the toolkit peer's upload is in, its wait for the result in flight when it closes."""
    relay = serve_relay(
        local_run(SGD1 | {"lr": 0.05}, **OVERLAP | {"inner_steps": 1})
        | {
            "run": {"mode": "local_sgd", "target_batch": 10_000, "max_staleness": 0},
            "rounds": {**PATIENT, "peer_ttl_s": 600.0},
        }
    )
    init = params_of(relay.url)
    silent = RawPeer(relay).join("silent")
    assert silent.heartbeat(10).ok  # finished its budget: the round will expect it
    model, opt = join(relay.url)
    inner_step(model, opt, batches(1)[0])  # budget spent: the round opens, the upload goes out
    wait_until(lambda: (relay.status()["round"] or {}).get("received_peers") == 1, 60, "the peer's upload")
    assert opt.rounds.pending is not None and not opt.rounds.pending.done()
    opt.close(finish_round_s=0.2)
    assert relay.status()["step"] == 0 and opt.samples == 0 and opt.local_sgd.snapshot is None
    np.testing.assert_array_equal(flatten(model), init)  # the global parameters it holds, not its own


def test_overlap_a_peer_killed_mid_round_does_not_stall_the_other(serve_relay, launch_peer) -> None:
    """The slow peer process takes part in round 0, reports version 1 (it will rebase onto it) and
    is SIGKILLed during its next inner loop, which the round on 1 waits for: the relay drops it
    at its TTL and the in-process peer goes on to step 3."""
    relay = serve_relay(
        local_run(SGD1 | {"lr": 0.05}, **OVERLAP | {"inner_steps": 2})
        | {"run": {"mode": "local_sgd", "target_batch": 10_000, "max_staleness": 0}}
    )
    slow = launch_peer(relay.url, "slow", seed=1, batch_size=BATCH, steps=100, extra=("--sleep-per-batch", "3"))
    wait_until(lambda: relay.status()["num_peers"] == 1, 120, "the slow peer to join")

    def kill_once_on_version_one() -> None:
        wait_until(
            lambda: any(p["name"] == "slow" and p["version"] == 1 for p in relay.status()["peers"]),
            180,
            "the slow peer on version 1",
        )
        slow.proc.send_signal(signal.SIGKILL)

    killer = threading.Thread(target=kill_once_on_version_one, daemon=True)
    killer.start()
    train(relay.url, batches(4), 3)
    killer.join(timeout=5)
    assert slow.proc.poll() is not None
    rounds = {r["step"]: r for r in relay.status()["recent_rounds"]}
    assert rounds[1]["contributors"] == 2 and rounds[3]["contributors"] == 1, rounds


def test_overlap_survives_a_relay_killed_and_restarted_mid_run(start_relay, launch_peer) -> None:
    """Two peer processes with rounds in flight behind their inner steps; the relay is SIGKILLed and
    restarted from its data dir. It resumes at its durable step, no outer round is lost or applied
    twice, the peers carry on to the end, and each one leaves on the relay's parameters of the
    version it last loaded (close() puts the global parameters back)."""
    relay = start_relay(local_run(SGD1 | {"lr": 0.05}, **OVERLAP | {"inner_steps": 2}))
    peers = [
        launch_peer(relay.url, f"p{i}", seed=i, batch_size=BATCH, steps=8, extra=("--wait-peers", "2"))
        for i in range(2)
    ]
    relay.wait_for(lambda s: s["step"] >= 3, timeout_s=120, what="outer round 3")
    relay.kill()
    persisted = relay.durable_step()
    relay.start()
    assert relay.status()["step"] == persisted  # resumed exactly where the durable state was
    for peer in peers:
        assert peer.wait(timeout_s=180) == 0, peer.log_path.read_text()[-3000:]
    steps = relay.round_steps()
    assert steps == list(range(1, max(steps) + 1)) and max(steps) >= 8, steps  # contiguous: none lost or twice
    for peer in peers:
        events = peer.events()
        versions = [e["step"] for e in events if e["event"] == "version"]
        assert versions == sorted(set(versions)), versions  # never went backwards or repeated
        done = next(e for e in events if e["event"] == "done")
        stored = load_file(str(relay.data_dir / "state" / f"step-{done['step']:08d}.safetensors"))["params"]
        assert hashlib.sha256(stored.tobytes()).hexdigest() == done["sha"], done
