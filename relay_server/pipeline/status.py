"""``GET /api/pipeline``: what the Pipeline panel of the dashboard shows."""

from __future__ import annotations

from typing import TYPE_CHECKING

from toolkit.wire.protocol import PipelineStatus, StageStatus

if TYPE_CHECKING:
    from relay_server.pipeline.coordinator import PipelineCoordinator


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
    times = c.rounds.batch_times
    measured = sum(times) / len(times) if times else None
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
        predicted_batch_s=c.predicted_batch_s,
        measured_batch_s=measured,
        redispatched=c.broker.stats.requeued,
        redone=c.redone,
        refused_results=c.refused,
        restarted=c.restarted,
        silenced=c.silenced,
        expired_holds=c.guard.expired_holds,
        lapsed_leases=c.guard.lapsed_leases,
        cut_uploads=c.guard.cut_uploads,
        refused_steps=c.owners.refused_rounds,
        hold_deadline_s=[c.guard.hold_deadline(k) for k in range(c.K)],
        counted=[list(x) for x in c.rounds.counted],
    )
