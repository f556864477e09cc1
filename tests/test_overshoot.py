"""A step applies the target batch plus at most one micro-batch per peer, also when the previous
round closes slowly: :meth:`CollaborativeOptimizer.hold` keeps a peer from computing micro-batches
that could only overshoot the round about to open.

The demo's header states that bound and its test checks every step line against it; on a loaded
CI machine a step of the two-peer demo once applied 20 samples for a target of 8: while a round
closed, the peers (``max_staleness = 1``: they compute on during a round) went on computing, and
the next round opened on all of it at once. Here the previous round is held open on purpose: a
silent peer's report opens it and it never uploads, so it waits for its 3 s deadline, and the
peer trains with delayed updates (``delayed_updates=True``: it computes on while its round runs).
"""

from __future__ import annotations

import pytest
import torch

from toolkit.client import RelayClient
from toolkit.models import build_model
from toolkit.optimizer import CollaborativeOptimizer
from toolkit.wire.protocol import PROTOCOL_VERSION, Heartbeat, JoinRequest, ModelSpec

SPEC = ModelSpec(factory="toolkit.models:MLP", kwargs={"sizes": [8, 16, 1]})
TARGET, MICRO = 8, 4


def data(n: int) -> list[torch.Tensor]:
    """``n`` micro-batches of the MLP's regression (8 features, target tanh of their sum)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randn(MICRO, 8, generator=g)
        out.append(torch.cat([x, x.sum(1, keepdim=True).tanh()], dim=1))
    return out


@pytest.mark.integration
def test_a_peer_holds_its_micro_batches_while_the_round_before_them_closes(serve_relay) -> None:
    relay = serve_relay(
        {
            "run": {"target_batch": TARGET, "max_staleness": 1},
            "rounds": {"peer_ttl_s": 60.0, "deadline_floor_s": 3.0, "deadline_initial_s": 3.0},
            "optimizer": {"name": "sgd", "lr": 0.01, "weight_decay": 0.0, "schedule": "constant"},
        }
    )
    silent = RelayClient(relay.url)
    try:
        silent_id = silent.join(JoinRequest(peer_name="silent", protocol=PROTOCOL_VERSION)).peer_id
        state = silent.heartbeat(silent_id, Heartbeat(version=0, samples=TARGET, samples_per_s=1.0))
        assert state.round is not None, state  # round 0 is open, waiting for the silent peer's upload
        model = build_model(SPEC)
        computed = 0
        with CollaborativeOptimizer(
            model, relay.url, batch_size_per_step=MICRO, report_interval_s=0.0, delayed_updates=True
        ) as opt:
            for batch in opt.batches(data(400)):
                opt.zero_grad()
                loss = model.loss(batch)
                loss.backward()
                opt.step(loss=loss.item())
                computed += 1
                if opt.version >= 3:
                    break
        rounds = {r["step"]: r for r in relay.status()["recent_rounds"]}
        # each round the silent peer is expected in (its samples are at version 0: rounds 0 and 1)
        # closes at its 3 s deadline; with delayed updates the peer computes on meanwhile, and the
        # next round opens the moment one is done: without the hold on all of those 3 s (7,972 and
        # 7,376 samples in rounds 2 and 3 here), with it on the target and at most a micro-batch more
        assert rounds[1]["finalized_by"] == rounds[2]["finalized_by"] == "deadline", rounds
        assert all(r["samples"] <= TARGET + MICRO for r in rounds.values()), rounds
        assert rounds[3]["samples"] >= TARGET, rounds
        applied = sum(r["samples"] for r in rounds.values())
        assert computed * MICRO <= applied + TARGET + MICRO, (computed, rounds)  # held, not computed on
    finally:
        silent.close()
