"""In-process pieces of the aggregator design: state that moves between slicings, tickets,
measured rates, and the plan's fractions turned into slices (no processes, milliseconds)."""

from __future__ import annotations

import math
import socket
import time

import numpy as np
import pytest
import torch

from relay_server.backbone.backbone import RELAY_ID, Backbone
from relay_server.backbone.state_transfer import cut
from relay_server.backbone.tickets import encode_ticket, new_ticket_key, sign_ticket, verify_ticket
from relay_server.core.config import OptimizerSection, load_config
from relay_server.core.errors import ApiError
from relay_server.planning.measure import PEAK_WINDOW, PeerRates, RecentPeak, ServerMeter, delivered
from relay_server.planning.planner import solve_plan
from relay_server.rounds.master import MasterState, layout_of
from relay_server.rounds.store import Store
from toolkit.models import build_model
from toolkit.models.flat import flatten
from toolkit.wire.compression import run_codecs
from toolkit.wire.protocol import (
    PROTOCOL_VERSION,
    AggregatorHeartbeat,
    AggregatorRegistration,
    ModelSpec,
    RunInfo,
    SliceDigest,
    Ticket,
    TransferSample,
)

ADAMW = OptimizerSection(name="adamw", lr=0.01, weight_decay=0.1)


def test_optimizer_state_moves_between_any_slicings():
    """Export from one cut of the vector, import into another: stepping the pieces equals
    stepping the whole (Adam moments and step counters travel with their elements)."""
    torch.manual_seed(0)
    model = build_model(ModelSpec(factory="toolkit.models:MLP", kwargs={"sizes": [8, 16, 1]}))
    layout, params = layout_of(model), flatten(model)
    n = params.size
    whole = MasterState(layout, params, ADAMW, total_steps=0)
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
    old_cut = [(0, 50), (50, n)]
    pieces = [MasterState(layout, params, ADAMW, 0, start=a, end=b) for a, b in old_cut]
    for g in grads[:2]:
        for ms in [whole, *pieces]:
            ms.grad.copy_(torch.from_numpy(g[ms.start : ms.end]))
            ms.apply_gradient()
    state = {
        k: np.concatenate([p.export_state()[k] for p in pieces]) if v.ndim else v
        for k, v in pieces[0].export_state().items()
    }
    np.testing.assert_array_equal(state["params"], whole.flat.numpy())
    moved = [
        MasterState(layout, cut(state, a, b)["params"], ADAMW, 0, step=2, start=a, end=b)
        for a, b in [(0, 7), (7, 120), (120, n)]
    ]
    for ms, (a, b) in zip(moved, [(0, 7), (7, 120), (120, n)]):
        ms.import_state(cut(state, a, b), step=2)
    for g in grads[2:]:
        for ms in [whole, *moved]:
            ms.grad.copy_(torch.from_numpy(g[ms.start : ms.end]))
            ms.apply_gradient()
    np.testing.assert_array_equal(np.concatenate([m.flat.numpy() for m in moved]), whole.flat.numpy())


def test_tickets_bind_round_peer_and_expiry():
    key = new_ticket_key()
    ticket = sign_ticket(
        Ticket(
            round_id="r1",
            step=3,
            peer_id="p",
            samples=8,
            version=3,
            plan_version="v",
            expires_at=time.time() + 60,
            slices=[SliceDigest(start=0, end=10, header_sha256="ab" * 32)],
        ),
        key,
    )
    assert verify_ticket(encode_ticket(ticket), key) == ticket
    forged = Ticket(**{**ticket.__dict__, "samples": 800})  # same MAC, more weight
    with pytest.raises(ApiError) as refused:
        verify_ticket(encode_ticket(forged), key)
    assert refused.value.code == "forged_ticket"
    with pytest.raises(ApiError) as refused:
        verify_ticket(encode_ticket(ticket), new_ticket_key())
    assert refused.value.code == "forged_ticket"
    with pytest.raises(ApiError) as refused:
        verify_ticket(encode_ticket(ticket), key, now=time.time() + 120)
    assert refused.value.code == "ticket_expired"
    for bad in (None, "", "!!", "eyJ9"):
        with pytest.raises(ApiError):
            verify_ticket(bad, key)


def test_a_peers_rate_is_its_parallel_transfers_together():
    rates = PeerRates()
    rates.add("p", "up", 1, 4_000_000, 2.0)  # three slices sent at once: 12 MB in 2 s, not 2 MB/s
    rates.add("p", "up", 1, 4_000_000, 1.5)
    rates.add("p", "up", 1, 4_000_000, 2.0)
    assert "p" not in rates.up  # the group folds once it is complete (a later step shows up)
    rates.add("p", "up", 2, 6_000_000, 1.0)
    assert rates.up["p"].value == pytest.approx(6e6)
    meter = ServerMeter()
    meter.record("up", 1, 1000, started=10.0, ended=11.0)  # overlapping receives: 3000 B over 2 s
    meter.record("up", 1, 2000, started=10.5, ended=12.0)
    meter.flush()
    assert meter.download.value == pytest.approx(1500.0) and not meter.upload.measured
    meter.record("down", 3, 1000, started=20.0, ended=21.0)  # a late peer fetches the same version
    meter.record("down", 3, 1000, started=26.0, ended=27.0)  # 5 s later: the idle gap is not the link
    meter.flush()
    assert meter.upload.value == pytest.approx(1000.0)  # 2000 B over 2 busy seconds, not over 7


def test_a_link_rate_is_its_best_recent_transfer():
    rate = RecentPeak()
    for x in (5.0, 9.0, 7.0):  # a transfer is slow when the other end is: the best one bounds the link
        rate.add(x)
    assert rate.value == 9.0 and rate.measured
    for _ in range(PEAK_WINDOW):  # the link really slowed down: the estimate follows
        rate.add(2.0)
    assert rate.value == 2.0


@pytest.mark.integration
def test_sent_bytes_count_once_the_receiver_acknowledged_them():
    """A write returns once the kernel queued the bytes: a server that timed its sends by that
    would credit a slow link with its socket buffer. ``delivered`` subtracts the unacknowledged queue."""
    server = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(server.getsockname())
    receiver, _ = server.accept()
    try:
        receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sender.setblocking(False)
        sent = 0
        try:
            while sent < 64 << 20:
                sent += sender.send(b"x" * 65536)
        except BlockingIOError:  # the receiver reads nothing: its window closed
            pass
        assert 0 <= delivered(sender, sent) < sent
        got = 0
        while got < sent:
            got += len(receiver.recv(1 << 20))
        deadline = time.monotonic() + 10
        while delivered(sender, sent) < sent and time.monotonic() < deadline:
            time.sleep(0.01)  # acknowledgements are on their way back
        assert delivered(sender, sent) == sent
        assert delivered(None, 123) == 123  # no socket to ask: the bytes written
    finally:
        for sock in (sender, receiver, server):
            sock.close()


def _backbone(tmp_path, numel: int = 100_000) -> Backbone:
    config = load_config(
        None,
        overrides={
            "auth": {"mode": "open"},
            "run": {"target_batch": 64},
            "model": {"factory": "toolkit.models:Vector", "kwargs": {"numel": numel}},
            "optimizer": {"clip_grad_norm": 0.0},  # global clipping: relay alone
            "aggregators": {"replan_interval_s": 5.0},
        },
    )
    model = build_model(config.model.spec())
    layout = layout_of(model)
    run = RunInfo(
        run_name="t",
        protocol=PROTOCOL_VERSION,
        model=ModelSpec(factory=config.model.factory),
        layout=layout,
        num_params=numel,
        target_batch=64,
        total_steps=0,
        max_staleness=1,
        heartbeat_interval_s=1.0,
    )
    return Backbone(config, Store(tmp_path / "data"), layout, run_codecs("none"), flatten(model), run)


def test_measured_rates_drive_the_plan_and_the_slices(tmp_path):
    """Injected measurements (aggregator heartbeats, transfers the relay served) go into the LP;
    the slices the relay would install are the LP's fractions, cut contiguously; when a
    measurement moves materially, the plan follows."""
    backbone = _backbone(tmp_path)
    fast, slow = (
        backbone.register(AggregatorRegistration(name=n, url=f"http://{n}:1", protocol=PROTOCOL_VERSION))
        for n in ("fast", "slow")
    )
    peers = [f"peer{i}" for i in range(4)]
    backbone.peer_ids = lambda: peers
    for i, peer in enumerate(peers):
        backbone.planning.observe_samples_per_s(peer, 100.0 + i)
        for step in (1, 2):  # the relay served each peer's uploads and downloads: 1 GB/s links
            backbone.planning.peer_rates.add(peer, "up", step, 10**9, 1.0)
            backbone.planning.peer_rates.add(peer, "down", step, 10**9, 1.0)
    backbone.heartbeat(fast.aggregator_id, AggregatorHeartbeat(step=0, plan_version="", upload=80e6, download=80e6))
    backbone.heartbeat(
        slow.aggregator_id,
        AggregatorHeartbeat(
            step=0,
            plan_version="",
            upload=20e6,
            download=20e6,
            transfers=[TransferSample(peer_id="peer0", direction="up", step=3, nbytes=5, seconds=1)],
        ),
    )
    backbone.planning.meter.record("down", 1, 10_000_000, started=0.0, ended=1.0)  # the relay sent 10 MB/s
    backbone.planning.meter.record("down", 2, 0, started=5.0, ended=5.0)
    backbone.maybe_replan(now=100.0)
    plan = backbone.pending
    assert plan is not None

    caps, inputs = backbone._capacities()
    assert {i.node_id: i.upload_source for i in inputs}[RELAY_ID] == "measured"
    assert {i.node_id: i.upload for i in inputs}[fast.aggregator_id] == 80e6
    assert plan.fractions == solve_plan(caps, backbone.num_params, 64).fractions  # the LP decides
    owners = backbone._owners_for(plan)
    assert owners[0].start == 0 and owners[-1].end == backbone.num_params
    assert all(a.end == b.start for a, b in zip(owners, owners[1:]))
    for owner in owners:  # slice sizes are the LP's fractions, to within one element
        assert abs((owner.end - owner.start) - plan.fractions[owner.owner_id] * backbone.num_params) <= 1
    share = {o.owner_id: o.fraction for o in owners}
    assert share[fast.aggregator_id] > 2 * share[slow.aggregator_id] > 0, share  # 4x the bandwidth

    # The slow aggregator's measured rate quadruples: a material change re-plans (rate-limited).
    backbone.heartbeat(slow.aggregator_id, AggregatorHeartbeat(step=0, plan_version="", upload=80e6, download=80e6))
    backbone.maybe_replan(now=101.0)
    assert backbone.pending is plan  # too soon after the last solve
    backbone.maybe_replan(now=106.0)
    again = backbone.pending
    assert again is not plan and math.isclose(
        again.fractions[fast.aggregator_id], again.fractions[slow.aggregator_id], rel_tol=1e-6
    )
    backbone.close()
