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
  monitors (:mod:`relay_server.trust`, plugged in by :mod:`.trust_hooks`): the round opens only
  once its batch's checks settled, and a ban restarts the batch
  (:meth:`~.trust_hooks.TrustHooks.banned`), so no lie found in it is counted; one found after
  its batch was counted is rolled back (:mod:`.rollback`).
* **Placement** (:mod:`.plan`, moves by :mod:`.worker_moves`): measured task times feed the
  planner's predicted time per batch and its rebalancing; ``dispatch = "static" | "restart"`` are the baselines the benchmark
  compares the pool with.

The coordinator holds the batches in flight and leases tasks; its collaborators own the rest:
:mod:`.task_pool` (task id -> step, the static pins, the restart baseline), :mod:`.task_results`
(a result on arrival), :mod:`.worker_moves` (rebalancing, empty stages, silent workers) and
:mod:`.trust_hooks` (the checks and what a ban restarts).
"""

from __future__ import annotations

import asyncio
import logging
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
from relay_server.pipeline.ledger import BACKWARD, FIRST, Ledger
from relay_server.pipeline.plan import Planner
from relay_server.pipeline.results import Shapes
from relay_server.pipeline.stage_owners import StageOwners
from relay_server.pipeline.task_pool import TaskPool, stage_key
from relay_server.pipeline.task_results import ResultDeps, TaskResults
from relay_server.pipeline.trust_hooks import HookDeps, TrustHooks
from relay_server.pipeline.worker_moves import MoveDeps, WorkerMoves
from relay_server.pipeline.workers import Worker, Workers
from relay_server.tasks.broker import TaskBroker
from toolkit.wire import payloads
from toolkit.wire.compression import Codec
from toolkit.wire.protocol import PipelineAck, PipelineTask, PipelineTicketRequest, PipelineWork, Ticket

if TYPE_CHECKING:
    import numpy as np

    from relay_server.tasks.task import Task
    from relay_server.trust.referee import Referee  # torch: built only on a relay that checks

log = logging.getLogger(__name__)
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
    probation: int = 2
    """``[pipeline] probation_checks``: a new worker's checks at a raised share."""
    rollback_batches: int = 0
    """``[pipeline] rollback_batches``: committed batches a late ban can undo (:mod:`.rollback`)."""


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
    :class:`~relay_server.pipeline.batch_rounds.PipelineRounds`), the rules that bound a hostile
    worker (:attr:`guard`, :class:`~relay_server.pipeline.guard.PipelineGuard`), the tasks'
    steps (:attr:`pool`), results on arrival (:attr:`results`), workers' moves (:attr:`moves`)
    and the checks (:attr:`hooks`) are collaborators owning their own state; each sees the rest
    through its deps, never through this object's fields."""

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
        self.dispatch, self.planner = shape.dispatch, deps.planner
        # batch t is the one round t steps with (its version: t, or t - 1 with delayed updates)
        self.flight = InFlight(self.owners.step, self.K, self.d, shape.max_staleness)
        self.pool = TaskPool(self.broker, self.workers, self.flight, self.boundaries, self.K, self.dispatch)
        self.ledger = self._mint(self.owners.step)
        """The newest batch in flight (the one computing)."""
        self.bytes_out = 0
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
                resubmit=self.pool.submit,
                batch_over=self._next_batch,
            )
        )
        self.guard = PipelineGuard(
            GuardDeps(
                broker=self.broker,
                workers=self.workers,
                rounds=self.rounds,
                ledger=self.flight.closing,
                steps=lambda: self.pool.steps,
                batch_index=lambda: self.flight.batch_index,
                clock=self.clock,
                dispatch=self.dispatch,
                planner=self.planner,
            )
        )
        self.hooks = TrustHooks(
            shape,
            HookDeps(
                pool=self.pool,
                guard=self.guard,
                boundaries=self.boundaries,
                flight=self.flight,
                workers=self.workers,
                newest=lambda: self.ledger,
                remint=self._mint,
                worker_left=self.worker_left,
                advance=self._advance,
                on_ban=deps.on_ban,
                referee=deps.referee,
                owners=self.owners,
                publish=self.publish,
                batch_over=lambda: self._next_batch(0.0),
            ),
        )
        self.trust = self.hooks.trust
        self.results = TaskResults(
            ResultDeps(
                pool=self.pool,
                broker=self.broker,
                workers=self.workers,
                flight=self.flight,
                boundaries=self.boundaries,
                guard=self.guard,
                trust=self.trust,
                figures=self.figures,
                shapes=self.shapes,
                codec=self.codec,
                advance=self._advance,
                planner=self.planner,
                clock=self.clock,
                carried=self.hooks.carried,
            )
        )
        self.moves = WorkerMoves(
            MoveDeps(
                broker=self.broker,
                workers=self.workers,
                rounds=self.rounds,
                guard=self.guard,
                flight=self.flight,
                planner=self.planner,
                dispatch=self.dispatch,
                rebalance_every=shape.rebalance_every,
            )
        )
        self._fill()  # with delayed updates the second batch starts at once: its version is published

    # --- batches --------------------------------------------------------------------------------
    def _mint(self, batch: int) -> Ledger:
        ledger = self.ledger = self.flight.mint(batch)
        self.pool.start(ledger)
        return ledger

    async def _publish(self, outcome: BatchOutcome) -> None:
        """The batch's step through the relay's after-publish sequence, its workers credited
        with what the leaderboard credits them."""
        await self.publish(outcome)
        self.figures.batch_committed(outcome.contributions)

    def waste_totals(self) -> WasteTotals:
        """Re-dispatched tasks, recomputed stage gradients, refused duplicate results: so far."""
        return WasteTotals(
            redispatched=self.broker.stats.requeued, recomputed=self.results.redone, refused=self.results.refused
        )

    def _next_batch(self, round_s: float) -> None:
        """The batch's step is published: nothing of it may be leased after its boundaries go;
        re-time the placement; the next batch starts on the new version (with delayed updates it
        is computing already, and its round may open now)."""
        closed = self.flight.close()
        self.figures.batch_over(closed.batch, self.waste_totals())
        self.pool.batch_over(closed)
        self.guard.batch_over(closed.batch)
        self.hooks.batch_over(closed)
        for m in closed.microbatches:
            self.boundaries.drop(m)
        self.moves.replan(round_s)
        self._fill()
        self._advance()
        self.hooks.after_round()

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
        ticket = self.rounds.ticket(worker, step, req)
        ms = self.rounds.microbatches_of(ticket.peer_id)
        self.hooks.ticketed(ticket, worker, req.stage, ms, self.flight.closing())
        return ticket

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
            tasks = [t for t in tasks if self.pool.still_wanted(t)]
            for task in tasks:
                self.rounds.batch_began(self.pool.steps[task.task_id].batch)
            if tasks or self.clock() >= deadline:
                break
        out, tensors = [], {}
        for i, task in enumerate(tasks):
            step = self.pool.steps[task.task_id]
            cached_input = step.kind == BACKWARD and step.microbatch in cached and step.prefer == worker
            names = step.inputs()
            for name in names[1:] if cached_input else names:  # [0] is the stage's input
                tensors.update(_renamed(self.boundaries.get(step.microbatch, name), name, i))
            carried = self.hooks.carried(step.microbatch) if step.kind == FIRST else None
            if carried is not None:  # a batch a rollback undid: its kept data, replayed (:mod:`.kept_inputs`)
                tensors.update(_renamed(carried, "batch", i))
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
                    replay=carried is not None,
                    redo=step.redo,
                )
            )
        return PipelineWork(stage=stage, tasks=out), tensors

    async def _lease_or_round(self, worker: str, stage: int, wait_s: float) -> list[Task]:
        """A task of the worker's stage, or nothing when the round opens first (the worker then
        gets its upload at once instead of after its long poll)."""
        lease = asyncio.ensure_future(
            self.broker.lease(
                worker,
                [stage_key(stage), f"{stage_key(stage)}/{worker}"],
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

    def result(self, worker: str, task_id: str, body: bytes) -> PipelineAck:
        """A task's result (:meth:`~.task_results.TaskResults.result`)."""
        return self.results.result(worker, task_id, body)

    # --- upkeep the service ticks -----------------------------------------------------------------
    def restart_lost(self) -> None:
        self.pool.restart_lost()

    def staff_empty_stages(self) -> None:
        self.moves.staff_empty_stages()

    def orphan_silent(self, silence: dict[str, float]) -> None:
        self.moves.orphan_silent(silence)

    def banned(self, worker: str, reason: str) -> None:
        """``worker`` lied: the batch restarts (:meth:`~.trust_hooks.TrustHooks.banned`)."""
        self.hooks.banned(worker, reason)

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


def _renamed(entry: bytes, name: str, i: int) -> dict[str, np.ndarray]:
    """A stored boundary's tensors under the names task ``i`` of a work answer gives them."""
    _, tensors = payloads.decode(entry, len(entry))
    if name == "batch":
        return {f"{i}.{key}": array for key, array in tensors.items()}
    prefix = f"{i}.x" if name.startswith("a") else f"{i}.g"
    return {prefix + key[1:]: array for key, array in tensors.items()}
