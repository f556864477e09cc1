"""LAMB on the relay: the optimizer against a plain per-tensor reference, and the same K steps
whether the relay holds the whole vector or the plan slices it among the relay and two
aggregators (in-process owners fed the same averaged gradients; milliseconds).

The model's tensors have different sizes, so the plan's raw cuts fall inside tensors: the
slicing the relay installs snaps them to tensor boundaries, and without that the trust ratios
of the cut tensors (one per piece) would differ from the whole vector's.
"""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest
import torch

from relay_server.backbone.backbone import RELAY_ID, Backbone
from relay_server.backbone.state_transfer import CallFailed, cut
from relay_server.core.config import OptimizerSection, load_config
from relay_server.core.typed import ConfigError
from relay_server.planning.averaging_plan import Plan
from relay_server.rounds import master as master_mod
from relay_server.rounds.lamb import Lamb
from relay_server.rounds.master import MasterState, layout_of, tensor_boundaries
from relay_server.rounds.store import Store
from tests.support.training import (
    FAST_AGGREGATORS,
    MODEL_KWARGS,
    relay_params,
    rounds_from_events,
    sliced_plan,
    stored_params,
    train_sliced,
)
from toolkit.models import build_model
from toolkit.models.flat import flatten, load_flat
from toolkit.wire.compression import run_codecs
from toolkit.wire.protocol import PROTOCOL_VERSION, AggregatorRegistration, ModelSpec, RunInfo

K = 6
SIZES = [6, 20, 12, 3]  # tensors of 120, 20, 240, 12, 36 and 3 elements
LAMB = dict(
    name="lamb",
    lr=0.02,
    weight_decay=0.01,
    betas=[0.9, 0.99],
    eps=1e-6,
    lamb_clamp=10.0,
    schedule="linear",
    warmup_steps=2,
)


def reference_lamb(weights, grads_per_step, lrs, decays, *, betas, eps, clamp):
    """LAMB as the paper writes it, one tensor at a time, in float64."""
    b1, b2 = betas
    w = [x.double().clone() for x in weights]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    for t, (grads, lr) in enumerate(zip(grads_per_step, lrs), start=1):
        for i, (g, wd) in enumerate(zip(grads, decays)):
            g = g.double()
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            r = (m[i] / (1 - b1**t)) / ((v[i] / (1 - b2**t)).sqrt() + eps)
            u = r + wd * w[i]
            w_norm = float(w[i].norm())
            if clamp > 0:
                w_norm = min(w_norm, clamp)
            u_norm = float(u.norm())
            trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
            w[i] = w[i] - lr * trust * u
    return w


@pytest.mark.parametrize("dtype,clamp", [(torch.float64, 10.0), (torch.float32, 10.0), (torch.float32, 0.0)])
def test_lamb_matches_a_straightforward_reference(dtype, clamp):
    """Random tensors, some decayed and some not, one starting at zero (||w|| = 0: trust 1), one
    with zero weight and gradient (||update|| = 0: trust 1), big ones past the clamp."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (4, 3), (3,), (30, 20), (40,), (9, 11)]
    decays = [0.05, 0.0, 0.05, 0.0, 0.05, 0.0, 0.05]
    weights = [torch.randn(s, generator=gen, dtype=torch.float64) * 0.5 for s in shapes]
    weights[2].zero_()
    weights[3].zero_()
    weights[4] *= 4  # ||w|| ~ 50, past the clamp of 10
    grads_per_step = []
    for _ in range(K):
        grads = [torch.randn(s, generator=gen, dtype=torch.float64) * (i + 1) for i, s in enumerate(shapes)]
        grads[3].zero_()
        grads_per_step.append(grads)
    lrs = [0.01, 0.03, 0.02, 0.02, 0.005, 0.01]
    params = [torch.nn.Parameter(w.clone().to(dtype)) for w in weights]
    groups = [{"params": [p], "weight_decay": wd} for p, wd in zip(params, decays)]
    opt = Lamb(groups, lr=1.0, betas=(0.9, 0.99), eps=1e-6, clamp=clamp)
    for grads, lr in zip(grads_per_step, lrs):
        for p, g in zip(params, grads):
            p.grad = g.to(dtype)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
    expected = reference_lamb(weights, grads_per_step, lrs, decays, betas=(0.9, 0.99), eps=1e-6, clamp=clamp)
    for p, want in zip(params, expected):
        diff = float((p.detach().double() - want).abs().max())
        assert diff <= 1e-6 * max(1.0, float(want.abs().max())), diff
    torch.testing.assert_close(params[3].detach().double(), expected[3])  # never moved
    assert float(params[2].detach().norm()) > 0  # moved off zero with trust 1


def _model():
    model = build_model(ModelSpec(factory="toolkit.models:MLP", kwargs={"sizes": SIZES}))
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layout_of(model), flatten(model)


def _grads(n: int, layout) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(K):
        g = rng.standard_normal(n).astype(np.float32)
        for i, spec in enumerate(layout):  # tensors on different scales, as in a real network
            g[spec.offset : spec.offset + math.prod(spec.shape)] *= 10.0 ** (i % 3 - 1)
        out.append(g)
    return out


def _train(layout, params, cfg, cuts, grads, *, moved_to=None) -> np.ndarray:
    """Owners of ``cuts`` (start..end offsets) stepping on the same mean gradients; with
    ``moved_to``, the state moves to that slicing half-way (as a migration does)."""
    owners = [MasterState(layout, params, cfg, total_steps=K, start=a, end=b) for a, b in zip(cuts, cuts[1:])]
    for k, g in enumerate(grads):
        if moved_to is not None and k == K // 2:
            parts = [o.export_state() for o in owners]
            state = {name: np.concatenate([p[name] for p in parts]) if v.ndim else v for name, v in parts[0].items()}
            owners = [
                MasterState(layout, cut(state, a, b)["params"], cfg, K, step=k, start=a, end=b)
                for a, b in zip(moved_to, moved_to[1:])
            ]
            for o, (a, b) in zip(owners, zip(moved_to, moved_to[1:])):
                o.import_state(cut(state, a, b), step=k)
        for o in owners:
            o.grad.copy_(torch.from_numpy(g[o.start : o.end]))
            o.apply_gradient()
    return np.concatenate([o.flat.numpy() for o in owners])


def _backbone(tmp_path, optimizer: dict) -> Backbone:
    config = load_config(
        None,
        overrides={
            "auth": {"mode": "open"},
            "run": {"target_batch": 64, "total_steps": K},
            "model": {"factory": "toolkit.models:MLP", "kwargs": {"sizes": SIZES}},
            "optimizer": {"clip_grad_norm": 0.0, **optimizer},
        },
    )
    layout, params = _model()
    run = RunInfo(
        run_name="t",
        protocol=PROTOCOL_VERSION,
        model=ModelSpec(factory=config.model.factory),
        layout=layout,
        num_params=params.size,
        target_batch=64,
        total_steps=K,
        max_staleness=1,
        heartbeat_interval_s=1.0,
    )
    return Backbone(config, Store(tmp_path / "data"), layout, run_codecs("none"), params, run)


def _plan(n: int, fractions: dict[str, float]) -> Plan:
    return Plan(
        steps_per_s=1.0,
        fractions=fractions,
        computes={},
        version="v1",
        num_params=n,
        predicted_round_s=1.0,
        aggregators=tuple(fractions),
    )


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_relay_alone_and_relay_with_two_aggregators_take_the_same_lamb_steps(tmp_path, monkeypatch):
    layout, params = _model()
    n = params.size
    bounds = tensor_boundaries(layout)
    backbone = _backbone(tmp_path, LAMB)
    cfg = backbone.config.optimizer
    try:
        plan = _plan(n, {RELAY_ID: 0.3, "agg-a": 0.45, "agg-b": 0.25})
        raw = [0] + [end for _, _, end in plan.slices(n)]
        assert not set(raw[1:-1]) & set(bounds), raw  # the LP's shares alone would cut tensors
        owners = backbone._owners_for(plan)  # what the relay installs: snapped
        cuts = [0] + [o.end for o in owners]
        assert len(owners) == 3 and set(cuts) <= set(bounds), cuts
        assert [o.owner_id for o in owners] == [RELAY_ID, "agg-a", "agg-b"]
        grads = _grads(n, layout)

        alone = _train(layout, params, cfg, [0, n], grads)
        sliced = _train(layout, params, cfg, cuts, grads)
        assert _rel(sliced, alone) <= 1e-5
        assert _rel(alone, params) > 1e-2  # the steps did move the parameters
        other = [0] + [o.end for o in backbone._owners_for(_plan(n, {RELAY_ID: 0.6, "agg-a": 0.2, "agg-b": 0.2}))]
        assert other != cuts
        assert _rel(_train(layout, params, cfg, cuts, grads, moved_to=other), alone) <= 1e-5  # a migration

        # Without snapping: the slices refuse to cut a tensor, and stepping the pieces anyway
        # (each with its own trust ratio) is not the whole vector's LAMB.
        with pytest.raises(ConfigError, match="tensor boundaries"):
            MasterState(layout, params, cfg, K, start=raw[1], end=raw[2])
        monkeypatch.setattr(master_mod, "_check_slice", lambda *args: None)
        assert _rel(_train(layout, params, cfg, raw, grads), alone) > 1e-3
    finally:
        backbone.close()


def test_elementwise_optimizers_keep_exact_shares_and_clipping_admits_aggregators(tmp_path):
    """adamw has no per-tensor quantity: its cuts stay where the LP put them. Global-norm clipping
    no longer keeps aggregators out: a slice takes the global norm from the relay."""
    layout, params = _model()
    n = params.size
    backbone = _backbone(tmp_path, {"name": "adamw"})
    try:
        plan = _plan(n, {RELAY_ID: 0.3, "agg-a": 0.45, "agg-b": 0.25})
        assert [(o.start, o.end) for o in backbone._owners_for(plan)] == [(a, b) for _, a, b in plan.slices(n)]
    finally:
        backbone.close()
    MasterState(layout, params, OptimizerSection(**{**LAMB, "clip_grad_norm": 1.0}), K, start=0, end=120)
    backbone = _backbone(tmp_path / "clip", {"clip_grad_norm": 1.0})
    try:
        backbone.register(AggregatorRegistration(name="a", url="http://a:1", protocol=PROTOCOL_VERSION))
    finally:
        backbone.close()


# --- global-norm clipping across slices: two-phase finalize (relay_server.backbone.closing) -------------
CLIPPED = {
    "adamw": {"name": "adamw", "lr": 0.02, "weight_decay": 0.01, "clip_grad_norm": 0.1},
    "lamb": {**LAMB, "clip_grad_norm": 0.1},
}


class Loopback:
    """The relay's internal client, answered by in-process aggregators (``relay_server.aggregator``'s
    handlers; bodies cross as JSON both ways). ``down``: urls that fail from then on; ``die_after``:
    urls that fail every call after their next one."""

    def __init__(self) -> None:
        self.aggs, self.down, self.die_after, self.tamper = {}, set(), set(), None

    async def call(self, method, url, schema, body=None):
        from toolkit.wire.protocol import ROUTES, FinalizeRequest, GradNormRequest

        base, path = url.split("/api/", 1)
        if base in self.down:
            raise CallFailed(f"{url}: connection refused")
        if base in self.die_after:
            self.down.add(base)
        agg = self.aggs[base]
        handler, cls = {
            ROUTES["grad_norm"]: (agg.grad_norm, GradNormRequest),
            ROUTES["finalize"]: (agg.finalize, FinalizeRequest),
        }["/api/" + path]
        answer = (await handler(cls.loads(body.dumps()))).to_json()
        if self.tamper is not None:
            answer = self.tamper(base, path, answer)
        return schema.loads(json.dumps(answer))


def _sliced_servers(tmp_path, backbone, plan, params):
    """The relay's own slice and two in-process aggregators owning the plan's (snapped) slices."""
    from relay_server.aggregator import AggregatorServer
    from relay_server.backbone.aggregators import Aggregator
    from relay_server.backbone.closing import RoundCloser
    from relay_server.backbone.slice_owner import SliceOwner

    for agg_id in ("agg-a", "agg-b"):
        backbone.aggregators.add(Aggregator(agg_id, agg_id, f"http://{agg_id}"))
    owners, client, slices = backbone._owners_for(plan), Loopback(), []
    for o in owners:
        so = SliceOwner(
            backbone.layout,
            {"params": params[o.start : o.end].copy()},
            start=o.start,
            end=o.end,
            step=0,
            optimizer=backbone.config.optimizer,
            total_steps=K,
            codecs=run_codecs("none"),
            store=Store(tmp_path / o.owner_id),
            plan_version=plan.version,
        )
        slices.append(so)
        if o.owner_id != RELAY_ID:
            server = AggregatorServer(
                coordinator="http://relay",
                public_url=o.url,
                data_dir=tmp_path / f"{o.owner_id}-s",
                token="t" * 32,
                name=o.owner_id,
            )
            server.owner, client.aggs[o.url] = so, server
    local = next(so for o, so in zip(owners, slices) if o.owner_id == RELAY_ID)
    return RoundCloser(owners, local, backbone.aggregators, client, plan.version), slices


async def _feed(slices, g) -> None:
    """Each owner's reducer holds ``g`` as the round's sum over one sample (after any queued reset)."""

    def fill(so):
        so.reducer.sum[:] = g[so.start : so.end]
        so.reducer.weights[:] = 1.0

    for so in slices:
        await so.reducer.run(fill, so)


def _close(slices) -> None:
    for so in slices:
        so.close()


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_slices_clip_by_the_global_norm_like_the_relay_alone(tmp_path, name):
    """Relay + 2 aggregators' slices, clip_grad_norm = 0.1 binding every step: the two-phase close
    (squared norms, then finalize with the global norm) takes the relay-alone steps; each slice
    clipping by its own norm does not. The round record's norm is the global one."""
    layout, params = _model()
    n = params.size
    backbone = _backbone(tmp_path, CLIPPED[name])
    cfg = backbone.config.optimizer
    plan = _plan(n, {RELAY_ID: 0.3, "agg-a": 0.45, "agg-b": 0.25})
    grads = _grads(n, layout)
    assert min(np.linalg.norm(g) for g in grads) > 10 * cfg.clip_grad_norm  # clipping binds
    closer, slices = _sliced_servers(tmp_path, backbone, plan, params)
    cuts = [0] + [o.end for o in closer.owners]

    async def rounds():
        norms = []
        for k, g in enumerate(grads):
            await _feed(slices, g)
            closed = await closer.close(k, f"round{k}", clip=True)
            assert not closed.dead and {r.step for r in closed.reports.values()} == {k + 1}
            norms.append(closed.grad_norm)
        return norms

    try:
        norms = asyncio.run(rounds())
        sliced = np.concatenate([so.master.flat.numpy() for so in slices])
    finally:
        _close(slices)
        backbone.close()
    alone = _train(layout, params, cfg, [0, n], grads)
    assert _rel(alone, params) > 1e-2
    assert _rel(sliced, alone) <= 1e-5
    np.testing.assert_allclose(norms, [np.linalg.norm(g.astype(np.float64)) for g in grads], rtol=1e-6)
    own = _train(layout, params, cfg, cuts, grads)  # every slice clipping by its own norm
    assert _rel(own, alone) > 1e-3


@pytest.mark.parametrize("when", ["between_phases", "in_phase_one", "bad_answer"])
def test_an_aggregator_failing_during_a_clipped_close_is_dead(tmp_path, when):
    """Dying after answering its norm: it still counts in the global norm the others clip by (they
    take the relay-alone step on their slices). Failing the norm call, or answering it for another
    round: dead, and the others clip by the norm of the gradient actually applied. Either way the
    coordinator recovers the dead slice as after a failed finalize."""
    layout, params = _model()
    n = params.size
    backbone = _backbone(tmp_path, CLIPPED["adamw"])
    cfg = backbone.config.optimizer
    plan = _plan(n, {RELAY_ID: 0.3, "agg-a": 0.45, "agg-b": 0.25})
    g = _grads(n, layout)[0]
    closer, slices = _sliced_servers(tmp_path, backbone, plan, params)
    client, b = closer.client, next(o for o in closer.owners if o.owner_id == "agg-b")
    if when == "between_phases":
        client.die_after.add(b.url)
    elif when == "in_phase_one":
        client.down.add(b.url)
    else:
        client.tamper = lambda base, path, answer: {**answer, "round_id": "other"} if base == b.url else answer

    async def one_round():
        await _feed(slices, g)
        return await closer.close(0, "round0", clip=True)

    try:
        closed = asyncio.run(one_round())
        live = [so for o, so in zip(closer.owners, slices) if o.owner_id != "agg-b"]
        got = {so.start: so.master.flat.numpy().copy() for so in live}
        assert [so.step for so in live] == [1, 1]
    finally:
        _close(slices)
        backbone.close()
    assert [o.owner_id for o in closed.dead] == ["agg-b"] and not backbone.aggregators.alive("agg-b")
    assert set(closed.reports) == {RELAY_ID, "agg-a"}
    if when == "between_phases":
        applied = g
    else:
        applied = g.copy()
        applied[b.start : b.end] = 0.0
    assert closed.grad_norm == pytest.approx(float(np.linalg.norm(applied.astype(np.float64))), rel=1e-6)
    alone = _train(layout, params, cfg, [0, n], [applied])
    for start, values in got.items():
        np.testing.assert_allclose(values, alone[start : start + values.size], rtol=0, atol=1e-6)


def test_grad_norm_messages_are_validated():
    from toolkit.errors import ProtocolError
    from toolkit.wire.protocol import FinalizeRequest, GradNormReport

    ok = dict(step=3, round_id="r", start=0, end=10, sq_norm=2.5)
    assert GradNormReport.loads(json.dumps(ok)).sq_norm == 2.5
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ProtocolError):
            GradNormReport.loads(json.dumps({**ok, "sq_norm": bad}))
    with pytest.raises(ProtocolError):
        FinalizeRequest.loads(json.dumps(dict(step=3, round_id="r", plan_version="v", grad_norm=-1.0)))
    plain = FinalizeRequest(step=3, round_id="r", plan_version="v")
    assert b"grad_norm" not in plain.dumps() and FinalizeRequest.loads(plain.dumps()) == plain  # clip off: as before
    clipped = FinalizeRequest(step=3, round_id="r", plan_version="v", grad_norm=0.5)
    assert FinalizeRequest.loads(clipped.dumps()) == clipped


def test_cuts_snap_to_the_nearest_tensor_boundary():
    from relay_server.planning.averaging_plan import snap_cuts

    bounds = [0, 120, 140, 380, 392, 428, 431]
    assert snap_cuts([0, 129, 323, 431], bounds) == [0, 120, 380, 431]  # nearest, ties to the lower
    assert snap_cuts([0, 130, 431], bounds) == [0, 120, 431]
    assert snap_cuts([0, 10, 20, 431], bounds) == [0, 120, 140, 431]  # every owner keeps a tensor
    assert snap_cuts([0, 430, 431, 431], bounds) == [0, 392, 428, 431]  # ...from either end
    assert snap_cuts([0, 30, 60, 100], [0, 100]) == [0, 0, 0, 100]  # one tensor: one owner takes it whole


def test_lamb_config_is_validated():
    with pytest.raises(ConfigError, match="lamb_clamp"):
        load_config(None, overrides={"optimizer": {"name": "lamb", "lamb_clamp": -1.0}})
    with pytest.raises(ConfigError, match="state_bits = 8"):
        load_config(None, overrides={"optimizer": {"name": "lamb", "state_bits": 8}})
    assert load_config(None, overrides={"optimizer": {"name": "lamb"}}).optimizer.name == "lamb"


@pytest.mark.parametrize("clip", [pytest.param(0.0, marks=pytest.mark.slow), 0.05])  # one default run: clipping on
def test_lamb_through_a_relay_and_two_aggregator_processes(start_relay, start_aggregators, launch_peer, clip):
    """Real processes: relay + 2 aggregators + 3 peers under LAMB. The installed slices hold
    whole tensors, and the published versions are the relay-alone LAMB steps (one MasterState
    over the whole vector) on the same global batches -- with global-norm clipping too (0.05
    binds on every sliced step: the owners clip by the norm the relay summed from all of them)."""
    from tests.peer_worker import make_dataset

    lamb = {**LAMB, "schedule": "constant", "warmup_steps": 0, "clip_grad_norm": clip}
    relay = start_relay({"optimizer": lamb, "run": {"target_batch": 36}, "aggregators": FAST_AGGREGATORS})
    _, initial = relay_params(relay.url)
    aggregators = start_aggregators(relay, "agg0", "agg1", wait=False)
    peers, sliced_at, status = train_sliced(relay, aggregators, launch_peer, 3, seed=20)
    for peer in peers:
        peer.stop()  # between micro-batches: every round a peer was in is in its events
    for peer in peers:
        assert peer.wait() == 0, peer.log_path.read_text()[-3000:]
    model = build_model(ModelSpec(factory="toolkit.models:MLP", kwargs=MODEL_KWARGS))
    layout = layout_of(model)
    bounds = set(tensor_boundaries(layout))
    assert {c for s in sliced_plan(status) for c in (s["start"], s["end"])} <= bounds, sliced_plan(status)

    step = status["step"]
    published = stored_params(step, [relay.data_dir, *(a.data_dir for a in aggregators)], initial.size)
    data, rounds = make_dataset(), rounds_from_events(peers)
    alone = MasterState(layout, initial, OptimizerSection(**lamb), total_steps=0)
    norms = []
    for k in range(step):
        load_flat(model, alone.flat.numpy())
        model.zero_grad()
        model.loss(data[rounds[k]]).backward()
        alone.grad.copy_(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        norms.append(alone.apply_gradient().grad_norm)
    assert _rel(published, alone.flat.numpy()) <= 1e-5
    recorded = {r["step"]: r["grad_norm"] for r in status["recent_rounds"] if r.get("grad_norm")}
    for new_step, norm in recorded.items():  # the round record's norm is the global one
        assert norm == pytest.approx(norms[new_step - 1], rel=1e-4), (new_step, norm, norms)
    if clip:
        assert min(norms[sliced_at:step]) > clip, norms  # clipping bound on the sliced steps
    assert _rel(published, initial) > 1e-3  # it did train
