"""A task's result on arrival: validated before anything sees it, then (the first result of a
task wins) its boundary stored and the next step queued; a spot check's result goes to the
checks (:mod:`relay_server.trust`) and nowhere else. A first-stage task that carried its data (a
rollback's replay, :mod:`.kept_inputs`) must send that data back.

Owns the counters of what arriving results cost: duplicates refused (a late copy of a task
another worker finished) and stage gradients recomputed (``redo`` steps accepted).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from relay_server.core.errors import ApiError
from relay_server.pipeline.kept_inputs import refuse_other_data
from relay_server.pipeline.ledger import BACKWARD, FIRST, LAST
from relay_server.pipeline.results import Shapes, read_result
from toolkit.wire.protocol import PipelineAck

if TYPE_CHECKING:
    from relay_server.pipeline.boundaries import Boundaries
    from relay_server.pipeline.figures import PipelineFigures
    from relay_server.pipeline.guard import PipelineGuard
    from relay_server.pipeline.in_flight import InFlight
    from relay_server.pipeline.plan import Planner
    from relay_server.pipeline.task_pool import TaskPool
    from relay_server.pipeline.workers import Workers
    from relay_server.tasks.broker import TaskBroker
    from relay_server.trust.checks import PipelineTrust
    from toolkit.wire.compression import Codec


@dataclass(frozen=True)
class ResultDeps:
    """What accepting a result works through (each owns its own state)."""

    pool: TaskPool
    broker: TaskBroker
    workers: Workers
    flight: InFlight
    boundaries: Boundaries
    guard: PipelineGuard
    trust: PipelineTrust
    figures: PipelineFigures
    shapes: Shapes
    codec: Codec
    advance: Callable[[], None]
    """The coordinator: the batch may be complete now (open its round when it may)."""
    planner: Planner | None = None
    clock: Callable[[], float] = time.monotonic
    carried: Callable[[int], bytes | None] = lambda microbatch: None
    """The data a micro-batch's first-stage task carries (a rollback's replay), if any."""


class TaskResults:
    """Results in, boundaries stored, next steps queued; what duplicates and redos cost."""

    def __init__(self, deps: ResultDeps) -> None:
        self.deps = deps
        self.redone = 0
        """Stage gradients recomputed (a ``redo`` step's result accepted)."""
        self.refused = 0
        """Duplicate results answered ``accepted: false`` (another worker's copy won)."""

    def result(self, worker: str, task_id: str, body: bytes) -> PipelineAck:
        """Validate a task's result, then (first result wins) store its boundary and queue the next
        step; a spot check's result goes to the checks (:mod:`relay_server.trust`), nowhere else."""
        d = self.deps
        d.guard.seen(worker)
        d.trust.admit(worker)
        task = d.broker.tasks.get(task_id)
        if task is not None and task.state == "done":
            if task.worker == worker:  # our own result, retried after a lost answer
                return PipelineAck(task_id=task_id, accepted=True)
            self.refused += 1
            return PipelineAck(task_id=task_id, accepted=False)
        step = d.pool.steps.get(task_id)
        if step is None:
            raise ApiError(
                410,
                "task_expired",
                f"task {task_id!r} is not part of the batch in flight",
                "Drop this result and its gradient; take the next task.",
            )
        if d.workers.by_id.get(worker) is not None and d.workers.stage_of(worker) != step.stage:
            raise ApiError(
                410,
                "stage_moved",
                f"this worker moved off stage {step.stage}; its result for it is not used",
                "Drop it and take the next task of your new stage.",
            )
        ledger = d.flight.ledgers[step.batch]
        mb = ledger.microbatches[step.microbatch]
        accepted = read_result(body, step, mb.rows, d.shapes, d.codec)  # before the broker sees it
        if step.kind == FIRST:
            refuse_other_data(step.microbatch, accepted.entries["batch"], d.carried(step.microbatch))
        try:
            task = d.broker.complete(worker, task_id, b"")
        except ApiError as exc:
            if exc.code in ("task_done",):
                self.refused += 1
                return PipelineAck(task_id=task_id, accepted=False)
            raise
        d.figures.task_accepted(worker)
        if d.trust.is_check(task_id):
            del d.pool.steps[task_id]
            d.trust.check_result(task_id, worker, accepted.entries)
            # a checker's parameter gradient must not be held: "not accepted", as a duplicate is
            return PipelineAck(task_id=task_id, accepted=step.kind not in (LAST, BACKWARD))
        if d.planner is not None and task.attempts == 1 and task.leased_at is not None:
            d.planner.observe_task(worker, d.clock() - task.leased_at)
        for name, entry in accepted.entries.items():
            d.boundaries.put(step.microbatch, name, entry)
        if step.redo:
            self.redone += 1
        following = ledger.accept(step, worker, rows=accepted.rows, loss_sum=accepted.result.loss_sum)
        d.guard.now_holds(worker, step)
        del d.pool.steps[task_id]
        d.trust.accepted(task_id, step, worker, accepted.entries, accepted.norms or {})
        if following is not None:
            d.pool.submit(following)
        else:
            d.advance()
        return PipelineAck(task_id=task_id, accepted=True)
