"""What keeps one worker from stalling the pipeline, however it behaves while it stays connected.

The pool already survives workers that leave or go silent (leases, :meth:`orphan_silent`). A
worker that stays alive -- heartbeating, polling -- and still holds things up needs rules that
look at what it *does*, measured on the relay, never at what it says:

* **Held stage gradients have a deadline.** From the moment the round opens (or the gradient was
  accepted, if later) a holder has the stage's *measured* hold time (round open to the parameter
  server's commit, median of recent holds, times the lease factor, at least the lease floor:
  :class:`~relay_server.tasks.timing.LeaseTimer`'s rule; the stage's lease deadline before a
  hold was measured) to get it committed. Past it, its micro-batches are recomputed by others whatever its
  heartbeats say, and its tickets are void. That bounds every round: each gradient the round
  waits for is either being uploaded or at most one hold deadline away from being recomputed.
* **A cap on leases per worker** (:data:`MAX_LEASES_PER_WORKER`): an honest worker computes one
  task at a time; one polling from many connections gets no more than the cap.
* **No re-lease to the worker that let a lease lapse** (while another worker can take the task:
  :meth:`~relay_server.tasks.queues.ReadyQueues.best`), and **strikes**: a worker that let a lease
  lapse or a held gradient expire gets no task of its stage (while another worker serves it) for
  the rest of the batch, then for 2, 4, .. batches at each further strike. So a hostile worker
  costs the run at most one lease or hold deadline per batch it is allowed in, fewer and fewer.
* **Placement by measurement** (:meth:`assign`): a joiner goes to the stage whose measured task
  rate is lowest; a worker's self-reported speed is never used (an idle worker claiming 1e12
  samples/s would otherwise draw every joiner away from its stage).

:class:`PipelineGuard` owns these measurements, strikes and counters; it reads the rest of the
pipeline through :class:`GuardDeps` (the pool's broker, the workers, the open round, the batch).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from relay_server.pipeline.batch_rounds import PipelineRounds
from relay_server.pipeline.ledger import BACKWARD, LAST, Ledger, Step
from relay_server.pipeline.plan import Planner
from relay_server.pipeline.workers import Worker, Workers
from relay_server.tasks.broker import TaskBroker
from relay_server.tasks.timing import LeaseTimer

log = logging.getLogger(__name__)
MAX_LEASES_PER_WORKER = 2  # one task in hand, and one whose answer was lost on the way (its lease still runs)
IDLE_POLL_S = 1.0  # a worker refused a task re-checks this often within its long poll


@dataclass(frozen=True)
class GuardDeps:
    """What the guard reads, each owned elsewhere."""

    broker: TaskBroker
    workers: Workers
    rounds: PipelineRounds
    ledger: Callable[[], Ledger]
    """The ledger of the batch whose round is open or opens next (the oldest in flight)."""
    steps: Callable[[], Mapping[str, Step]]
    """Task id -> step, of the tasks of every batch in flight."""
    batch_index: Callable[[], int]
    clock: Callable[[], float]
    dispatch: str = "pool"
    planner: Planner | None = None


class PipelineGuard:
    def __init__(self, deps: GuardDeps) -> None:
        self.deps = deps
        self.broker, self.workers, self.rounds, self.clock = deps.broker, deps.workers, deps.rounds, deps.clock
        self.dispatch, self.planner = deps.dispatch, deps.planner
        timer = self.broker.timer
        self.hold_timer = LeaseTimer(
            floor_s=timer.floor_s, factor=timer.factor, initial_s=timer.initial_s, window=timer.window
        )
        self.held_since: dict[tuple[str, int], float] = {}
        """(worker, batch) -> when it last became the holder of a stage gradient of that batch (with
        delayed updates, holding the next batch's does not restart its hold of the round's)."""
        self.strikes: dict[str, int] = {}
        self.benched: dict[str, int] = {}  # worker -> the first batch it gets tasks of again
        self.lapses_seen: dict[str, int] = {}  # task id -> lapses already struck
        self.expired_holds = self.lapsed_leases = self.cut_uploads = 0
        self.polls: dict[str, int] = {}  # worker -> its work requests in flight
        self.polled_at: dict[str, float] = {}  # worker -> when its last work request ended

    # --- held stage gradients -------------------------------------------------------------------
    def now_holds(self, worker: str, step: Step) -> None:
        if step.kind in (LAST, BACKWARD):
            self.held_since[(worker, step.batch)] = self.clock()

    def hold_deadline(self, stage: int) -> float:
        """Seconds a holder of ``stage``'s gradient has, from the round's opening, to commit it:
        the stage's measured holds' deadline, or before one was measured the stage's lease
        deadline (measured by then: the round opens after its tasks). Never the initial lease:
        a first round must not wait ``initial_lease_s`` for a hoarder. An honest holder is
        polling when the round opens and starts its upload at once, and an upload in flight is
        never recomputed, so this bounds only the wait for it to begin."""
        key = f"stage{stage}"
        measured = self.hold_timer.measured(key) is not None
        return self.hold_timer.deadline(key) if measured else self.broker.lease_deadline(key)

    def upload_deadline(self, stage: int) -> float:
        """Seconds one upload of ``stage``'s gradient may take, from its first byte. An upload in
        flight is never recomputed, so without a bound a worker sending one byte every few
        seconds (never silent long enough for ``body_idle_timeout_s``) would hold the round as
        long as it liked. An honest upload fits in a measured hold (round open to commit, which
        includes the upload); before a hold was measured, the run's initial lease bounds it."""
        key = f"stage{stage}"
        return (
            self.hold_timer.deadline(key)
            if self.hold_timer.measured(key) is not None
            else max(self.broker.timer.initial_s, self.broker.lease_deadline(key))
        )

    def upload_cut(self, worker: str, stage: int, seconds: float) -> None:
        """An upload ran past :meth:`upload_deadline` and was cut (it did not commit): no longer
        in flight, so its micro-batches are recomputed at the next tick, and its worker struck."""
        self.cut_uploads += 1
        log.info(
            "pipeline worker %s took more than %.1f s to upload stage %d's gradient: cut; its micro-batches "
            "are recomputed",
            worker[:16],
            seconds,
            stage,
        )
        self.rounds.recompute(worker, round_only=True)
        self.strike(worker)

    def committed(self, worker: str, stage: int) -> None:
        """``worker``'s upload of ``stage``'s gradient committed: how long it held it, measured."""
        r = self.rounds.round
        if r is not None:
            self.hold_timer.record(
                f"stage{stage}", self.clock() - max(r.opened_at, self.held_since.get((worker, r.step), 0.0))
            )

    def expire_holds(self) -> None:
        """Recompute every stage gradient held past its deadline (except what is being uploaded
        now): the holder's heartbeats and polls do not matter, only the parameter server's commit.
        Not with ``dispatch = "static"``: that baseline waits for its workers."""
        r = self.rounds.round
        if r is None or self.rounds.finalizing or self.dispatch == "static":
            return
        now = self.clock()
        holders = {w for mb in self.deps.ledger().microbatches.values() for w in mb.owners.values()}
        for worker in sorted(holders):
            owned = self.deps.ledger().owned(worker)
            if not owned:
                continue
            held_s = now - max(r.opened_at, self.held_since.get((worker, r.step), r.opened_at))
            if held_s <= max(self.hold_deadline(k) for k in owned):
                continue
            redo = self.rounds.recompute(worker, round_only=True)
            if redo:
                log.info(
                    "pipeline worker %s held %d stage gradient(s) %.1f s into the round without committing "
                    "them: recomputing them",
                    worker[:16],
                    redo,
                    held_s,
                )
                self.expired_holds += 1
                self.strike(worker)

    # --- leases -----------------------------------------------------------------------------------
    def note_lapses(self) -> None:
        """Strike every worker that let a lease of this batch lapse since the last tick while
        another worker served its stage (alone, it holds up nobody a strike would help)."""
        for task_id, step in self.deps.steps().items():
            task = self.broker.tasks.get(task_id)
            if task is None or len(task.lapsed_by) <= self.lapses_seen.get(task_id, 0):
                continue
            for worker in task.lapsed_by[self.lapses_seen.get(task_id, 0) :]:
                self.lapsed_leases += 1
                if self.others_serve(worker, step.stage):
                    self.strike(worker)
            self.lapses_seen[task_id] = len(task.lapsed_by)

    def strike(self, worker: str) -> None:
        strikes = self.strikes[worker] = self.strikes.get(worker, 0) + 1
        self.benched[worker] = self.deps.batch_index() + 2 ** (strikes - 1)
        log.info(
            "pipeline worker %s: strike %d, no tasks before batch %d while others serve its stage",
            worker[:16],
            strikes,
            self.benched[worker],
        )

    def _serves(self, worker: str) -> bool:
        return self.benched.get(worker, -1) <= self.deps.batch_index()

    def _active(self, worker: str, stage: int) -> bool:
        """Asking for work now, uploading, or lately active (placed, polled, answered: within its
        stage's lease deadline). A worker that only heartbeats is not: it serves nobody."""
        if self.polls.get(worker, 0) > 0 or worker in self.rounds.uploaders():
            return True
        return self.clock() - self.polled_at.get(worker, -1e18) <= self.broker.lease_deadline(f"stage{stage}")

    def seen(self, worker: str) -> None:
        """A request that shows the worker at work (placement, a result, a ticket)."""
        self.polled_at[worker] = self.clock()

    def serving_placement(self) -> dict[str, tuple[int, int]]:
        """worker -> (stage, memory) of the workers that serve their stage now (active, not
        struck): a stage none of them is on is as good as empty, whoever else is placed there."""
        return {
            w: (stage, memory)
            for w, (stage, memory) in self.workers.placement().items()
            if self._serves(w) and self._active(w, stage)
        }

    def others_serve(self, worker: str, stage: int) -> bool:
        """Another worker of ``stage``, not struck and asking for work, may take its tasks: a
        worker is never refused its stage's tasks when nobody else would take them (an idle
        worker that never polls serves nobody)."""
        if self.dispatch == "static":
            return False  # a static pin waits for its own worker, whatever it did
        return any(w != worker and self._serves(w) and self._active(w, stage) for w in self.workers.on_stage(stage))

    @contextlib.contextmanager
    def polling(self, worker: str) -> Iterator[None]:
        self.polls[worker] = self.polls.get(worker, 0) + 1
        try:
            yield
        finally:
            self.polls[worker] -= 1
            self.polled_at[worker] = self.clock()

    def leases_held(self, worker: str) -> int:
        return sum(
            1
            for task_id in self.deps.steps()
            if (t := self.broker.tasks.get(task_id)) is not None and t.state == "leased" and t.worker == worker
        )

    def may_lease(self, worker: str, stage: int) -> bool:
        if self.leases_held(worker) >= MAX_LEASES_PER_WORKER:
            return False
        return self._serves(worker) or not self.others_serve(worker, stage)

    async def idle(self, wait_s: float) -> None:
        """A worker that may not lease now waits (a while, or until the round opens) instead of
        polling again at once."""
        opened = self.rounds.opened
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(opened.wait(), min(wait_s, IDLE_POLL_S))

    def batch_over(self, batch: int) -> None:
        """``batch``'s round closed."""
        self.held_since = {key: t for key, t in self.held_since.items() if key[1] > batch}
        live = self.deps.steps()  # (delayed updates) the next batch's tasks stay: their lapses were struck
        self.lapses_seen = {task_id: n for task_id, n in self.lapses_seen.items() if task_id in live}

    # --- placement -------------------------------------------------------------------------------
    def assign(self, peer_id: str, memory_bytes: int, samples_per_s: float) -> Worker:
        """The worker's stage: kept across polls, a joiner's from measured task rates only."""
        measured = self.planner.task_seconds if self.planner is not None else (lambda worker: None)

        def task_s(worker: str) -> float | None:
            """Measured seconds per task; infinite for one that serves nobody (it adds nothing)."""
            known = self.workers.by_id.get(worker)
            idle = known is not None and not (self._serves(worker) and self._active(worker, known.stage))
            return math.inf if idle else measured(worker)

        if peer_id not in self.workers.by_id:
            self.seen(peer_id)
        return self.workers.assign(peer_id, memory_bytes, samples_per_s, task_s=task_s)
