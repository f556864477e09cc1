"""The batches' tasks on the broker: which step each task computes, the queue it waits in, and
the ways tasks leave it early (their batch is over, restarted, or -- with ``dispatch =
"restart"`` -- their micro-batch starts again from stage 0).

The pool is the relay's task broker, one key per stage; this object owns the map from a task
id to the :class:`~relay_server.pipeline.ledger.Step` it computes and, with ``dispatch =
"static"``, each (stage, micro-batch)'s pinned worker. Everything that submits or cancels a
pipeline task goes through it, so no task outlives its step and no step its task.
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING

from relay_server.core.errors import ApiError
from relay_server.pipeline.ledger import BACKWARD, FIRST, LAST, Ledger, Step

if TYPE_CHECKING:
    from relay_server.pipeline.boundaries import Boundaries
    from relay_server.pipeline.in_flight import InFlight
    from relay_server.pipeline.workers import Workers
    from relay_server.tasks.broker import TaskBroker
    from relay_server.tasks.task import Task

log = logging.getLogger(__name__)
NO_DEADLINE_S = 7 * 24 * 3600.0  # tasks never fail by age: their leases expire and they are re-dispatched


def stage_key(stage: int) -> str:
    """The broker's queue of a stage's tasks (a pinned worker's is ``stage_key(k)/worker``)."""
    return f"stage{stage}"


class TaskPool:
    """Task id -> step for the batches in flight, and the static baseline's pins."""

    def __init__(
        self,
        broker: TaskBroker,
        workers: Workers,
        flight: InFlight,
        boundaries: Boundaries,
        num_stages: int,
        dispatch: str,
    ) -> None:
        self.broker, self.workers, self.flight, self.boundaries = broker, workers, flight, boundaries
        self.K, self.dispatch = num_stages, dispatch
        self.steps: dict[str, Step] = {}
        """task id -> what it computes (tasks of the batches in flight)."""
        self.pins: dict[tuple[int, int], str] = {}
        """``dispatch = "static"``: (stage, micro-batch) -> its worker."""
        self.restarted = 0
        """Micro-batches restarted from stage 0 (``dispatch = "restart"``)."""

    def start(self, ledger: Ledger) -> None:
        """A freshly minted batch: with ``dispatch = "static"`` each stage's micro-batches are dealt
        round-robin to its workers now; its first steps are queued."""
        if self.dispatch == "static":
            self.pins |= {
                (k, m): ws[i % len(ws)]
                for k in range(self.K)
                if (ws := self.workers.on_stage(k))
                for i, m in enumerate(ledger.microbatches)
            }
        for step in ledger.start():
            self.submit(step)

    def submit(self, step: Step, exclude: frozenset[str] = frozenset()) -> str:
        """Queue ``step`` (``exclude``: workers never to lease it, a spot check's); its task id."""
        backward_work = step.kind in (LAST, BACKWARD)
        task = self.broker.submit(
            caller="pipeline",
            call_id=f"{step.batch}.{step.kind}.{step.stage}."
            f"{step.microbatch}.{'r' if step.redo else ''}{'c' if exclude else ''}{secrets.token_hex(4)}",
            key=self.key_of(step),
            kind=step.kind,
            rows=1,
            payload=b"",
            timeout_s=NO_DEADLINE_S,
            requeue_on_loss=True,
            prefer=step.prefer,
            priority=(0 if backward_work else 1, step.batch, step.microbatch),
            exclude=exclude,
        )
        self.steps[task.task_id] = step
        return task.task_id

    def key_of(self, step: Step) -> str:
        """The queue a step goes to: its stage's (any worker of the stage may take it), or with
        ``dispatch = "static"`` its pinned worker's (it waits for that worker, whatever happens)."""
        pinned = self.pins.get((step.stage, step.microbatch)) if self.dispatch == "static" else None
        return f"{stage_key(step.stage)}/{pinned}" if pinned else stage_key(step.stage)

    def drop(self, task_id: str, code: str) -> None:
        """A task no longer wanted (a spot check's, say): cancelled, its step forgotten."""
        if self.steps.pop(task_id, None) is not None:
            self.broker.cancel(task_id, ApiError(410, code, "this task is no longer wanted"))

    def batch_over(self, closed: Ledger) -> None:
        """The batch's step is published: nothing of it may be leased after its boundaries go."""
        for task_id, step in list(self.steps.items()):
            if step.batch == closed.batch:
                self.broker.cancel(task_id, ApiError(410, "batch_over", "the batch this task belonged to is over"))
                del self.steps[task_id]
        for m in closed.microbatches:
            for k in range(self.K):
                self.pins.pop((k, m), None)

    def cancel_all(self) -> None:
        """A liar was banned: every task of the batches in flight is cancelled (the batch restarts)."""
        for task_id in list(self.steps):
            self.broker.cancel(task_id, ApiError(410, "batch_restarted", "the batch restarted: a liar was banned"))
        self.steps.clear()

    def still_wanted(self, task: Task) -> bool:
        """Whether a leased task's step still exists with all its inputs (else it is cancelled)."""
        step = self.steps.get(task.task_id)
        if step is not None and all(self.boundaries.has(step.microbatch, name) for name in step.inputs()):
            return True
        if step is not None:  # a bug, not a worker's doing: never hand out a task without its inputs
            log.error("pipeline task %s (%s) has lost its inputs; cancelled", task.task_id, step)
            del self.steps[task.task_id]
        self.broker.cancel(task.task_id, ApiError(410, "batch_over", "the batch this task belonged to is over"))
        return False

    def restart_lost(self) -> None:
        """``dispatch = "restart"`` (the SWARM-like baseline): a micro-batch whose forward pass lost
        its worker (a lease expired or the worker left) starts again from stage 0 as a new
        micro-batch, its work so far dropped. Losses in the backward pass are recomputed as the
        pool does (a stage gradient accepted there must not count twice)."""
        if self.dispatch != "restart":
            return
        for task_id, step in list(self.steps.items()):
            task = self.broker.tasks.get(task_id)
            if task is None or task.attempts < 1 or task.state != "queued" or step.kind == BACKWARD or step.redo:
                continue
            self.broker.cancel(task_id, ApiError(410, "restarted", "the micro-batch restarts from stage 0"))
            del self.steps[task_id]
            self.boundaries.drop(step.microbatch)
            fresh = self.flight.next_microbatch
            self.flight.next_microbatch += 1
            self.flight.ledgers[step.batch].replace(step.microbatch, fresh)
            self.restarted += 1
            self.submit(Step(FIRST, 0, fresh, batch=step.batch))
