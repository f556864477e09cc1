"""The pipeline's task pool and rounds: tasks to workers, results to the next stage, batches to
optimizer steps.

* **The pool is the relay's task broker**, one key per stage. Every task is leased in 1F1B order
  (backward work first, then the oldest batch, then the oldest micro-batch: the broker's
  priority), a backward preferably to the worker that ran its forward (which may still hold the
  input, so the relay leaves it out), with a lease that expires after a multiple of the stage's
  *measured* task time (the broker measures it) -- a stuck worker's tasks go back to the front of
  the queue without waiting for it to leave -- and at once when the worker leaves the registry.
  The first accepted result of a task wins; a late duplicate is answered ``accepted: false``.
* **No round trip per boundary.** A stage's output is stored here (:mod:`.boundaries`) and the
  next stage's task is queued the moment it arrives; the next worker downloads it with its task.
* **Rounds** (:mod:`.batch_rounds`, :mod:`.ledger` for the bookkeeping): when every micro-batch finished
  its backward, every worker uploads the stage gradient of exactly the micro-batches it holds to
  its stage's parameter server (:mod:`.stage_owners`); when every stage counted every micro-batch
  every stage steps; the next batch starts on the new version. With ``run.max_staleness = 1``
  (delayed parameter updates, :mod:`.in_flight`) batch ``b + 1`` starts once version ``b`` is
  published, alongside batch ``b``'s last tasks and round, which then overlap compute. No barrier waits
  for a particular worker: a joiner gets tasks of the batch in flight at its first poll.
* **A hostile worker** that stays connected -- holding gradients, sitting on leases, claiming
  speeds -- is bounded by measured deadlines, a lease cap and strikes (:mod:`.guard`).
* **A lying worker** -- a finite, well-shaped, wrong result -- is found by spot checks and
  monitors (:mod:`relay_server.trust`): the round opens only once its batch's checks settled, and
  a ban restarts the batch (:meth:`PipelineCoordinator.banned`), so no lie is ever counted.
* **Placement** (:mod:`.plan`): measured task times feed the planner's predicted time per batch
  and its rebalancing; ``dispatch = "static" | "restart"`` are the baselines the benchmark
  compares the pool with.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from relay_server.core.errors import ApiError
from relay_server.pipeline.batch_rounds import BatchOutcome, OpenRound, PipelineRounds, RoundDeps
from relay_server.pipeline.boundaries import Boundaries
from relay_server.pipeline.figures import PipelineFigures, WasteTotals
from relay_server.pipeline.guard import MAX_LEASES_PER_WORKER, GuardDeps, PipelineGuard
from relay_server.pipeline.in_flight import InFlight
from relay_server.pipeline.ledger import BACKWARD, FIRST, LAST, Ledger, Step
from relay_server.pipeline.plan import Planner
from relay_server.pipeline.results import Shapes, read_result
from relay_server.pipeline.stage_owners import StageOwners
from relay_server.pipeline.workers import Worker, Workers
from relay_server.tasks.broker import TaskBroker
from relay_server.trust.checks import PipelineTrust, TrustDeps
from relay_server.trust.compare import tolerance
from toolkit.wire import payloads
from toolkit.wire.compression import Codec
from toolkit.wire.protocol import PipelineAck, PipelineTask, PipelineTicketRequest, PipelineWork, Ticket

if TYPE_CHECKING:
    import numpy as np

    from relay_server.tasks.task import Task
    from relay_server.trust.referee import Referee  # torch: built only on a relay that checks

log = logging.getLogger(__name__)
NO_DEADLINE_S = 7 * 24 * 3600.0  # tasks never fail by age: their leases expire and they are re-dispatched
MAX_TASKS_PER_POLL = 1  # one at a time: a second task leased to a busy worker would idle another


@dataclass(frozen=True)
class PipelineShape:
    """What the run's ``[pipeline]`` and its cut model fix for the coordinator's whole life."""

    layers: list[int]
    """Layers per stage (one entry per stage)."""
    microbatch_size: int
    microbatches_per_batch: int
    shapes: Shapes
    codec: Codec
    """How boundaries travel (``[pipeline] boundary_codec``)."""
    dispatch: str = "pool"
    rebalance_every: int = 0
    max_staleness: int = 0
    """``run.max_staleness``: 0 (every batch on the version its predecessor's round produced) or
    1 (delayed parameter updates: the next batch computes while a round closes)."""
    check_share: float = 0.0
    """``[pipeline] check_share``: the share of results spot-checked (:mod:`relay_server.trust.checks`)."""
    precision: str = ""
    """``[run] precision``: what the checks' tolerance follows from."""


@dataclass(frozen=True)
class PipelineDeps:
    """The collaborators the coordinator works through (each owns its own state)."""

    owners: StageOwners
    broker: TaskBroker
    boundaries: Boundaries
    workers: Workers
    ticket_key: str
    publish: Callable[[BatchOutcome], Awaitable[None]]
    """The relay's after-publish sequence for a batch's step (:class:`relay_server.pipeline.service.PipelinePublisher`)."""
    planner: Planner | None = None
    clock: Callable[[], float] = time.monotonic
    referee: Referee | None = None
    """The relay's own copy of the stages, for checks no other worker can serve."""
    on_ban: Callable[[str, str], None] = lambda worker, reason: None
    """The relay's moderation: a worker was banned for lying (the reason)."""


class PipelineCoordinator:
    """The task pool and the batch in flight. The batch's round (:attr:`rounds`,
    :class:`~relay_server.pipeline.batch_rounds.PipelineRounds`) and the rules that bound a hostile
    worker (:attr:`guard`, :class:`~relay_server.pipeline.guard.PipelineGuard`) are collaborators
    owning their own state; each sees the rest through its deps, never through this object's fields."""

    def __init__(self, shape: PipelineShape, deps: PipelineDeps) -> None:
        self.K, self.layers = len(shape.layers), list(shape.layers)
        self.mb_size, self.d = shape.microbatch_size, shape.microbatches_per_batch
        self.owners, self.broker, self.boundaries, self.workers = (
            deps.owners,
            deps.broker,
            deps.boundaries,
            deps.workers,
        )
        self.shapes, self.codec, self.ticket_key, self.publish, self.clock = (
            shape.shapes,
            shape.codec,
            deps.ticket_key,
            deps.publish,
            deps.clock,
        )
        self.dispatch = shape.dispatch
        self.planner, self.rebalance_every, self.moves = deps.planner, shape.rebalance_every, 0
        self.pins: dict[tuple[int, int], str] = {}  # "static": (stage, micro-batch) -> its worker
        self.steps: dict[str, Step] = {}  # task id -> what it computes (tasks of the batches in flight)
        # batch t is the one round t steps with (its version: t, or t - 1 with delayed updates)
        self.flight = InFlight(self.owners.step, self.K, self.d, shape.max_staleness)
        self.ledger = self._mint(self.owners.step)
        """The newest batch in flight (the one computing)."""
        self.bytes_out = 0
        self.redone = self.refused = self.restarted = self.silenced = 0
        self.figures = PipelineFigures()  # credits, bytes by kind, wasted work per batch
        self.rounds = PipelineRounds(
            RoundDeps(
                owners=self.owners,
                ledger=self.flight.closing,
                clock=self.clock,
                microbatch_size=self.mb_size,
                microbatches_per_batch=self.d,
                ticket_key=self.ticket_key,
                publish=self._publish,
                ledgers=lambda: list(self.flight.ledgers.values()),
                seen=lambda worker: self.guard.seen(worker),
                strike=lambda worker: self.guard.strike(worker),
                committed=lambda worker, stage: self.guard.committed(worker, stage),
                resubmit=self._submit,
                batch_over=self._next_batch,
            )
        )
        self.guard = PipelineGuard(
            GuardDeps(
                broker=self.broker,
                workers=self.workers,
                rounds=self.rounds,
                ledger=self.flight.closing,
                steps=lambda: self.steps,
                batch_index=lambda: self.flight.batch_index,
                clock=self.clock,
                dispatch=self.dispatch,
                planner=self.planner,
            )
        )
        self.predicted_batch_s: float | None = None
        self.on_ban = deps.on_ban
        self.trust = PipelineTrust(
            TrustDeps(
                share=shape.check_share,
                tolerance=tolerance(shape.precision, self.codec.name),
                width=self.shapes.width,
                codec=self.codec,
                submit_check=lambda step, exclude: self._submit(step, exclude),  # type: ignore[arg-type]  # our own Steps
                cancel=lambda task_id: self._drop_task(task_id, "check_dropped"),
                can_serve=self._can_serve,
                inputs=lambda step: {n: self.boundaries.get(step.microbatch, n) for n in step.inputs()},
                version=lambda: self.ledger.version,
                batch=lambda: self.ledger.batch,
                banned=self.banned,
                settled=self._advance,
                referee=deps.referee,
            )
        )
        self._fill()  # with delayed updates the second batch starts at once: its version is published

    # --- batches --------------------------------------------------------------------------------
    def _mint(self, batch: int) -> Ledger:
        ledger = self.ledger = self.flight.mint(batch)
        if self.dispatch == "static":  # each stage's micro-batches dealt round-robin to its workers now
            self.pins |= {
                (k, m): ws[i % len(ws)]
                for k in range(self.K)
                if (ws := self.workers.on_stage(k))
                for i, m in enumerate(ledger.microbatches)
            }
        for step in ledger.start():
            self._submit(step)
        return ledger

    def _submit(self, step: Step, exclude: frozenset[str] = frozenset()) -> str:
        """Queue ``step`` (``exclude``: workers never to lease it, a spot check's); its task id."""
        backward_work = step.kind in (LAST, BACKWARD)
        task = self.broker.submit(
            caller="pipeline",
            call_id=f"{step.batch}.{step.kind}.{step.stage}."
            f"{step.microbatch}.{'r' if step.redo else ''}{'c' if exclude else ''}{secrets.token_hex(4)}",
            key=self._key_of(step),
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

    async def _publish(self, outcome: BatchOutcome) -> None:
        """The batch's step through the relay's after-publish sequence, its workers credited
        with what the leaderboard credits them."""
        await self.publish(outcome)
        self.figures.batch_committed(outcome.contributions)

    def waste_totals(self) -> WasteTotals:
        """Re-dispatched tasks, recomputed stage gradients, refused duplicate results: so far."""
        return WasteTotals(redispatched=self.broker.stats.requeued, recomputed=self.redone, refused=self.refused)

    def _next_batch(self, round_s: float) -> None:
        """The batch's step is published: nothing of it may be leased after its boundaries go;
        re-time the placement; the next batch starts on the new version (with delayed updates it
        is computing already, and its round may open now)."""
        closed = self.flight.close()
        self.figures.batch_over(closed.batch, self.waste_totals())
        for task_id, step in list(self.steps.items()):
            if step.batch == closed.batch:
                self.broker.cancel(task_id, ApiError(410, "batch_over", "the batch this task belonged to is over"))
                del self.steps[task_id]
        self.guard.batch_over(closed.batch)
        self.trust.batch_over()
        for m in closed.microbatches:
            self.boundaries.drop(m)
            for k in range(self.K):
                self.pins.pop((k, m), None)
        self._replan(round_s)
        self._fill()
        self._advance()

    def _fill(self) -> None:
        """Start the next batches that may start (:meth:`InFlight.due`): with delayed updates batch
        ``b + 1`` computes alongside batch ``b``'s last tasks and round (the older batch's tasks
        first: the broker's priority), and the pool never drains between batches."""
        while self.flight.due(self.owners.step):
            self._mint(self.flight.batch_index + 1)

    def _advance(self) -> None:
        """Open the oldest batch's round once all its backwards finished, every check of it
        settled (:mod:`relay_server.trust`) and no round is open."""
        if self.round is None and self.flight.closing().complete and self.trust.settled:
            self.rounds.open()

    # --- the round (:class:`~relay_server.pipeline.batch_rounds.PipelineRounds` owns it) -----------------
    @property
    def round(self) -> OpenRound | None:
        return self.rounds.round

    @property
    def uploading(self) -> set[str]:
        """Contributors whose slice upload is streaming now (the upload route adds and discards)."""
        return self.rounds.uploading

    def assign(self, peer_id: str, memory_bytes: int, samples_per_s: float) -> Worker:
        """The worker's stage (:meth:`PipelineGuard.assign`: by measured task rates only)."""
        self.trust.admit(peer_id)
        return self.guard.assign(peer_id, memory_bytes, samples_per_s)

    def ticket(self, worker: str, step: int, req: PipelineTicketRequest) -> Ticket:
        self.trust.admit(worker)
        return self.rounds.ticket(worker, step, req)

    def done(self, worker: str, round_id: str, contributor: str, delivered: bool) -> None:
        self.rounds.done(worker, round_id, contributor, delivered)

    def check_delivered(self) -> None:
        self.rounds.check_delivered()

    # --- workers: tasks -------------------------------------------------------------------------
    async def work(self, worker: str, cached: set[int], wait_s: float) -> tuple[PipelineWork, dict[str, np.ndarray]]:
        """The worker's next tasks with their inputs, or the round it must upload to."""
        self.trust.admit(worker, work=True)
        with self.guard.polling(worker):
            return await self._work(worker, cached, wait_s)

    async def _work(self, worker: str, cached: set[int], wait_s: float) -> tuple[PipelineWork, dict[str, np.ndarray]]:
        stage = self.workers.stage_of(worker)
        deadline = self.clock() + wait_s
        while True:
            call = self.rounds.call(worker)
            if call is not None:
                return PipelineWork(stage=stage, round=call), {}
            if not self.guard.may_lease(worker, stage):  # struck, or at its lease cap: no task now
                await self.guard.idle(max(0.0, deadline - self.clock()))
                tasks = []
                if self.clock() >= deadline:
                    break
                continue
            tasks = await self._lease_or_round(worker, stage, max(0.0, deadline - self.clock()))
            try:
                self.trust.admit(worker, work=True)  # banned, or its batch restarted, while it waited
            except ApiError:
                for task in tasks:
                    self.broker.requeue(task.task_id)
                raise
            if tasks and self.guard.leases_held(worker) > MAX_LEASES_PER_WORKER:  # parallel polls all leased at once
                for task in tasks:
                    self.broker.requeue(task.task_id)
                continue
            tasks = [t for t in tasks if self._still_wanted(t)]
            for task in tasks:
                self.rounds.batch_began(self.steps[task.task_id].batch)
            if tasks or self.clock() >= deadline:
                break
        out, tensors = [], {}
        for i, task in enumerate(tasks):
            step = self.steps[task.task_id]
            cached_input = step.kind == BACKWARD and step.microbatch in cached and step.prefer == worker
            names = step.inputs()
            for name in names[1:] if cached_input else names:  # [0] is the stage's input
                tensors.update(_renamed(self.boundaries.get(step.microbatch, name), name, i))
            out.append(
                PipelineTask(
                    task_id=task.task_id,
                    kind=step.kind,  # type: ignore[arg-type]  # a Step's kind is one of the four task kinds
                    stage=step.stage,
                    batch=step.batch,
                    microbatch=step.microbatch,
                    version=self.flight.ledgers[step.batch].version,
                    lease_s=self.broker.lease_deadline(task.key),
                    input_cached=cached_input,
                    redo=step.redo,
                )
            )
        return PipelineWork(stage=stage, tasks=out), tensors

    def _key_of(self, step: Step) -> str:
        """The queue a step goes to: its stage's (any worker of the stage may take it), or with
        ``dispatch = "static"`` its pinned worker's (it waits for that worker, whatever happens)."""
        pinned = self.pins.get((step.stage, step.microbatch)) if self.dispatch == "static" else None
        return f"{_key(step.stage)}/{pinned}" if pinned else _key(step.stage)

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
            self._submit(Step(FIRST, 0, fresh, batch=step.batch))

    async def _lease_or_round(self, worker: str, stage: int, wait_s: float) -> list[Task]:
        """A task of the worker's stage, or nothing when the round opens first (the worker then
        gets its upload at once instead of after its long poll)."""
        lease = asyncio.ensure_future(
            self.broker.lease(
                worker,
                [_key(stage), f"{_key(stage)}/{worker}"],
                max_rows=MAX_TASKS_PER_POLL,
                wait_s=wait_s,
                skip_lapsed=self.guard.others_serve(worker, stage),
            )
        )
        opened = asyncio.ensure_future(self.rounds.opened.wait())
        try:
            await asyncio.wait({lease, opened}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            opened.cancel()
            if not lease.done():
                lease.cancel()
        try:
            return await lease  # a lease that took its tasks before the cancel landed still returns them
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # type: ignore[union-attr]  # awaited inside a request's task
                raise  # this request itself is being cancelled
            return []

    def _still_wanted(self, task: Task) -> bool:
        step = self.steps.get(task.task_id)
        if step is not None and all(self.boundaries.has(step.microbatch, name) for name in step.inputs()):
            return True
        if step is not None:  # a bug, not a worker's doing: never hand out a task without its inputs
            log.error("pipeline task %s (%s) has lost its inputs; cancelled", task.task_id, step)
            del self.steps[task.task_id]
        self.broker.cancel(task.task_id, ApiError(410, "batch_over", "the batch this task belonged to is over"))
        return False

    def result(self, worker: str, task_id: str, body: bytes) -> PipelineAck:
        """Validate a task's result, then (first result wins) store its boundary and queue the next
        step; a spot check's result goes to the checks (:mod:`relay_server.trust`), nowhere else."""
        self.guard.seen(worker)
        self.trust.admit(worker)
        task = self.broker.tasks.get(task_id)
        if task is not None and task.state == "done":
            if task.worker == worker:  # our own result, retried after a lost answer
                return PipelineAck(task_id=task_id, accepted=True)
            self.refused += 1
            return PipelineAck(task_id=task_id, accepted=False)
        step = self.steps.get(task_id)
        if step is None:
            raise ApiError(
                410,
                "task_expired",
                f"task {task_id!r} is not part of the batch in flight",
                "Drop this result and its gradient; take the next task.",
            )
        if self.workers.by_id.get(worker) is not None and self.workers.stage_of(worker) != step.stage:
            raise ApiError(
                410,
                "stage_moved",
                f"this worker moved off stage {step.stage}; its result for it is not used",
                "Drop it and take the next task of your new stage.",
            )
        ledger = self.flight.ledgers[step.batch]
        mb = ledger.microbatches[step.microbatch]
        accepted = read_result(body, step, mb.rows, self.shapes, self.codec)  # before the broker sees it
        try:
            task = self.broker.complete(worker, task_id, b"")
        except ApiError as exc:
            if exc.code in ("task_done",):
                self.refused += 1
                return PipelineAck(task_id=task_id, accepted=False)
            raise
        self.figures.task_accepted(worker)
        if self.trust.is_check(task_id):
            del self.steps[task_id]
            self.trust.check_result(task_id, worker, accepted.entries)
            # a checker's parameter gradient must not be held: "not accepted", as a duplicate is
            return PipelineAck(task_id=task_id, accepted=step.kind not in (LAST, BACKWARD))
        if self.planner is not None and task.attempts == 1 and task.leased_at is not None:
            self.planner.observe_task(worker, self.clock() - task.leased_at)
        for name, entry in accepted.entries.items():
            self.boundaries.put(step.microbatch, name, entry)
        if step.redo:
            self.redone += 1
        following = ledger.accept(step, worker, rows=accepted.rows, loss_sum=accepted.result.loss_sum)
        self.guard.now_holds(worker, step)
        del self.steps[task_id]
        self.trust.accepted(task_id, step, worker, accepted.entries, accepted.norms or {})
        if following is not None:
            self._submit(following)
        else:
            self._advance()
        return PipelineAck(task_id=task_id, accepted=True)

    # --- trust (:mod:`relay_server.trust`) --------------------------------------------------------
    def _can_serve(self, stage: int, exclude: frozenset[str]) -> bool:
        return any(
            k == stage and w not in exclude and w not in self.trust.banned
            for w, (k, _) in self.guard.serving_placement().items()
        )

    def _drop_task(self, task_id: str, code: str) -> None:
        if self.steps.pop(task_id, None) is not None:
            self.broker.cancel(task_id, ApiError(410, code, "this task is no longer wanted"))

    def banned(self, worker: str, reason: str) -> None:
        """``worker`` lied (:class:`~relay_server.trust.checks.PipelineTrust` proved it): the open
        batch restarts -- every task cancelled, every boundary dropped, the same micro-batches
        queued again from their first stage -- so every result the liar delivered, and all that
        was computed from it, is recomputed by others before the round counts (the round cannot
        have opened: it waits for the batch's checks). Workers holding stage gradients of the
        batch drop them at their next request (``batch_restarted``). Then it leaves the pipeline,
        and the relay's moderation records the ban."""
        holders = {w for mb in self.ledger.microbatches.values() for w in mb.owners.values()}
        for task_id in list(self.steps):
            self.broker.cancel(task_id, ApiError(410, "batch_restarted", "the batch restarted: a liar was banned"))
        self.steps.clear()
        self.guard.batch_over(self.ledger.batch)
        self.trust.batch_over()
        for m in self.ledger.microbatches:
            self.boundaries.drop(m)
        self.flight.next_microbatch = min(self.ledger.microbatches)
        self._mint(self.ledger.batch)
        self.trust.must_reset(sorted(holders - {worker}))
        if worker in self.workers.by_id:
            self.worker_left(worker)
        self.on_ban(worker, reason)

    # --- the planner ----------------------------------------------------------------------------
    def _replan(self, round_s: float) -> None:
        """Between batches: re-time the placement (the predicted time per batch), and every
        ``rebalance_every`` batches move the one worker whose move the planner says pays."""
        if self.planner is None:
            return
        self.planner.observe_round(round_s)
        placement = self.workers.placement()
        due = self.dispatch == "pool" and self.rebalance_every and self.flight.batch_index % self.rebalance_every == 0
        move = self.planner.move(placement) if due else None
        self.planner.replan(placement)
        self.predicted_batch_s = self.planner.predicted_batch_s()
        if move is not None:
            self._move(move.worker, move.to_stage, f"predicted {move.gain_s_per_batch:.2f} s per batch faster")

    def staff_empty_stages(self) -> None:
        """A stage with no worker that serves it (only idle or struck ones, or none) stalls the
        batch: move one there now from a stage with two or more that serve theirs, any that
        holds no stage gradient yet to upload (``dispatch = "pool"`` only)."""
        if self.planner is None or self.dispatch != "pool":
            return
        move = self.planner.fill_empty(self.guard.serving_placement(), can_move=lambda w: not self.flight.owned(w))
        if move is not None:
            self._move(move.worker, move.to_stage, "its new stage had no worker")

    def _move(self, worker: str, stage: int, why: str) -> None:
        log.info(
            "pipeline: worker %s moves from stage %d to stage %d (%s)",
            worker[:16],
            self.workers.stage_of(worker),
            stage,
            why,
        )
        self.broker.worker_left(worker)  # tasks it holds of its old stage go back to that stage's queue
        if self.flight.owned(
            worker
        ):  # (delayed updates) it holds the computing batch's gradients: its new stage drops them
            self.rounds.recompute(worker)
        self.workers.move(worker, stage)
        self.planner.forget(worker)  # type: ignore[union-attr]  # only the planner's moves call _move
        self.moves += 1

    def orphan_silent(self, silence: dict[str, float]) -> None:
        """Workers holding stage gradients of this batch and silent (no request, no heartbeat)
        for longer than their stage's lease deadline: their micro-batches' stage gradient is
        recomputed by others now, not when the registry drops them (a volunteer whose notebook
        froze must not hold the round). If such a worker comes back, it holds nothing the relay
        will count (its ticket request no longer matches) and drops that gradient. Not with
        ``dispatch = "static"``: that baseline waits for its workers."""
        if self.dispatch == "static":
            return
        for worker, silent_s in silence.items():
            owned = self.flight.owned(worker)
            if not owned or silent_s <= max(self.broker.lease_deadline(_key(k)) for k in owned):
                continue
            redo = self.rounds.recompute(worker)
            if redo:
                log.info(
                    "pipeline worker %s silent for %.1f s holding %d stage gradient(s): recomputing them",
                    worker[:16],
                    silent_s,
                    redo,
                )
                self.silenced += 1

    # --- membership -----------------------------------------------------------------------------
    def worker_left(self, worker: str) -> None:
        """Its leased tasks go back to the front of the queue (the broker); the stage gradients it
        held and had not delivered are recomputed by others (``redo``)."""
        self.broker.worker_left(worker)
        self.rounds.recompute(worker)
        self.rounds.worker_left(worker)
        self.workers.remove(worker)
        if self.planner is not None:
            self.planner.forget(worker)


def _key(stage: int) -> str:
    return f"stage{stage}"


def _renamed(entry: bytes, name: str, i: int) -> dict[str, np.ndarray]:
    """A stored boundary's tensors under the names task ``i`` of a work answer gives them."""
    _, tensors = payloads.decode(entry, len(entry))
    if name == "batch":
        return {f"{i}.{key}": array for key, array in tensors.items()}
    prefix = f"{i}.x" if name.startswith("a") else f"{i}.g"
    return {prefix + key[1:]: array for key, array in tensors.items()}
