"""The staged pipeline's star planner, what the relay runs (issue 23, deliverable 3): it respects
memory, balances compute and rebalances only when a move pays for its download. The paper's general
planning it reduces is tests/research/test_hetero_pipeline.py's. Pure computation: no processes, no
clock."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from relay_server.pipeline.star import apply_move, assign_joiner, plan_star, rebalance
from relay_server.pipeline.star_model import (
    MeasuredWorker,
    ModelShape,
    PipelineConfig,
    StagePlanError,
    boundary_bytes_per_sample,
    stage_seconds,
)

GB = 1 << 30


# ---------------------------------------------------------------- the star (B5)


def _model(layers: int = 12) -> ModelShape:
    return ModelShape(layers, 7_000_000, 40_000_000, 40_000_000, boundary_bytes_per_sample("float16", 768, 128))


def _workers(rng: np.random.Generator, n: int) -> list[MeasuredWorker]:
    return [
        MeasuredWorker(
            f"w{i}",
            int(rng.uniform(0.6, 4) * GB),
            float(rng.uniform(50, 500)),
            float(rng.uniform(0.01, 0.2)),
            float(rng.uniform(5e6, 1e8)),
        )
        for i in range(n)
    ]


def test_star_picks_the_fastest_memory_feasible_stage_count() -> None:
    rng = np.random.default_rng(1)
    model = _model()
    checked = 0
    for _ in range(30):
        workers = _workers(rng, int(rng.integers(2, 9)))
        try:
            plan = plan_star(workers, model, PipelineConfig())
        except StagePlanError as err:
            assert "memory" in str(err)
            continue
        feasible = {}
        for k in range(1, min(model.layers, len(workers)) + 1):
            try:
                feasible[k] = plan_star(workers, model, PipelineConfig(stages=k)).seconds_per_batch
            except StagePlanError as err:
                assert "memory" in str(err) or "workers" in str(err)
        assert plan.seconds_per_batch == pytest.approx(min(feasible.values()), rel=1e-12)
        assert len(plan.stages) == min(feasible, key=lambda k: (feasible[k], k))
        layers = [s.layer_end - s.layer_start for s in plan.stages]
        assert sum(layers) == model.layers and min(layers) >= 1
        assert plan.stages[0].layer_start == 0 and all(
            a.layer_end == b.layer_start for a, b in zip(plan.stages, plan.stages[1:])
        )
        by_id = {w.id: w for w in workers}
        for stage in plan.stages:
            assert all(by_id[i].memory_bytes >= stage.memory_bytes for i in stage.workers)
        json.dumps(plan.to_json())
        checked += 1
    assert checked >= 20


def test_star_lpt_spreads_compute_within_the_largest_worker() -> None:
    rng = np.random.default_rng(4)
    for _ in range(30):
        count = int(rng.integers(3, 12))
        workers = [MeasuredWorker(f"w{i}", 64 * GB, float(rng.uniform(10, 500)), 0.01, 1e9) for i in range(count)]
        for k in range(2, min(4, len(workers)) + 1):
            plan = plan_star(workers, _model(), PipelineConfig(stages=k))
            compute = [s.compute for s in plan.stages]
            assert max(compute) - min(compute) <= max(w.samples_per_s for w in workers) + 1e-9


def test_star_memory_infeasible_config_names_the_memory() -> None:
    small = [MeasuredWorker(f"w{i}", int(0.3 * GB), 100.0, 0.05, 1e7) for i in range(4)]
    fits = r"stages=2 does not fit the workers' memory: .* needs \d+ bytes .* largest worker memory is \d+ bytes"
    with pytest.raises(StagePlanError, match=fits):
        plan_star(small, _model(), PipelineConfig(stages=2))
    with pytest.raises(StagePlanError, match="memory"):
        plan_star(small, _model(), PipelineConfig())
    with pytest.raises(StagePlanError, match="stages must be a positive number"):
        plan_star(small, _model(), PipelineConfig(stages=0))
    # A worker too small for any stage sits out instead of making the plan impossible.
    plan = plan_star(small[:1] + [MeasuredWorker("big", 8 * GB, 100.0, 0.05, 1e7)], _model(), PipelineConfig(stages=1))
    assert [w.id for w in plan.idle] == ["w0"] and plan.stages[0].workers == ("big",)


def test_star_joiner_goes_to_the_bottleneck_it_can_hold() -> None:
    workers = [
        MeasuredWorker("a", 4 * GB, 400.0, 0.02, 1e8),
        MeasuredWorker("b", 4 * GB, 100.0, 0.02, 1e8),
        MeasuredWorker("c", 4 * GB, 90.0, 0.02, 1e8),
    ]
    plan = plan_star(workers, _model(), PipelineConfig(stages=2))
    slowest = plan.bottleneck
    joined = assign_joiner(plan, MeasuredWorker("j", 4 * GB, 200.0, 0.02, 1e8))
    assert joined.stage_of("j") == slowest and joined.seconds_per_batch < plan.seconds_per_batch
    need = min(s.memory_bytes for s in plan.stages)
    with pytest.raises(StagePlanError, match=f"needs {need} bytes"):
        assign_joiner(plan, MeasuredWorker("tiny", need - 1, 200.0, 0.02, 1e8))


def test_rebalance_moves_only_when_the_gain_beats_the_download() -> None:
    model, workers = _model(), [MeasuredWorker(f"w{i}", 4 * GB, 200.0, 0.02, 1e8) for i in range(5)]
    plan = plan_star(workers, model, PipelineConfig(stages=2, rebalance_every_batches=50))
    assert rebalance(plan, workers) is None  # as planned: no move gains
    small = min(plan.stages, key=lambda s: len(s.workers))
    slowed = [
        MeasuredWorker(w.id, w.memory_bytes, 5.0, w.rtt_s, w.bandwidth) if w.id == small.workers[0] else w
        for w in workers
    ]
    current = (
        max(
            stage_seconds(
                [w for w in slowed if w.id in s.workers], model, plan.config, s.index, 2, s.layer_end - s.layer_start
            )
            for s in plan.stages
        )
        * 9
        / 8
    )
    move = rebalance(plan, slowed)
    assert move is not None and move.to_stage == small.index and move.from_stage != small.index
    assert move.gain_s_per_batch * 50 > move.download_s
    after = apply_move(plan, move, slowed)
    assert after.seconds_per_batch == pytest.approx(move.seconds_per_batch_after)
    assert after.seconds_per_batch == pytest.approx(current - move.gain_s_per_batch)
    # The same imbalance, checked every batch, behind a slow link: the download costs more.
    thin = [MeasuredWorker(w.id, w.memory_bytes, w.samples_per_s, w.rtt_s, 1e5) for w in slowed]
    thin_plan = plan_star(workers, model, PipelineConfig(stages=2, rebalance_every_batches=1))
    assert rebalance(thin_plan, thin) is None
    # A stage everyone left: a move to it always pays.
    gone = [w for w in workers if w.id not in small.workers]
    rescue = rebalance(plan, gone)
    assert rescue is not None and rescue.to_stage == small.index and math.isinf(rescue.gain_s_per_batch)


def test_an_empty_stage_is_staffed_by_any_worker_that_can_move() -> None:
    """Stage 2 left empty: the first worker (by id) of the most crowded stage holds a stage
    gradient it has not uploaded, so the next one is tried, then the next stage's (issue 41:
    only the first was ever tried, and the stage stayed empty)."""
    from relay_server.pipeline.plan import Planner

    planner = Planner(_model(6), PipelineConfig(stages=3, microbatch_size=2, microbatches=4), [2, 2, 2])
    placement = {"a": (0, 0), "b": (0, 0), "c": (0, 0), "d": (1, 0), "e": (1, 0)}
    move = planner.fill_empty(placement, can_move=lambda w: w != "a")
    assert (move.worker, move.from_stage, move.to_stage) == ("b", 0, 2)
    move = planner.fill_empty(placement, can_move=lambda w: w in ("d", "e"))
    assert (move.worker, move.from_stage, move.to_stage) == ("d", 1, 2)
    assert planner.fill_empty(placement, can_move=lambda w: False) is None


def test_a_joiner_is_placed_by_measured_task_rates_never_by_a_claimed_speed() -> None:
    """An idle worker claiming 1e12 samples/s on stage 0 drew every joiner to stage 1 (issue 41);
    claims are ignored: worker counts until every stage is measured, then measured task rates."""
    from relay_server.pipeline.workers import Workers

    workers = Workers([1000, 1000], [0, 0])
    assert workers.assign("liar", 0, 1e12).stage == 0
    assert workers.assign("h1", 0, 1.0).stage == 1
    assert workers.assign("h2", 0, 1.0).stage == 0  # 1 worker each: counts, not the claim
    measured = {"h1": 1.0, "h2": 0.1}.get  # seconds per task; the liar never finished one
    assert workers.assign("h3", 0, 1e12, task_s=measured).stage == 1  # stage 0: 2 x 10 tasks/s, stage 1: 1
