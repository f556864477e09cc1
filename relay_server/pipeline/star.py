"""The planner in collabtrain's star (:mod:`.star_model` has the time model and the types): how
many stages, which volunteers run which stage, how many layers each stage gets, where a joiner
goes and when a worker should move.

With one relay holding every boundary the paper's partition search degenerates (:mod:`.partition`
is the general form): there is no server graph to cluster and no order to find, and a worker's
link is the same to every stage. What decides a plan is compute and memory: workers are spread
over the stages by compute (longest processing time first, so stage compute differs by at most
the largest worker's), layers follow stage compute (the min-max allocation, which for
compute-bound stages is the proportional one within a layer, and which also counts each stage's
transfers) under every assigned worker's memory, and the number of stages is the one whose
predicted time per batch is least among those memory allows.
"""

from __future__ import annotations

import math
from typing import Sequence

from relay_server.pipeline.star_model import (
    Candidate,
    MeasuredWorker,
    ModelShape,
    Move,
    PipelineConfig,
    PlannedStage,
    StagePlan,
    StagePlanError,
    layer_capacity,
    relay_bytes_per_batch,
    stage_fixed_params,
    stage_memory,
    stage_seconds,
)


def _lpt(
    workers: Sequence[MeasuredWorker], num_stages: int, model: ModelShape, cfg: PipelineConfig
) -> list[list[MeasuredWorker]] | None:
    """Workers by decreasing compute, each to the stage with the least compute so far among those
    it can hold one layer of; a low-memory worker goes where it drags the stage's cap least."""
    groups: list[list[MeasuredWorker]] = [[] for _ in range(num_stages)]
    for w in sorted(workers, key=lambda w: (-w.samples_per_s, w.id)):
        fits = [k for k in range(num_stages) if layer_capacity(w, model, cfg, k, num_stages) >= 1]
        if not fits:
            return None
        empty = [k for k in fits if not groups[k]]
        pool = empty or fits
        k = min(pool, key=lambda k: (sum(x.samples_per_s for x in groups[k]), k))
        groups[k].append(w)
    return groups if all(groups) else None


def _by_memory(
    workers: Sequence[MeasuredWorker], num_stages: int, model: ModelShape, cfg: PipelineConfig
) -> list[list[MeasuredWorker]] | None:
    """The alternative when memory binds: workers of similar memory together (largest memories on
    the stages that carry the embeddings and head), so a small worker does not cap a large one's
    stage; contiguous groups of memory order cut at equal compute."""
    ranked = sorted(workers, key=lambda w: (-w.memory_bytes, w.id))
    total = sum(w.samples_per_s for w in ranked)
    groups: list[list[MeasuredWorker]] = [[] for _ in range(num_stages)]
    acc, k = 0.0, 0
    for i, w in enumerate(ranked):
        left = len(ranked) - i
        if k < num_stages - 1 and groups[k] and (acc >= total * (k + 1) / num_stages or left <= num_stages - 1 - k):
            k += 1
        groups[k].append(w)
        acc += w.samples_per_s
    order = [0, num_stages - 1] + list(range(1, num_stages - 1)) if num_stages > 1 else [0]
    placed: list[list[MeasuredWorker]] = [[] for _ in range(num_stages)]
    for group, k in zip(groups, order):
        placed[k] = group
    return placed if all(placed) else None


def _allocate(
    groups: list[list[MeasuredWorker]], model: ModelShape, cfg: PipelineConfig
) -> tuple[list[int], float] | None:
    """Layers minimising the slowest stage under each stage's memory cap (its smallest worker's),
    one layer at a time to the stage that stays fastest; ``None`` when the caps cannot hold L."""
    k_total = len(groups)
    caps = [min(layer_capacity(w, model, cfg, k, k_total) for w in g) for k, g in enumerate(groups)]
    if any(c < 1 for c in caps) or sum(caps) < model.layers or k_total > model.layers:
        return None
    alloc = [1] * k_total

    def after(k: int) -> float:
        return stage_seconds(groups[k], model, cfg, k, k_total, alloc[k] + 1)

    for _ in range(model.layers - k_total):
        k = min((k for k in range(k_total) if alloc[k] < caps[k]), key=lambda k: (after(k), k))
        alloc[k] += 1
    return alloc, max(stage_seconds(g, model, cfg, k, k_total, h) for k, (g, h) in enumerate(zip(groups, alloc)))


def _allocate_dropping(
    groups: list[list[MeasuredWorker]], model: ModelShape, cfg: PipelineConfig
) -> tuple[list[list[MeasuredWorker]], list[int], float] | None:
    """:func:`_allocate`, leaving out the smallest-memory worker of the most constrained stage
    while the caps cannot hold the model (it sits out this plan rather than making it
    impossible), and keeping the fastest of the plans found on the way."""
    groups = [list(g) for g in groups]
    k_total, best = len(groups), None
    while all(groups):
        found = _allocate(groups, model, cfg)
        if found is not None and (best is None or found[1] < best[2]):
            best = ([list(g) for g in groups], found[0], found[1])
        if found is not None:
            return best
        k = min(range(k_total), key=lambda k: min(layer_capacity(w, model, cfg, k, k_total) for w in groups[k]))
        groups[k].remove(min(groups[k], key=lambda w: (w.memory_bytes, w.samples_per_s, w.id)))
    return best


def build_plan(
    groups: Sequence[Sequence[MeasuredWorker]],
    layers: Sequence[int],
    model: ModelShape,
    cfg: PipelineConfig,
    candidates: Sequence[Candidate] = (),
    idle_from: Sequence[MeasuredWorker] = (),
) -> StagePlan:
    """The plan for given groups and layers: every stage's time and memory, the bottleneck; the
    workers of ``idle_from`` that no group holds sit out (not enough memory for any stage)."""
    k_total, start, stages = len(groups), 0, []
    for k, (g, h) in enumerate(zip(groups, layers)):
        params = h * model.layer_params + stage_fixed_params(model, k, k_total)
        stages.append(
            PlannedStage(
                k,
                start,
                start + h,
                tuple(w.id for w in g),
                float(sum(w.samples_per_s for w in g)),
                params,
                stage_memory(model, cfg, k, k_total, h),
                stage_seconds(g, model, cfg, k, k_total, h),
            )
        )
        start += h
    slowest = max(range(k_total), key=lambda k: stages[k].seconds_per_batch)
    placed = tuple(w for g in groups for w in g)
    idle = tuple(w for w in idle_from if w.id not in {p.id for p in placed})
    fill = (cfg.microbatches + k_total - 1) / cfg.microbatches
    return StagePlan(
        tuple(stages),
        stages[slowest].seconds_per_batch * fill,
        slowest,
        relay_bytes_per_batch(model, cfg, k_total),
        model,
        cfg,
        placed,
        tuple(candidates),
        idle,
    )


def _plan_k(
    workers: Sequence[MeasuredWorker], k: int, model: ModelShape, cfg: PipelineConfig
) -> tuple[StagePlan | None, str]:
    """The plan with k stages: LPT's assignment, or where memory leaves it no plan the grouping by
    memory; or why there is none."""
    if k > model.layers:
        return None, f"stages={k} needs at least {k} layers; the model has {model.layers}"
    if k > len(workers):
        return None, f"stages={k} needs at least {k} workers; there are {len(workers)}"
    for assign in (_lpt, _by_memory):
        groups = assign(workers, k, model, cfg)
        allocated = _allocate_dropping(groups, model, cfg) if groups is not None else None
        if allocated is not None:
            return build_plan(allocated[0], allocated[1], model, cfg, idle_from=workers), "memory-feasible"
    largest = max(w.memory_bytes for w in workers)
    need = min(stage_memory(model, cfg, s, k, math.ceil(model.layers / k)) for s in range(k))
    return None, (
        f"stages={k} does not fit the workers' memory: a stage of about {math.ceil(model.layers / k)} "
        f"layers needs {need} bytes ({cfg.bytes_per_param:g} B/param) and the largest worker memory "
        f"is {largest} bytes; use more stages or workers with more memory"
    )


def plan_star(workers: Sequence[MeasuredWorker], model: ModelShape, cfg: PipelineConfig) -> StagePlan:
    """The stage plan for measured ``workers``: ``cfg.stages`` stages, or with "auto" the number of
    stages with the least predicted seconds per batch among those memory allows (ties to fewer; one
    stage means the model fits and data parallelism is the better run). Workers no stage fits sit
    out (``plan.idle``). Raises :class:`StagePlanError` naming the memory (or the count) when no plan
    exists."""
    if not workers:
        raise StagePlanError("no workers to plan for: a stage plan needs at least one measured worker")
    if len({w.id for w in workers}) != len(workers):
        raise StagePlanError("worker ids must be unique")
    for w in workers:
        if w.samples_per_s <= 0 or w.bandwidth <= 0 or w.rtt_s < 0 or w.memory_bytes <= 0:
            raise StagePlanError(
                f"worker {w.id!r}: samples_per_s, bandwidth and memory_bytes must be > 0 and rtt_s >= 0"
            )
    if cfg.stages == "auto":
        counts = list(range(1, min(model.layers, len(workers)) + 1))
    elif isinstance(cfg.stages, int) and not isinstance(cfg.stages, bool) and cfg.stages >= 1:
        counts = [cfg.stages]
    else:
        raise StagePlanError(f'[pipeline] stages must be a positive number or "auto", not {cfg.stages!r}')
    tried = [(k,) + _plan_k(workers, k, model, cfg) for k in counts]
    candidates = [Candidate(k, p.seconds_per_batch if p else None, why) for k, p, why in tried]
    feasible = [(p.seconds_per_batch, k, p) for k, p, _ in tried if p is not None]
    if not feasible:
        prefix = "no number of stages up to {} fits: ".format(counts[-1]) if cfg.stages == "auto" else ""
        raise StagePlanError(prefix + tried[-1][2])
    best = min(feasible, key=lambda f: (f[0], f[1]))[2]
    groups = [[w for w in best.workers if w.id in s.workers] for s in best.stages]
    return build_plan(groups, _layers(best), model, cfg, candidates, idle_from=workers)


def _regroup(plan: StagePlan, workers: Sequence[MeasuredWorker]) -> list[list[MeasuredWorker]]:
    by_id = {w.id: w for w in workers}
    return [[by_id[i] for i in s.workers if i in by_id] for s in plan.stages]


def _idle(groups: Sequence[Sequence[MeasuredWorker]]) -> int:
    """Stages nobody runs: while one is, the batch never finishes and every move to it pays."""
    return sum(1 for g in groups if not g)


def _layers(plan: StagePlan) -> list[int]:
    return [s.layer_end - s.layer_start for s in plan.stages]


def assign_joiner(plan: StagePlan, worker: MeasuredWorker) -> StagePlan:
    """A worker joining mid-run goes to the slowest stage whose memory it can hold (layers stay
    where they are: moving them would make every worker of two stages download). Raises
    :class:`StagePlanError` naming the memory when it can hold no stage."""
    if any(w.id == worker.id for w in plan.workers):
        raise StagePlanError(f"worker {worker.id!r} is already placed on stage {plan.stage_of(worker.id)}")
    fits = [s for s in plan.stages if s.memory_bytes <= worker.memory_bytes]
    if not fits:
        smallest = min(s.memory_bytes for s in plan.stages)
        raise StagePlanError(
            f"worker {worker.id!r} has {worker.memory_bytes} bytes of memory; the smallest "
            f"stage needs {smallest} bytes: it can serve a plan with more stages, not this one"
        )
    target = max(fits, key=lambda s: (s.seconds_per_batch, -s.index)).index
    groups = _regroup(plan, plan.workers)
    groups[target].append(worker)
    return build_plan(groups, _layers(plan), plan.model, plan.config, plan.candidates, plan.idle)


def rebalance(plan: StagePlan, measured: Sequence[MeasuredWorker]) -> Move | None:
    """Between batches: with the current placement re-timed on fresh measurements (workers absent
    from ``measured`` have left), the single move of a worker to another stage that saves the most,
    made only when the predicted saving per batch times the batches until the next check
    (``config.rebalance_every_batches``) exceeds the worker's download of its new stage's
    parameters; ``None`` when no move pays. A worker never leaves a stage it is alone on; workers
    the plan does not hold are ignored (they join through :func:`assign_joiner`)."""
    cfg, model = plan.config, plan.model
    groups = _regroup(plan, measured)
    layers = _layers(plan)
    current = build_plan(groups, layers, model, cfg).seconds_per_batch
    best: tuple[float, Move] | None = None
    for src, group in enumerate(groups):
        if len(group) < 2:
            continue
        for w in group:
            for dst, stage in enumerate(plan.stages):
                if dst == src or stage.memory_bytes > w.memory_bytes:
                    continue
                trial = [list(g) for g in groups]
                trial[src].remove(w)
                trial[dst].append(w)
                after = build_plan(trial, layers, model, cfg).seconds_per_batch
                if math.isfinite(current):
                    gain = current - after
                else:
                    gain = math.inf if _idle(trial) < _idle(groups) else 0.0
                download = w.rtt_s + stage.params * cfg.wire_bytes_per_param / w.bandwidth
                net = gain * cfg.rebalance_every_batches - download
                if gain > 0 and net > 0 and (best is None or net > best[0]):
                    best = (net, Move(w.id, src, dst, gain, download, after))
    return best[1] if best else None


def apply_move(plan: StagePlan, move: Move, measured: Sequence[MeasuredWorker] | None = None) -> StagePlan:
    """The plan after ``move`` (re-timed on ``measured`` when given)."""
    groups = _regroup(plan, measured if measured is not None else plan.workers)
    worker = next(w for w in groups[move.from_stage] if w.id == move.worker)
    groups[move.from_stage].remove(worker)
    groups[move.to_stage].append(worker)
    return build_plan(groups, _layers(plan), plan.model, plan.config, plan.candidates, plan.idle)
