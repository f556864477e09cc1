"""Low-bandwidth mode, ``run.mode = "local_sgd"`` (issue 26): peers run the inner optimizer for a
budget, upload one pseudo-gradient (global - local) per outer round, the relay applies the outer
SGD. Real relays on 127.0.0.1 (in-process, or a peer process where one is killed), real clients.

- H = 1 with inner SGD lr 1 and outer SGD lr 1 without momentum is sync mode: same parameters
  after three rounds, to 1e-5 relative; with a warmup and a decay, the inner steps follow the
  schedule sync mode's relay applies.
- One outer round with inner AdamW and outer Nesterov SGD equals ``init - lr (1 + mu) (init -
  local)`` computed in this process (the sign others shipped wrong), and lowers the loss.
- A peer SIGKILLed mid-inner-loop does not stall the outer round (the relay drops it at its TTL);
  a pseudo-gradient that misses its round is dropped, counted, and its peer moves on; a live
  peer that never finishes delays the round only for ``local_sgd.straggler_wait_s``.
- Hostile pseudo-gradients (NaN, wrong shape, oversized) are refused and change nothing.
- With a time budget a peer 20x slower contributes to every outer round beside the fast one (slow).
- CenteredClip bounds a huge (finite) pseudo-gradient; an aggregator owns a slice of the outer
  step in a signed run, with the outer optimizer and its momentum.
- ``[local_sgd] overlap``: ``test_local_sgd_overlap.py``.
- What the mode does not support yet is refused at load time in one line.
"""

from __future__ import annotations

import signal
import threading

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from relay_server.core.config import ConfigError, load_config
from relay_server.harness.process import wait_until
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
from tests.support.processes import merged, write_config
from tests.support.relays import snapshot
from tests.support.training import params_of
from toolkit.client import RelayClient
from toolkit.models import build_model
from toolkit.models.flat import flatten, load_flat
from toolkit.optimizer import CollaborativeOptimizer
from toolkit.optimizer.inner import inner_optimizer
from toolkit.wire.protocol import Heartbeat


@pytest.mark.parametrize("schedule", [{}, {"schedule": "linear", "warmup_steps": 2}], ids=["constant", "schedule"])
def test_one_inner_step_at_lr_one_is_sync_mode(serve_relay, schedule) -> None:
    """With a schedule (lr 0.5, 1, 1, 0.5: warmup over 2 steps, linear decay to 0 at step 4) the
    inner steps follow the relay's schedule step for step."""
    steps = 4 if schedule else 3
    data = batches(steps)
    inner, run = {**SGD1, **schedule}, {"total_steps": steps} if schedule else {}
    sync = serve_relay(
        {"run": {"target_batch": BATCH, "max_staleness": 0, **run}, "optimizer": inner, "rounds": PATIENT}, name="sync"
    )
    local = local_run(inner, inner_steps=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    local = serve_relay(local | {"run": {**local["run"], **run}}, name="local")
    init = params_of(sync.url)
    np.testing.assert_array_equal(init, params_of(local.url))  # same seed, same start
    train(sync.url, data, steps)
    opt = train(local.url, data, steps)
    assert opt.local_sgd is not None and opt.local_sgd.outer_rounds == steps
    a, b = params_of(sync.url, steps), params_of(local.url, steps)
    assert relative_difference(a, init) > 1e-3  # three real steps were taken
    assert relative_difference(b, a) <= 1e-5


def test_one_outer_step_is_the_pseudo_gradient_step_and_lowers_the_loss(serve_relay) -> None:
    inner = {"name": "adamw", "lr": 0.02, "weight_decay": 0.01, "betas": [0.9, 0.99], "eps": 1e-8}
    relay = serve_relay(local_run(inner, inner_steps=5, outer_lr=0.7, outer_momentum=0.9, nesterov=True))
    fixed = batches(1, seed=7)
    init = params_of(relay.url)
    train(relay.url, fixed, 1)
    after = params_of(relay.url, 1)
    # the same inner loop, in this process
    model = build_model(RelayClient(relay.url).get_run().model)
    load_flat(model, init)
    named = list(model.named_parameters())
    optimizer = inner_optimizer(named, {**inner, "momentum": 0.0})
    for _ in range(5):
        optimizer.zero_grad()
        model.loss(fixed[0]).backward()
        optimizer.step()
    local = flatten(model)
    expected = init - 0.7 * (1 + 0.9) * (init - local)  # Nesterov's first step: (1 + mu) x the gradient
    assert relative_difference(after, expected) <= 1e-5

    def loss_at(params: np.ndarray) -> float:
        load_flat(model, params)
        with torch.no_grad():
            return float(model.loss(fixed[0]))

    assert loss_at(after) < loss_at(init)


def test_a_peer_killed_mid_inner_loop_does_not_stall_the_outer_round(serve_relay, launch_peer) -> None:
    relay = serve_relay(
        local_run(SGD1 | {"lr": 0.05}, inner_steps=4, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
        | {"run": {"mode": "local_sgd", "target_batch": 10_000, "max_staleness": 0}}
    )
    slow = launch_peer(relay.url, "slow", seed=1, batch_size=BATCH, steps=5, extra=("--sleep-per-batch", "600"))
    wait_until(lambda: relay.status()["num_peers"] == 1, 120, "the slow peer to join")
    fast = launch_peer(relay.url, "fast", seed=2, batch_size=BATCH, steps=2)
    # the fast peer finished its budget; the relay waits for the live slow one
    wait_until(lambda: relay.status()["samples_accumulated"] >= 4 * BATCH, 120, "the fast peer's pseudo-gradient")
    status = relay.status()
    assert status["step"] == 0 and status["round"] is None
    slow.proc.send_signal(signal.SIGKILL)
    assert fast.wait(180) == 0  # rounds 1 and 2 happened without the dead peer
    assert relay.status()["step"] >= 2


def test_a_late_pseudo_gradient_is_dropped_counted_and_the_peer_moves_on(serve_relay) -> None:
    """The fast peer alone holds the target batch, so its outer round does not wait; the slow
    peer's pseudo-gradient, computed on version 0, arrives with the relay at 1: dropped (never
    applied), counted on the peer, and the peer continues from version 1."""
    relay = serve_relay(
        local_run(SGD1 | {"lr": 0.05}, inner_steps=2, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
        | {"run": {"mode": "local_sgd", "target_batch": 2 * BATCH, "max_staleness": 0}}
    )
    data = batches(2)
    (fast_model, fast), (slow_model, slow) = join(relay.url), join(relay.url)
    inner_step(slow_model, slow, data[0])  # inner step 1 of 2 on version 0
    inner_step(fast_model, fast, data[0])
    inner_step(fast_model, fast, data[1])  # budget spent: the round opens for the fast peer's samples alone
    assert fast.version == 1 and fast.local_sgd.outer_rounds == 1
    inner_step(slow_model, slow, data[1])  # budget spent, on version 0: late
    assert slow.local_sgd.late_rounds == 1 and slow.local_sgd.outer_rounds == 0 and slow.version == 1
    status = relay.status()
    assert status["step"] == 1 and [r["contributors"] for r in status["recent_rounds"]] == [1]
    np.testing.assert_array_equal(flatten(slow_model), params_of(relay.url, 1))  # back on the global parameters
    fast.close()
    slow.close()


def test_a_live_peer_that_never_finishes_delays_the_outer_round_only_for_the_straggler_wait(serve_relay) -> None:
    """A paused notebook keeps heartbeating with nothing to send: after ``straggler_wait_s`` the
    relay opens the outer round for the peer that finished, and applies its pseudo-gradient."""
    relay = serve_relay(
        local_run(SGD1, inner_steps=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False, straggler_wait_s=1.0)
        | {
            "run": {"mode": "local_sgd", "target_batch": 10_000, "max_staleness": 0},
            "rounds": {**PATIENT, "peer_ttl_s": 600.0},
        }
    )  # nobody times out here
    init = params_of(relay.url)
    paused, done = RawPeer(relay).join("paused"), RawPeer(relay).join("done")
    assert paused.heartbeat(0).ok and done.heartbeat(10).ok
    assert wait_until(lambda: relay.status()["round"], 60, "the outer round")["expected_peers"] == 1
    assert done.upload(done.container(np.full(init.size, 2.0, np.float32))).ok
    np.testing.assert_allclose(params_of(relay.url, 1), init - 0.2, rtol=1e-6)


def test_hostile_pseudo_gradients_are_refused_and_change_nothing(serve_relay) -> None:
    relay = serve_relay(
        local_run(SGD1, inner_steps=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
        | {"run": {"mode": "local_sgd", "target_batch": 10_000, "max_staleness": 0}}
    )
    init = params_of(relay.url)
    num = init.size
    finite = np.full(num, 0.5, np.float32)
    nan = finite.copy()
    nan[3] = np.nan
    attacks = {
        "nan": lambda p: p.container(nan),
        "wrong_shape": lambda p: p.container(finite[:-1]),
        "oversized": lambda p: p.container(finite) + b"\0" * (4 << 20),
    }
    for name, body in attacks.items():
        peer = RawPeer(relay).join(name)
        assert peer.heartbeat(10).ok
        before = snapshot(relay)
        response = peer.upload(body(peer))
        assert response.status_code >= 400, (name, response.status_code, response.text)
        after = snapshot(relay)
        assert (after["sum"], after["weights"]) == (before["sum"], before["weights"]), name
        assert relay.status()["step"] == 0, name
        np.testing.assert_array_equal(params_of(relay.url), init)
    honest = RawPeer(relay).join("honest")
    assert honest.heartbeat(10).ok
    wait_until(lambda: relay.status()["round"], 30, "an outer round")
    assert honest.upload(honest.container(finite * 10)).ok  # pseudo-gradient 0.5, weighted by 10 samples
    np.testing.assert_allclose(params_of(relay.url, 1), init - 0.5, rtol=1e-6)


def test_sparse_pseudo_gradients_and_broadcasts_keep_peers_bit_identical_and_hostile_ones_change_nothing(
    serve_relay,
) -> None:
    """``run.compression = "topk2-64"`` both ways: two peers (threads) send sparse 2-bit
    pseudo-gradients with error feedback for four outer rounds, and download each new version as a
    sparse delta against the public copy; both end holding the relay's public copy bit for bit, on
    deltas (the relay sent them barely more than their two first full downloads). Before them, a
    pseudo-gradient whose positions are out of range or whose scale is NaN is refused and changes
    nothing."""
    from toolkit.errors import RelayRejected
    from toolkit.wire.compression import get_codec
    from toolkit.wire.protocol import PROTOCOL_VERSION, GradientMeta, JoinRequest

    relay = serve_relay(
        local_run(SGD1 | {"lr": 0.1}, inner_steps=2, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
        | {
            "run": {"mode": "local_sgd", "target_batch": 10_000, "max_staleness": 0, "compression": "topk2-64"},
            "model": {"kwargs": {"sizes": [8, 256, 256, 1]}},
        }
    )  # 68,609: a delta is ~2% of a full copy
    init = params_of(relay.url)
    codec = get_codec("topk2-64")
    raw = RelayClient(relay.url)
    peer = raw.join(JoinRequest(peer_name="hostile", protocol=PROTOCOL_VERSION)).peer_id
    raw.heartbeat(peer, Heartbeat(version=0, samples=8, samples_per_s=10.0))
    wait_until(lambda: relay.status()["round"], 30, "the outer round")
    good = dict(codec.encode(np.full(init.size, 0.5, np.float32)))
    out_of_range = good["payload"].copy()
    out_of_range[2 * 63 : 2 * 64] = np.frombuffer((4096).to_bytes(2, "little"), np.uint8)  # past chunk 0
    nan_scale = good["scales"].copy()
    nan_scale[0] = np.nan
    meta = GradientMeta(peer_id=peer, step=0, version=0, samples=8, loss_sum=1.0)
    for what, tensors in {
        "position out of range": {**good, "payload": out_of_range},
        "nan scale": {**good, "scales": nan_scale},
    }.items():
        before = snapshot(relay)
        with pytest.raises(RelayRejected) as refused:
            raw.upload_gradient(list(tensors.items()), meta, codec.name)
        assert refused.value.code == "bad_tensor", (what, refused.value)
        after = snapshot(relay)
        assert (after["sum"], after["weights"]) == (before["sum"], before["weights"]), what
    raw.leave(peer)
    raw.close()
    assert relay.status()["step"] == 0
    np.testing.assert_array_equal(params_of(relay.url), init)
    data = batches(4)
    done: list[CollaborativeOptimizer] = []
    threads = [
        threading.Thread(target=lambda seed=seed: done.append(train(relay.url, data[seed:] + data[:seed], 4)))
        for seed in (0, 1)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert len(done) == 2 and all(opt.local_sgd.outer_rounds >= 3 for opt in done), [o.version for o in done]
    sent = relay.status()["traffic"]["down_bytes"]  # before this test's own full downloads below
    public = params_of(relay.url, 4)
    assert not np.array_equal(public, init)
    for opt in done:
        assert opt.version == 4 and np.array_equal(opt.rounds.public.view(np.uint32), public.view(np.uint32))
    full, delta = 4 * init.size, codec.wire_bytes(init.size)
    # in full: this test's two reads above and the two joins; then each peer's four versions as deltas
    assert sent <= 4 * full + 2 * 4 * (delta + 4096) < 5 * full, (sent, full, delta)


@pytest.mark.parametrize("feedback", [1.0, 0.0])
def test_download_feedback_sets_how_much_of_the_broadcast_residual_the_master_keeps(serve_relay, feedback) -> None:
    """A sparse broadcast (``topk2-64``) leaves part of each outer step unsent. With
    ``run.download_feedback = 1`` the master keeps all of it (error feedback: later deltas send it);
    with 0 the master is pulled back onto the public copy bit for bit after every version. Either
    way the peer downloads the public copy exactly."""
    relay = serve_relay(
        local_run(SGD1 | {"lr": 0.1}, inner_steps=2, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
        | {
            "run": {
                "mode": "local_sgd",
                "target_batch": BATCH,
                "max_staleness": 0,
                "compression": "topk2-64",
                "download_feedback": feedback,
            },
            "model": {"kwargs": {"sizes": [8, 256, 256, 1]}},
        }
    )
    train(relay.url, batches(4), 2)
    state = load_file(str(relay.data_dir / "state" / "step-00000002.safetensors"))
    np.testing.assert_array_equal(params_of(relay.url, 2), state["params"])  # peers get the public copy
    residual = state["master"] - state["params"]
    if feedback == 0.0:
        assert not residual.any()  # the master is the public copy
    else:
        assert residual.any()  # what the 2-bit sparse delta did not carry is kept for the next ones


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        ({"run": {"mode": "fast"}}, "run.mode"),
        ({"local_sgd": {"inner_steps": 0, "inner_seconds": 0.0}}, "inner_steps"),
        ({"local_sgd": {"outer_lr": 0.0}}, "local_sgd.outer_lr"),
        ({"local_sgd": {"straggler_wait_s": 0.0}}, "local_sgd.straggler_wait_s"),
        ({"local_sgd": {"outer_momentum": 0.0}}, "local_sgd.nesterov"),
        ({"run": {"max_staleness": 1}}, "run.max_staleness"),
        ({"run": {"download_feedback": 1.5}}, "run.download_feedback"),
        ({"optimizer": {"name": "lamb"}}, "optimizer.name"),
        (
            {
                "optimizer": {"schedule": "cosine", "warmup_steps": 2},
                "run": {"total_steps": 10},
                "local_sgd": {"inner_steps": 0, "inner_seconds": 30.0},
            },
            "local_sgd.inner_steps",
        ),
        ({"moe": {"enabled": True}}, "[moe]"),
    ],
)
def test_unsupported_settings_are_refused_in_one_line(tmp_path, overrides, names) -> None:
    config = merged({"run": {"mode": "local_sgd", "max_staleness": 0}})
    for section, values in overrides.items():
        config.setdefault(section, {}).update(values)
    config["server"]["data_dir"] = str(tmp_path / "data")
    with pytest.raises(ConfigError) as error:
        load_config(write_config(tmp_path / "run.toml", config), env={})
    message = str(error.value)
    assert names in message and "\n" not in message, message
    assert not (tmp_path / "data").exists()


def test_the_docs_configuration_loads(tmp_path) -> None:
    """docs/local-sgd.md's first TOML block is a valid run, in local SGD mode with its outer SGD."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "local-sgd.md").read_text()
    block = re.search(r"```toml\n(.*?)```", page, re.S)[1]
    path = tmp_path / "run.toml"
    path.write_text(block + f'\n[server]\ndata_dir = "{tmp_path / "data"}"\n[auth]\nmode = "open"\n')
    config = load_config(path, env={})
    assert config.run.mode == "local_sgd" and config.local_sgd.inner_steps == 30
    outer = config.master_optimizer()
    assert (outer.name, outer.lr, outer.momentum, outer.nesterov) == ("sgd", 0.7, 0.9, True)


def test_centered_clip_bounds_a_huge_pseudo_gradient_and_the_outer_step_takes_the_center(serve_relay) -> None:
    """``rounds.aggregation = "centered_clip"`` on pseudo-gradients: three honest peers and one
    sending a finite pseudo-gradient 1000x larger; the outer step is the CenteredClip center of the
    four per-peer means (each chunk as the relay cuts them), so the attacker moves it by about one
    honest deviation, where the mean would have moved it ~250x further."""
    from relay_server.rounds.reducer import CHUNK_ELEMS
    from relay_server.rounds.robust import CenteredClipConfig, RobustAccumulator

    relay = serve_relay(
        local_run(SGD1, inner_steps=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
        | {
            "run": {"mode": "local_sgd", "target_batch": 40, "max_staleness": 0},
            "rounds": PATIENT | {"aggregation": "centered_clip"},
        }
    )
    init = params_of(relay.url)
    rng = np.random.default_rng(3)
    means = [(0.5 + 0.05 * rng.standard_normal(init.size)).astype(np.float32) for _ in range(3)]
    means.append(np.full(init.size, 500.0, np.float32))  # finite, so only the robust center can stop it
    peers = [RawPeer(relay).join(f"p{i}") for i in range(4)]
    for peer in peers:
        assert peer.heartbeat(10).ok
    wait_until(lambda: relay.status()["round"], 30, "the outer round")
    for peer, mean in zip(peers, means):
        assert peer.upload(peer.container(mean * 10)).ok  # a SUM over 10 samples
    reference = RobustAccumulator(init.size, CHUNK_ELEMS, CenteredClipConfig())
    for peer, mean in zip(peers, means):
        reference.add_chunk(peer.peer_id, 0, mean * 10, 10)
    center = np.empty_like(init)
    assert reference.finish_into(center) == {peers[3].peer_id: 1}  # the attacker, and only it, was clipped
    after = params_of(relay.url, 1)
    np.testing.assert_allclose(after, init - center, rtol=1e-5, atol=1e-6)
    honest = np.mean(means[:3], axis=0)
    assert np.linalg.norm(center - honest) < 0.02 * np.linalg.norm(means[3] - honest)


def test_an_aggregator_owns_a_slice_of_the_outer_step_in_a_signed_run(
    start_relay, start_aggregators, launch_peer, hf_standin, monkeypatch
) -> None:
    """Relay + one aggregator + three peer processes logged in with HF (signed tickets, chunk
    digests, the signed manifest), inner SGD at lr 0.05 and outer SGD at lr 0.7 with momentum 0.9:
    across the slices, every sliced outer step is exactly ``params -= 0.7 * buffer`` with ``buffer
    = 0.9 * buffer + mean pseudo-gradient``, i.e. the aggregator steps with the OUTER optimizer
    (the relay once sent it the inner one), its momentum kept; and every peer holds the relay's bits."""
    from safetensors.numpy import load_file

    from relay_server.core.training_config import OptimizerSection
    from relay_server.rounds.master import MasterState
    from tests.support.training import FAST_AGGREGATORS, sliced_plan, stored_params, train_sliced
    from toolkit.wire.tensor_container import read_file_header

    token = "hf_local_sgd_token_42"
    hf_standin.add_user(token, "alice")
    monkeypatch.setenv("COLLAB_TEST_TOKEN", token)
    relay = start_relay(
        {
            "auth": {"mode": "hf", "hf_endpoint": hf_standin.url, "allow_users": ["alice"]},
            "run": {"mode": "local_sgd", "target_batch": 10_000, "max_staleness": 0},
            "optimizer": SGD1 | {"lr": 0.05},
            "local_sgd": {"inner_steps": 2, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": False},
            "aggregators": FAST_AGGREGATORS,
        }
    )
    aggregators = start_aggregators(relay, "agg0", wait=False)
    peers, sliced_at, status = train_sliced(
        relay, aggregators, launch_peer, 3, seed=20, extra=("--hf-token-env", "COLLAB_TEST_TOKEN")
    )
    assert {s["url"] for s in sliced_plan(status)} == {"", aggregators[0].url}
    for peer in peers:
        peer.proc.terminate()
        assert peer.wait() == 0, peer.log_path.read_text()[-3000:]
    data_dirs = [relay.data_dir, aggregators[0].data_dir]
    num = status["num_params"]

    layout = RelayClient(relay.url).get_run().layout
    outer = OptimizerSection(name="sgd", lr=0.7, momentum=0.9)

    def buffer(step: int) -> np.ndarray:  # the outer momentum, put together from every owner's file
        out = np.full(num, np.nan, dtype=np.float32)
        for data_dir in data_dirs:
            path = data_dir / "state" / f"step-{step:08d}.safetensors"
            if path.exists():
                meta = read_file_header(path).metadata
                start, end = int(meta.get("start", 0)), int(meta.get("end", num))
                tensors = {k: torch.from_numpy(v) for k, v in load_file(str(path)).items()}
                owner = MasterState(layout, tensors["params"].numpy(), outer, 0, start=start, end=end)
                owner.load_state_tensors(tensors, step)
                out[start:end] = owner.export_state()["opt.momentum_buffer"]
        assert not np.isnan(out).any(), f"no owner stored the outer momentum of step {step}"
        return out

    step = sliced_at + 2
    before, after = stored_params(step, data_dirs, num), stored_params(step + 1, data_dirs, num)
    np.testing.assert_allclose(after, before - 0.7 * buffer(step + 1), rtol=1e-5, atol=1e-6)
    pseudo = buffer(step + 1) - 0.9 * buffer(step)  # the mean pseudo-gradient of that outer round
    assert np.linalg.norm(pseudo) > 0


@pytest.mark.slow  # two peer processes: their torch imports dominate (seconds each on a loaded machine)
def test_with_a_time_budget_peers_of_different_speeds_all_contribute(serve_relay, launch_peer) -> None:
    """``inner_seconds``: a peer 20x slower finishes its budget with the fast one, and the relay
    waits for every live peer on the version, so each outer round holds both."""
    relay = serve_relay(
        local_run(
            SGD1 | {"lr": 0.05}, inner_steps=0, inner_seconds=1.0, outer_lr=1.0, outer_momentum=0.0, nesterov=False
        )
        | {"run": {"mode": "local_sgd", "target_batch": 10_000, "max_staleness": 0}}
    )
    peers = [
        launch_peer(relay.url, "fast", seed=1, batch_size=BATCH, steps=2, extra=("--wait-peers", "2")),
        launch_peer(
            relay.url,
            "slow",
            seed=2,
            batch_size=BATCH,
            steps=2,
            extra=("--wait-peers", "2", "--sleep-per-batch", "0.1"),
        ),
    ]
    for peer in peers:
        assert peer.wait(180) == 0, peer.log_path.read_text()[-2000:]
    rounds = {r["step"]: r for r in relay.status()["recent_rounds"]}
    assert rounds[1]["contributors"] == 2 and rounds[2]["contributors"] == 2, rounds
