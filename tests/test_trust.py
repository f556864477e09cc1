"""The parts of the pipeline's spot checks that need no process (``relay_server.trust``): which
tasks are checked, the monitors' scores, the tolerance, the relay's own copy of a stage, a
check's exclusion in the task queues, and the configuration. The checks against real dishonest
workers are ``tests/test_trust_pipeline.py``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from relay_server.core.config import ConfigError, load_config
from relay_server.pipeline.ledger import FIRST, LAST, Step
from relay_server.tasks.queues import ReadyQueues
from relay_server.trust.calibrate import MARGIN, derived_tolerance, measure
from relay_server.trust.checks import PipelineTrust, TrustDeps
from relay_server.trust.compare import distance, tolerance
from relay_server.trust.monitor import OUTLIER_Z, ResultMonitor
from relay_server.trust.shares import PROBATION
from tests.support.pipeline import pipeline_overrides
from tests.support.pipeline_models import BYTE_SPEC, referee_and_stages
from toolkit.pipeline import compute
from toolkit.wire import payloads
from toolkit.wire.compression import get_codec

WIDTH = BYTE_SPEC.kwargs["d_model"]
NONE = get_codec("none")


def trust(share: float, **deps) -> PipelineTrust:
    base = dict(
        share=share,
        tolerance=1e-3,
        width=WIDTH,
        codec=NONE,
        submit_check=lambda step, exclude: "c1",
        cancel=lambda task_id: None,
        can_serve=lambda stage, exclude: True,
        inputs=lambda step: {},
        version=lambda: 0,
        batch=lambda: 0,
        banned=lambda worker, reason: None,
        settled=lambda: None,
        probation=0,
    )
    return PipelineTrust(TrustDeps(**{**base, **deps}))


def entry(array: np.ndarray) -> bytes:
    """A stored boundary entry, as :mod:`relay_server.pipeline.results` keeps it."""
    return payloads.encode(payloads.encode_rows("v", array.astype(np.float32), NONE))


def test_the_share_of_checked_tasks_follows_the_config_and_the_secret_not_the_task_id() -> None:
    ids = [f"t{i}" for i in range(20000)]
    one, other = trust(0.1), trust(0.1)
    a = {t for t in ids if one.chosen(t, "w", 0)}
    b = {t for t in ids if other.chosen(t, "w", 0)}
    assert 0.09 <= len(a) / len(ids) <= 0.11 and 0.09 <= len(b) / len(ids) <= 0.11
    assert len(a & b) / len(ids) < 0.02  # two relays' secrets choose independently (0.01 expected)
    assert not any(trust(0.0).chosen(t, "w", 0) for t in ids[:1000])
    assert all(trust(1.0).chosen(t, "w", 0) for t in ids[:1000])


def test_a_new_worker_is_checked_more_until_its_probation_ends() -> None:
    """The first result of a worker in each of its first PROBATION batches is always checked, the
    rest at the base share; each worker's probation is its own, and a suspect's share is 1."""
    ids = [f"t{i}" for i in range(20000)]
    checks = trust(0.02, probation=PROBATION)
    shares = checks.shares
    for batch in range(PROBATION):  # a stale liar is honest in its first batch: probation looks again
        chosen = [shares.choose(t, "new", batch) for t in ids[batch * 100 : (batch + 1) * 100]]
        assert chosen[0] and sum(chosen[1:]) <= 10, (batch, sum(chosen))  # the rest: the base share (2 expected)
    assert shares.share("new", PROBATION) == 0.02 and shares.on_probation() == []
    later = [shares.choose(t, "new", PROBATION + i // 100) for i, t in enumerate(ids[400:])]
    assert 0.015 <= sum(later) / len(later) <= 0.025  # past probation: the base share
    assert shares.share("other", 0) == 1.0 and shares.probation_checks == PROBATION
    assert shares.choose(ids[0], "other", 5) and shares.on_probation() == ["other"]  # probation counts its batches
    checks.monitor.suspicion["new"] = 1.0
    assert shares.share("new", 9) == 1.0 and all(checks.chosen(t, "new", 9) for t in ids[:100])
    assert trust(0.0, probation=PROBATION).shares.share("new", 0) == 0.0  # checks off: no probation either
    assert checks.status().probation == PROBATION and checks.status().probation_checks == PROBATION + 1


def test_the_monitor_scores_a_scaled_result_an_outlier_and_honest_ones_not() -> None:
    monitor, g = ResultMonitor(), np.random.default_rng(0)
    honest = [float(np.linalg.norm(g.normal(size=(16, WIDTH)))) for _ in range(40)]
    scores = [monitor.observe("a0", f"w{i % 3}", n, 16 * WIDTH) for i, n in enumerate(honest)]
    assert max(abs(z) for z in scores) < OUTLIER_Z and monitor.outliers == 0
    assert not any(monitor.suspect(f"w{i}") for i in range(3))
    z = monitor.observe("a0", "liar", 1.3 * honest[0], 16 * WIDTH)
    assert z > OUTLIER_Z and not monitor.suspect("liar")  # one outlier makes no suspect
    monitor.observe("a0", "liar", 1.3 * honest[1], 16 * WIDTH)
    assert monitor.suspect("liar")
    assert trust(0.0).chosen("t1", "w", 0) is False
    suspicious = trust(1e-9)
    suspicious.monitor.suspicion["liar"] = 1.0
    assert suspicious.chosen("t1", "liar", 0) and not suspicious.chosen("t1", "w", 0)  # every result of a suspect


def test_the_tolerance_separates_rounding_from_every_attack() -> None:
    g = np.random.default_rng(1)
    y = g.normal(size=(16, WIDTH)).astype(np.float32)
    noise = g.normal(size=y.shape).astype(np.float32)
    for precision in ("", "fp32", "fp16", "bf16"):
        tol = tolerance(precision, "none")
        assert distance(y, y * 1.3) > 2 * tol
        assert distance(y, -y) == pytest.approx(2.0)
        assert distance(y, y + noise * 0.1 * np.linalg.norm(y) / np.linalg.norm(noise)) > tol
    assert distance(y, (y.astype(np.float64) * (1 + 1e-7)).astype(np.float32)) < tolerance("fp32", "none")
    assert distance(y, y[:8]) == 2.0
    assert tolerance("bf16", "int8") > tolerance("bf16", "none") > tolerance("fp32", "none")


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_honest_recomputations_differ_by_less_than_the_tolerance_derived_from_them(precision) -> None:
    """The table in :mod:`relay_server.trust.compare` holds what it says: honest recomputations of
    checked results (the stage code, one micro-batch and sample by sample, against fp64) stay
    within it with the stated margin, and rounding is seen where there is some (fewer tasks than
    ``benchmarks/trust.py --tolerance 1000``, which derived the table)."""
    measured = measure(BYTE_SPEC, [2, 2], precision, 6, seed=3)
    used = tolerance(precision, "none")
    assert len(measured.pairwise) == 12 and len(measured.to_exact) == 24
    assert measured.beyond(used) == 0, measured.summary()  # no honest result would have been banned
    assert MARGIN * measured.bound <= used, measured.summary()
    assert derived_tolerance(measured.bound) <= used
    assert 0 < max(measured.to_exact) < (1e-5 if precision == "fp32" else used / MARGIN)


def test_a_check_is_never_leased_to_the_worker_it_checks() -> None:
    queues = ReadyQueues()

    def task(seq: int, excluded: frozenset[str]) -> SimpleNamespace:
        return SimpleNamespace(
            key="stage1",
            rows=1,
            priority=(0,),
            seq=seq,
            prefer=None,
            excluded=excluded,
            lapsed_by=[],
            queue_token=None,
        )

    check, other = task(1, frozenset({"a"})), task(2, frozenset())
    queues.push(check)
    queues.push(other)
    assert queues.best("a", ["stage1"]) is other  # the older check is skipped, and stays queued
    assert queues.best("b", ["stage1"]) is check
    queues.discard(other)
    assert queues.best("a", ["stage1"]) is None


def test_the_relays_copy_of_a_stage_computes_what_a_worker_does() -> None:
    """The referee's forward of stage 0 on a micro-batch and its backward of the last stage are a
    worker's (the same stage code, masks and precision), so an honest result is at distance 0."""
    referee, stages = referee_and_stages(version=5)
    batch = torch.randint(0, 256, (2, BYTE_SPEC.kwargs["seq_len"] + 1))
    y = compute.forward(stages[0], stages[0].inputs(batch), 7).reshape(-1, WIDTH)
    batch_entry = payloads.encode({"batch": batch.numpy()})
    assert distance(referee.compute(Step(FIRST, 0, 7), 5, {"batch": batch_entry}), y.numpy()) == 0.0
    assert referee.compute(Step(FIRST, 0, 7), 4, {"batch": batch_entry}) is None  # another version: no opinion
    x = y.view(2, -1, WIDTH)
    g = compute.backward(stages[1], x, 7, grad_output=None, batch=batch, samples=2).input.reshape(-1, WIDTH)
    inputs = {"a0": entry(y.numpy()), "batch": batch_entry}
    assert distance(referee.compute(Step(LAST, 1, 7), 5, inputs), g.numpy()) < 1e-6


def test_a_first_stage_result_that_differs_from_the_relays_copy_bans_its_worker() -> None:
    """Checked first-stage results go to the referee; one 1.3x off is banned, with its reason."""
    truth = np.random.default_rng(2).normal(size=(16, WIDTH)).astype(np.float32)
    referee = SimpleNamespace(compute=lambda step, version, inputs: truth)
    banned, settled = [], []
    checks = trust(1.0, referee=referee, banned=lambda w, r: banned.append((w, r)), settled=lambda: settled.append(1))

    async def run() -> None:
        checks.accepted("t1", Step(FIRST, 0, 3), "honest", {"a0": entry(truth), "batch": b""}, {})
        checks.accepted("t2", Step(FIRST, 0, 4), "liar", {"a0": entry(1.3 * truth), "batch": b""}, {})
        assert not checks.settled  # the round waits for both
        await asyncio.gather(*checks.referee_tasks)

    asyncio.run(run())
    assert [w for w, _ in banned] == ["liar"] and "relay's own computation" in banned[0][1]
    assert checks.settled and settled and checks.counters.refereed == 2
    status = checks.status()
    assert [b.worker for b in status.bans] == ["liar"] and status.max_agreeing_distance == 0.0


def test_a_disagreement_between_two_workers_is_refereed_and_only_the_liar_banned() -> None:
    truth = np.random.default_rng(3).normal(size=(16, WIDTH)).astype(np.float32)
    referee = SimpleNamespace(compute=lambda step, version, inputs: truth)
    banned, submitted = [], []

    def submit(step, exclude):
        submitted.append(exclude)
        return f"c{len(submitted)}"

    checks = trust(1.0, referee=referee, banned=lambda w, r: banned.append(w), submit_check=submit)

    async def run() -> None:
        checks.accepted("t1", Step(LAST, 1, 0), "honest", {"g0": entry(truth)}, {})
        assert submitted == [frozenset({"honest"})] and checks.is_check("c1")
        checks.check_result("c1", "liar", {"g0": entry(-truth)})  # the checker lies
        await asyncio.gather(*checks.referee_tasks)
        checks.accepted("t2", Step(LAST, 1, 1), "honest", {"g0": entry(truth)}, {})
        checks.check_result("c2", "other", {"g0": entry(truth * (1 + 1e-6))})  # agrees

    asyncio.run(run())
    assert banned == ["liar"] and checks.counters.disagreed == 1 and checks.counters.agreed == 1
    assert checks.settled


@pytest.mark.parametrize(
    "pipeline, message",
    [
        ({"check_share": 1.5}, "pipeline.check_share must be 0..1"),
        ({"check_share": 0.1, "dispatch": "static"}, 'needs pipeline.dispatch = "pool"'),
    ],
)
def test_a_bad_check_share_is_refused_in_one_line_naming_the_field(pipeline, message) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(None, env={}, overrides=pipeline_overrides(BYTE_SPEC, stages=2, **pipeline))
    assert message in str(refused.value) and "\n" not in str(refused.value)
