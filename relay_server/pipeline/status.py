"""``GET /api/pipeline``: what the Pipeline panel of the dashboard shows, and (:func:`batch_progress`)
how far the batch in flight is, which ``GET /api/status`` reports as the step's progress."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relay_server.collaboration.status import RunFigures
from relay_server.pipeline.figures import batch_eta_s, tasks_per_batch
from toolkit.wire.protocol import BatchProgress, PipelineStatus, StageStatus

if TYPE_CHECKING:
    from relay_server.pipeline.coordinator import PipelineCoordinator
    from relay_server.pipeline.service import PipelineService


def measured_batch_s(c: "PipelineCoordinator") -> float | None:
    """The mean time of the last batches, from their first lease to their commit (None: none yet)."""
    times = c.rounds.batch_times
    return sum(times) / len(times) if times else None


def batch_progress(c: "PipelineCoordinator") -> BatchProgress:
    """The batch in flight in tasks (done of total), with the seconds until it commits."""
    total, done = tasks_per_batch(c.d, c.K), c.ledger.tasks_done
    started = c.rounds.batch_started.get(c.ledger.batch)
    elapsed = c.clock() - started if started is not None else None
    return BatchProgress(
        unit="tasks", done=done, total=total, eta_s=batch_eta_s(measured_batch_s(c), done, total, elapsed)
    )


def pipeline_status(c: "PipelineCoordinator") -> PipelineStatus:
    timings = c.broker.timings()
    stages, first = [], 0
    for k, (start, end) in enumerate(c.owners.cuts):
        key = f"stage{k}"
        queued = c.broker.queued_rows(key)
        leased = sum(1 for t in c.broker.tasks.values() if t.key == key and t.state == "leased")
        task_s = timings.get(key, {}).get("measured_s")
        stages.append(
            StageStatus(
                stage=k,
                layers=[first, first + c.layers[k]],
                params=end - start,
                workers=c.workers.on_stage(k),
                queued=queued,
                leased=leased,
                lease_s=c.broker.lease_deadline(key),
                task_s=task_s,
            )
        )
        first += c.layers[k]
    measured = measured_batch_s(c)
    progress = batch_progress(c)
    per_sample = (c.boundaries.bytes_in + c.bytes_out) / c.rounds.samples_done if c.rounds.samples_done else None
    return PipelineStatus(
        stages=stages,
        batch=c.ledger.batch,
        microbatches=c.d,
        finished=sum(mb.finished for mb in c.ledger.microbatches.values()),
        round_open=c.round is not None,
        boundary_memory_bytes=c.boundaries.memory_bytes,
        boundary_spilled_bytes=c.boundaries.spilled_bytes,
        boundary_bytes_per_sample=per_sample,
        predicted_batch_s=c.moves.predicted_batch_s,
        measured_batch_s=measured,
        redispatched=c.broker.stats.requeued,
        redone=c.results.redone,
        refused_results=c.results.refused,
        restarted=c.pool.restarted,
        silenced=c.moves.silenced,
        expired_holds=c.guard.expired_holds,
        lapsed_leases=c.guard.lapsed_leases,
        cut_uploads=c.guard.cut_uploads,
        refused_steps=c.owners.refused_rounds,
        hold_deadline_s=[c.guard.hold_deadline(k) for k in range(c.K)],
        counted=[list(x) for x in c.rounds.counted],
        tasks_done=progress.done,
        tasks_total=progress.total,
        eta_s=progress.eta_s,
        workers=[c.figures.credit(w, k) for k, st in enumerate(stages) for w in st.workers],
        traffic=c.figures.bytes.report(),
        wasted=list(c.figures.wasted),
        wasted_now=c.figures.wasted_since(c.ledger.batch, c.waste_totals()),
        trust=c.hooks.status(),
    )


def run_figures(service: "PipelineService") -> RunFigures:
    """What ``GET /api/status``, the peers' progress and the observers report for a pipeline run
    instead of the rounds' figures: the mode "pipeline", the batch's progress in tasks with its
    ETA, the samples of its finished micro-batches, each worker's credit; no averaging plan."""
    c = service.coordinator

    def credit(peer_id: str) -> tuple[int, int]:
        """Every peer of a pipeline run is a stage worker: its credit, 0 before it has one."""
        entry = c.figures.credit(peer_id)
        return entry.tasks, entry.samples

    return RunFigures(
        mode="pipeline",
        progress=batch_progress(c),
        samples_accumulated=sum(mb.finished for mb in c.ledger.microbatches.values()) * c.mb_size,
        credit=credit,
    )
