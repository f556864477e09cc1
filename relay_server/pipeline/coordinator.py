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
* **Rounds** (:mod:`.ledger` for the bookkeeping): when every micro-batch finished its backward,
  the round opens; every worker holding stage gradients gets its list of micro-batches with its
  next poll, asks for a ticket naming exactly those (anything else is refused, and re-done), and
  uploads its stage's slice to that stage's parameter server (:mod:`.stage_owners`) through the
  ticketed route every sliced run uses. The round closes when every stage counted every
  micro-batch; then every stage steps, the new version is published and the next batch starts on
  it (staleness 0). No barrier waits for a particular worker: a joiner gets tasks of the batch in
  flight at its first poll.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from relay_server.backbone.slicing import Published
from relay_server.backbone.tickets import sign_ticket
from relay_server.core.errors import ApiError
from relay_server.pipeline.boundaries import Boundaries
from relay_server.pipeline.ledger import BACKWARD, FIRST, LAST, Ledger, Step
from relay_server.pipeline.plan import Planner
from relay_server.pipeline.results import Shapes, read_result
from relay_server.pipeline.stage_owners import PLAN_VERSION, StageOwners
from relay_server.pipeline.workers import Workers
from relay_server.tasks.broker import TaskBroker
from toolkit.moe import payloads
from toolkit.wire.compression import Codec
from toolkit.wire.protocol import (PipelineAck, PipelineRoundCall, PipelineTask, PipelineTicketRequest, PipelineWork,
                                   SliceDigest, Ticket)

log = logging.getLogger(__name__)
NO_DEADLINE_S = 7 * 24 * 3600.0  # tasks never fail by age: their leases expire and they are re-dispatched
MAX_TASKS_PER_POLL = 1  # one at a time: a second task leased to a busy worker would idle another


@dataclass
class OpenRound:
    step: int
    round_id: str
    opened_at: float
    tickets: dict[str, tuple[str, int, list[int]]]
    """contributor id -> (worker, stage, micro-batches) of every ticket issued and not yet counted."""
    issued: dict[str, int]
    """worker -> tickets issued to it in this round (its next contributor id's serial)."""


class PipelineCoordinator:
    def __init__(self, *, num_stages: int, microbatch_size: int, microbatches_per_batch: int, owners: StageOwners,
                 broker: TaskBroker, boundaries: Boundaries, workers: Workers, shapes: Shapes, codec: Codec,
                 ticket_key: str, publish: Callable[[Published, float, int, float, float, dict[str, int]], None],
                 dispatch: str = "pool", planner: Planner | None = None, rebalance_every: int = 0,
                 clock=time.monotonic) -> None:
        self.K, self.mb_size, self.d = num_stages, microbatch_size, microbatches_per_batch
        self.owners, self.broker, self.boundaries, self.workers = owners, broker, boundaries, workers
        self.shapes, self.codec, self.ticket_key, self.publish, self.clock = shapes, codec, ticket_key, publish, clock
        self.dispatch = dispatch
        self.planner, self.rebalance_every, self.moves = planner, rebalance_every, 0
        self.pins: dict[tuple[int, int], str] = {}  # "static": (stage, micro-batch) -> its worker
        self.steps: dict[str, Step] = {}  # task id -> what it computes (tasks of the batch in flight)
        self.round: OpenRound | None = None
        self.uploading: set[str] = set()  # contributors whose slice upload is streaming now
        self.batch_index, self.next_microbatch = 0, 0
        self.ledger = self._mint()
        self.finalizing = False
        self.batch_started: float | None = None  # the batch's first lease: joining time is not batch time
        self.batch_times: list[float] = []
        self.bytes_out = 0
        self.samples_done = 0
        self.redone = self.refused = self.restarted = 0
        self._round_opened = asyncio.Event()
        self._finalize_task: asyncio.Task | None = None
        self.layers: list[int] = []
        self.counted: list[list[int]] = []  # samples each stage counted, per recent round
        self.predicted_batch_s: float | None = None

    # --- batches --------------------------------------------------------------------------------
    def _mint(self) -> Ledger:
        ledger = Ledger(self.batch_index, self.owners.step, self.K, self.next_microbatch, self.d)
        self.next_microbatch += self.d
        self.ledger = ledger
        if self.dispatch == "static":  # each stage's micro-batches dealt round-robin to its workers now
            self.pins = {(k, m): ws[i % len(ws)] for k in range(self.K) if (ws := self.workers.on_stage(k))
                         for i, m in enumerate(ledger.microbatches)}
        for step in ledger.start():
            self._submit(step)
        return ledger

    def _submit(self, step: Step) -> None:
        backward_work = step.kind in (LAST, BACKWARD)
        task = self.broker.submit(caller="pipeline", call_id=f"{self.ledger.batch}.{step.kind}.{step.stage}."
                                  f"{step.microbatch}.{'r' if step.redo else ''}{secrets.token_hex(4)}",
                                  key=self._key_of(step), kind=step.kind, rows=1, payload=b"", timeout_s=NO_DEADLINE_S,
                                  requeue_on_loss=True, prefer=step.prefer,
                                  priority=(0 if backward_work else 1, self.ledger.batch, step.microbatch))
        self.steps[task.task_id] = step

    # --- workers: tasks -------------------------------------------------------------------------
    async def work(self, worker: str, cached: set[int], wait_s: float) -> tuple[PipelineWork, dict]:
        """The worker's next tasks with their inputs, or the round it must upload to."""
        stage = self.workers.stage_of(worker)
        deadline = self.clock() + wait_s
        while True:
            call = self._round_call(worker)
            if call is not None:
                return PipelineWork(stage=stage, round=call), {}
            tasks = await self._lease_or_round(worker, stage, max(0.0, deadline - self.clock()))
            tasks = [t for t in tasks if self._still_wanted(t)]
            if tasks and self.batch_started is None:
                self.batch_started = self.clock()
            if tasks or self.clock() >= deadline:
                break
        out, tensors = [], {}
        for i, task in enumerate(tasks):
            step = self.steps[task.task_id]
            cached_input = step.kind == BACKWARD and step.microbatch in cached and step.prefer == worker
            names = step.inputs()
            for name in names[1:] if cached_input else names:  # [0] is the stage's input
                tensors.update(_renamed(self.boundaries.get(step.microbatch, name), name, i))
            out.append(PipelineTask(task_id=task.task_id, kind=step.kind, stage=step.stage, batch=self.ledger.batch,
                                    microbatch=step.microbatch, version=self.ledger.version,
                                    lease_s=self.broker.lease_deadline(task.key), input_cached=cached_input,
                                    redo=step.redo))
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
            fresh = self.next_microbatch
            self.next_microbatch += 1
            self.ledger.replace(step.microbatch, fresh)
            self.restarted += 1
            self._submit(Step(FIRST, 0, fresh))

    async def _lease_or_round(self, worker: str, stage: int, wait_s: float) -> list:
        """A task of the worker's stage, or nothing when the round opens first (the worker then
        gets its upload at once instead of after its long poll)."""
        lease = asyncio.ensure_future(self.broker.lease(worker, [_key(stage), f"{_key(stage)}/{worker}"],
                                                        max_rows=MAX_TASKS_PER_POLL, wait_s=wait_s))
        opened = asyncio.ensure_future(self._round_opened.wait())
        try:
            await asyncio.wait({lease, opened}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            opened.cancel()
            if not lease.done():
                lease.cancel()
        try:
            return await lease  # a lease that took its tasks before the cancel landed still returns them
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # this request itself is being cancelled
            return []

    def _still_wanted(self, task) -> bool:
        if task.task_id in self.steps:
            return True
        self.broker.cancel(task.task_id, ApiError(410, "batch_over", "the batch this task belonged to is over"))
        return False

    def result(self, worker: str, task_id: str, body: bytes) -> PipelineAck:
        """Validate a task's result, then (first result wins) store its boundary and queue the next step."""
        task = self.broker.tasks.get(task_id)
        if task is not None and task.state == "done":
            if task.worker == worker:  # our own result, retried after a lost answer
                return PipelineAck(task_id=task_id, accepted=True)
            self.refused += 1
            return PipelineAck(task_id=task_id, accepted=False)
        step = self.steps.get(task_id)
        if step is None:
            raise ApiError(410, "task_expired", f"task {task_id!r} is not part of the batch in flight",
                           "Drop this result and its gradient; take the next task.")
        if self.workers.by_id.get(worker) is not None and self.workers.stage_of(worker) != step.stage:
            raise ApiError(410, "stage_moved", f"this worker moved off stage {step.stage}; its result for it is not used",
                           "Drop it and take the next task of your new stage.")
        mb = self.ledger.microbatches[step.microbatch]
        accepted = read_result(body, step, mb.rows, self.shapes, self.codec)  # before the broker sees it
        try:
            task = self.broker.complete(worker, task_id, b"")
        except ApiError as exc:
            if exc.code in ("task_done",):
                self.refused += 1
                return PipelineAck(task_id=task_id, accepted=False)
            raise
        if self.planner is not None and task.attempts == 1 and task.leased_at is not None:
            self.planner.observe_task(worker, self.clock() - task.leased_at)
        for name, entry in accepted.entries.items():
            self.boundaries.put(step.microbatch, name, entry)
        if step.redo:
            self.redone += 1
        following = self.ledger.accept(step, worker, rows=accepted.rows, loss_sum=accepted.result.loss_sum)
        del self.steps[task_id]
        if following is not None:
            self._submit(following)
        elif self.ledger.complete and self.round is None:
            self._open_round()
        return PipelineAck(task_id=task_id, accepted=True)

    # --- rounds ---------------------------------------------------------------------------------
    def _open_round(self) -> None:
        self._round_opened.set()
        self._round_opened = asyncio.Event()
        self.round = OpenRound(step=self.owners.step, round_id=secrets.token_hex(8), opened_at=self.clock(),
                               tickets={}, issued={})
        log.info("pipeline batch %d complete (%d micro-batches): round %d open", self.ledger.batch, self.d,
                 self.round.step)

    def _round_call(self, worker: str) -> PipelineRoundCall | None:
        r = self.round
        if r is None:
            return None
        ticketed = {(s, m) for w, s, ms in r.tickets.values() if w == worker for m in ms}
        for stage, ms in self.ledger.owned(worker).items():
            todo = [m for m in ms if (stage, m) not in ticketed]
            if todo:
                return PipelineRoundCall(step=r.step, round_id=r.round_id, stage=stage, microbatches=sorted(todo),
                                         contributor=_contributor(worker, r.issued.get(worker, 0)))
        return None

    def ticket(self, worker: str, step: int, req: PipelineTicketRequest) -> Ticket:
        r = self.round
        if r is None or r.step != step or r.round_id != req.round_id:
            raise ApiError(409, "round_closed", f"no pipeline round {step} ({req.round_id}) is open",
                           "Drop this gradient; take the next task.")
        call = self._round_call(worker)
        if call is None or call.stage != req.stage or call.microbatches != sorted(req.microbatches):
            redo = self.ledger.orphan(worker, keep=self._in_flight())
            for s in redo:
                self._submit(s)
            raise ApiError(409, "wrong_microbatches", f"the relay expected micro-batches "
                           f"{call.microbatches if call else []} of stage {call.stage if call else req.stage}, "
                           f"the ticket asks for {sorted(req.microbatches)}",
                           "Drop this gradient (its micro-batches are being recomputed) and take the next task.")
        contributor = _contributor(worker, r.issued.get(worker, 0))
        r.issued[worker] = r.issued.get(worker, 0) + 1
        r.tickets[contributor] = (worker, req.stage, list(call.microbatches))
        start, end = self.owners.cuts[req.stage]
        return sign_ticket(Ticket(round_id=r.round_id, step=step, peer_id=contributor,
                                  samples=len(call.microbatches) * self.mb_size, version=step,
                                  plan_version=PLAN_VERSION, expires_at=time.time() + 3600.0,
                                  slices=[SliceDigest(start=start, end=end, header_sha256=req.header_sha256)]),
                           self.ticket_key)

    def check_delivered(self) -> None:
        """Count what every stage's parameter server committed; close the round when all is in."""
        r = self.round
        if r is None or self.finalizing:
            return
        for contributor, (worker, stage, ms) in list(r.tickets.items()):
            owner_round = self.owners.owners[stage].round
            if owner_round is not None and owner_round.round_id == r.round_id and contributor in owner_round.received:
                self.ledger.deliver(stage, ms)
                del r.tickets[contributor]
        if self.ledger.counted:
            self.finalizing = True
            self._finalize_task = asyncio.get_running_loop().create_task(self.finalize())

    def retry_finalize(self) -> None:
        """A finalize that failed (an owner's error) is tried again (owners are idempotent per round)."""
        task = self._finalize_task
        if self.finalizing and task is not None and task.done():
            if not task.cancelled() and task.exception() is not None:
                log.error("pipeline round %s failed to finalize; retrying", self.round.round_id if self.round else "?",
                          exc_info=task.exception())
            self._finalize_task = asyncio.get_running_loop().create_task(self.finalize())

    def done(self, worker: str, round_id: str, contributor: str, delivered: bool) -> None:
        """A worker says its upload ended; one that failed makes its micro-batches orphans."""
        self.check_delivered()
        r = self.round
        if r is None or r.round_id != round_id or delivered or contributor not in r.tickets:
            return
        owner, stage, ms = r.tickets[contributor]
        if owner != worker or contributor in self.uploading:
            return
        del r.tickets[contributor]
        for step in self.ledger.orphan(worker, keep=self._in_flight(), only=(stage, set(ms))):
            self._submit(step)

    def _in_flight(self) -> set[tuple[int, int]]:
        r = self.round
        if r is None:
            return set()
        return {(s, m) for c, (_, s, ms) in r.tickets.items() if c in self.uploading for m in ms}

    async def finalize(self) -> None:
        """Every stage steps; publish; drop the batch's boundaries; the next batch starts."""
        r = self.round
        published, grad_norm, counted = await self.owners.finalize(r.step, r.round_id)
        self.counted = (self.counted + [counted])[-20:]
        elapsed = self.clock() - (self.batch_started if self.batch_started is not None else r.opened_at)
        self.batch_times = (self.batch_times + [elapsed])[-20:]
        self.samples_done += self.d * self.mb_size
        contributions: dict[str, int] = {}
        for mb in self.ledger.microbatches.values():
            for worker in mb.owners.values():
                contributions[worker] = contributions.get(worker, 0) + self.mb_size
        self.publish(published, self.ledger.loss_sum, self.d * self.mb_size, elapsed, grad_norm, contributions)
        for m in self.ledger.microbatches:
            self.boundaries.drop(m)
        self._replan(self.clock() - r.opened_at)
        self.round, self.finalizing = None, False
        self.batch_index += 1
        self.batch_started = None
        self._mint()

    # --- the planner ----------------------------------------------------------------------------
    def _replan(self, round_s: float) -> None:
        """Between batches: re-time the placement (the predicted time per batch), and every
        ``rebalance_every`` batches move the one worker whose move the planner says pays."""
        if self.planner is None:
            return
        self.planner.observe_round(round_s)
        placement = self.workers.placement()
        due = self.dispatch == "pool" and self.rebalance_every and self.batch_index % self.rebalance_every == 0
        move = self.planner.move(placement) if due else None
        self.planner.replan(placement)
        self.predicted_batch_s = self.planner.predicted_batch_s()
        if move is not None:
            self._move(move.worker, move.to_stage, f"predicted {move.gain_s_per_batch:.2f} s per batch faster")

    def staff_empty_stages(self) -> None:
        """A stage with no worker stalls the batch: move one there now from a stage with two or
        more, if it holds no stage gradient yet to upload (``dispatch = "pool"`` only)."""
        if self.planner is None or self.dispatch != "pool":
            return
        move = self.planner.fill_empty(self.workers.placement())
        if move is not None and not self.ledger.owned(move.worker):
            self._move(move.worker, move.to_stage, "its new stage had no worker")

    def _move(self, worker: str, stage: int, why: str) -> None:
        log.info("pipeline: worker %s moves from stage %d to stage %d (%s)", worker[:16],
                 self.workers.stage_of(worker), stage, why)
        self.broker.worker_left(worker)  # tasks it holds of its old stage go back to that stage's queue
        self.workers.move(worker, stage)
        self.planner.forget(worker)
        self.moves += 1

    # --- membership -----------------------------------------------------------------------------
    def worker_left(self, worker: str) -> None:
        """Its leased tasks go back to the front of the queue (the broker); the stage gradients it
        held and had not delivered are recomputed by others (``redo``)."""
        self.broker.worker_left(worker)
        for step in self.ledger.orphan(worker, keep=self._in_flight()):
            self._submit(step)
        if self.round is not None:
            for contributor, (w, _, _) in list(self.round.tickets.items()):
                if w == worker and contributor not in self.uploading:
                    del self.round.tickets[contributor]
        self.workers.remove(worker)
        if self.planner is not None:
            self.planner.forget(worker)


def _contributor(worker: str, serial: int) -> str:
    return f"{worker[:40]}.{serial}"


def _key(stage: int) -> str:
    return f"stage{stage}"


def _renamed(entry: bytes, name: str, i: int) -> dict:
    """A stored boundary's tensors under the names task ``i`` of a work answer gives them."""
    _, tensors = payloads.decode(entry, len(entry))
    if name == "batch":
        return {f"{i}.{key}": array for key, array in tensors.items()}
    prefix = f"{i}.x" if name.startswith("a") else f"{i}.g"
    return {prefix + key[1:]: array for key, array in tensors.items()}
