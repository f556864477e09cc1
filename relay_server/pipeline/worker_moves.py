"""Moving workers between stages: the planner's rebalancing between batches, staffing a stage
left with no worker, and recomputing the stage gradients of a worker gone silent.

Owns the figures of those moves (how many, how many silent workers' gradients were recomputed,
the planner's predicted time per batch); the placement itself is :class:`~.workers.Workers`'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from relay_server.pipeline.task_pool import stage_key

if TYPE_CHECKING:
    from relay_server.pipeline.batch_rounds import PipelineRounds
    from relay_server.pipeline.guard import PipelineGuard
    from relay_server.pipeline.in_flight import InFlight
    from relay_server.pipeline.plan import Planner
    from relay_server.pipeline.workers import Workers
    from relay_server.tasks.broker import TaskBroker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MoveDeps:
    """What moving a worker works through (each owns its own state)."""

    broker: TaskBroker
    workers: Workers
    rounds: PipelineRounds
    guard: PipelineGuard
    flight: InFlight
    planner: Planner | None
    dispatch: str
    rebalance_every: int


class WorkerMoves:
    """The planner's moves and the silent workers' recomputes, with their counts."""

    def __init__(self, deps: MoveDeps) -> None:
        self.deps = deps
        self.moves = 0
        """Workers moved to another stage."""
        self.silenced = 0
        """Silent workers whose held stage gradients were recomputed by others."""
        self.predicted_batch_s: float | None = None
        """The planner's predicted time per batch for the current placement."""

    def replan(self, round_s: float) -> None:
        """Between batches: re-time the placement (the predicted time per batch), and every
        ``rebalance_every`` batches move the one worker whose move the planner says pays."""
        d = self.deps
        if d.planner is None:
            return
        d.planner.observe_round(round_s)
        placement = d.workers.placement()
        due = d.dispatch == "pool" and d.rebalance_every and d.flight.batch_index % d.rebalance_every == 0
        move = d.planner.move(placement) if due else None
        d.planner.replan(placement)
        self.predicted_batch_s = d.planner.predicted_batch_s()
        if move is not None:
            self._move(
                d.planner, move.worker, move.to_stage, f"predicted {move.gain_s_per_batch:.2f} s per batch faster"
            )

    def staff_empty_stages(self) -> None:
        """A stage with no worker that serves it (only idle or struck ones, or none) stalls the
        batch: move one there now from a stage with two or more that serve theirs, any that
        holds no stage gradient yet to upload (``dispatch = "pool"`` only)."""
        d = self.deps
        if d.planner is None or d.dispatch != "pool":
            return
        move = d.planner.fill_empty(d.guard.serving_placement(), can_move=lambda w: not d.flight.owned(w))
        if move is not None:
            self._move(d.planner, move.worker, move.to_stage, "its new stage had no worker")

    def _move(self, planner: Planner, worker: str, stage: int, why: str) -> None:
        d = self.deps
        log.info(
            "pipeline: worker %s moves from stage %d to stage %d (%s)",
            worker[:16],
            d.workers.stage_of(worker),
            stage,
            why,
        )
        d.broker.worker_left(worker)  # tasks it holds of its old stage go back to that stage's queue
        if d.flight.owned(
            worker
        ):  # (delayed updates) it holds the computing batch's gradients: its new stage drops them
            d.rounds.recompute(worker)
        d.workers.move(worker, stage)
        planner.forget(worker)
        self.moves += 1

    def orphan_silent(self, silence: dict[str, float]) -> None:
        """Workers holding stage gradients of this batch and silent (no request, no heartbeat)
        for longer than their stage's lease deadline: their micro-batches' stage gradient is
        recomputed by others now, not when the registry drops them (a volunteer whose notebook
        froze must not hold the round). If such a worker comes back, it holds nothing the relay
        will count (its ticket request no longer matches) and drops that gradient. Not with
        ``dispatch = "static"``: that baseline waits for its workers."""
        d = self.deps
        if d.dispatch == "static":
            return
        for worker, silent_s in silence.items():
            owned = d.flight.owned(worker)
            if not owned or silent_s <= max(d.broker.lease_deadline(stage_key(k)) for k in owned):
                continue
            redo = d.rounds.recompute(worker)
            if redo:
                log.info(
                    "pipeline worker %s silent for %.1f s holding %d stage gradient(s): recomputing them",
                    worker[:16],
                    silent_s,
                    redo,
                )
                self.silenced += 1
