"""A pipeline batch's round: from the moment its last backward finished to the published step.

When every micro-batch finished its backward the round opens (waiting workers are woken); every
worker holding stage gradients gets its list of micro-batches with its next poll, asks for a
ticket naming exactly those (anything else is refused, and its micro-batches recomputed), and
uploads its stage's slice to that stage's parameter server through the ticketed route every
sliced run uses. What a parameter server committed counts (never what a worker says); the round
closes when every stage counted every micro-batch, at once (not at the next tick): every stage
steps, the version is published, and the next batch starts on it -- or, with delayed parameter
updates, the next batch started when the round opened, and this one's close lets the batch after
it start.

:class:`PipelineRounds` owns the open round, the uploads streaming into it and the finalize; it
reaches the rest of the pipeline only through :class:`RoundDeps` (the batch's ledger, the stages'
parameter servers, the guard's hooks, the pool, the publisher, the coordinator's next batch).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from relay_server.backbone.slicing import Published
from relay_server.backbone.tickets import sign_ticket
from relay_server.core.errors import ApiError
from relay_server.pipeline.ledger import Ledger, Step
from relay_server.pipeline.stage_owners import PLAN_VERSION, StageOwners
from toolkit.wire.protocol import PipelineRoundCall, PipelineTicketRequest, SliceDigest, Ticket

log = logging.getLogger(__name__)


@dataclass
class BatchOutcome:
    """A finished batch, as the coordinator hands it to its publisher."""

    published: Published
    loss_sum: float
    samples: int
    elapsed_s: float
    grad_norm: float
    contributions: dict[str, int]
    finalized_by: str = "pipeline"
    """What produced the step: a round ("pipeline") or a late ban's rollback ("rollback")."""


@dataclass
class OpenRound:
    step: int
    round_id: str
    opened_at: float
    tickets: dict[str, tuple[str, int, list[int]]]
    """contributor id -> (worker, stage, micro-batches) of every ticket issued and not yet counted."""
    issued: dict[str, int]
    """worker -> tickets issued to it in this round (its next contributor id's serial)."""


@dataclass(frozen=True)
class RoundDeps:
    """What a pipeline round works through, each owned elsewhere."""

    owners: StageOwners
    ledger: Callable[[], Ledger]
    """The ledger of the batch whose round is open or opens next: the oldest in flight (the
    coordinator mints a new one per batch)."""
    ledgers: Callable[[], list[Ledger]]
    """Every batch in flight's (two with delayed parameter updates: the round's and the next)."""
    clock: Callable[[], float]
    microbatch_size: int
    microbatches_per_batch: int
    ticket_key: str
    publish: Callable[[BatchOutcome], Awaitable[None]]
    seen: Callable[[str], None]
    """The guard: a request shows the worker at work."""
    strike: Callable[[str], None]
    """The guard: the worker held things up (no tasks for a while)."""
    committed: Callable[[str, int], None]
    """The guard: ``worker``'s gradient of a stage committed (its hold is measured)."""
    resubmit: Callable[[Step], object]  # the coordinator's submit (it returns the task id)
    """The pool: a micro-batch's stage gradient to recompute."""
    batch_over: Callable[[float], None]
    """The coordinator: the batch is published; drop it and start the next (the round's seconds)."""


class PipelineRounds:
    """The open round of the batch in flight (``round``: None between rounds) and its finalize."""

    def __init__(self, deps: RoundDeps) -> None:
        self.deps = deps
        self.round: OpenRound | None = None
        self.uploading: set[str] = set()  # contributors whose slice upload is streaming now
        self.finalizing = False
        self.opened = asyncio.Event()
        """Set when the round opens (then replaced): what a waiting worker's long poll also waits on."""
        self.finalize_task: asyncio.Task[None] | None = None
        self.batch_started: dict[int, float] = {}  # batch -> its first lease: joining time is not batch time
        self.batch_times: list[float] = []
        self.samples_done = 0
        self.counted: list[list[int]] = []  # samples each stage counted, per recent round

    def batch_began(self, batch: int) -> None:
        """A task of ``batch`` was leased: the batch's time counts from the first one (with
        delayed updates, while the round before it may still be open)."""
        self.batch_started.setdefault(batch, self.deps.clock())

    def open(self) -> None:
        ledger = self.deps.ledger()
        self.opened.set()
        self.opened = asyncio.Event()
        self.round = OpenRound(
            step=self.deps.owners.step,
            round_id=secrets.token_hex(8),
            opened_at=self.deps.clock(),
            tickets={},
            issued={},
        )
        log.info(
            "pipeline batch %d complete (%d micro-batches): round %d open",
            ledger.batch,
            self.deps.microbatches_per_batch,
            self.round.step,
        )

    def call(self, worker: str) -> PipelineRoundCall | None:
        r = self.round
        if r is None:
            return None
        ticketed = {(s, m) for w, s, ms in r.tickets.values() if w == worker for m in ms}
        for stage, ms in self.deps.ledger().owned(worker).items():
            todo = [m for m in ms if (stage, m) not in ticketed]
            if todo:
                return PipelineRoundCall(
                    step=r.step,
                    round_id=r.round_id,
                    stage=stage,
                    microbatches=sorted(todo),
                    contributor=_contributor(worker, r.issued.get(worker, 0)),
                )
        return None

    def ticket(self, worker: str, step: int, req: PipelineTicketRequest) -> Ticket:
        r = self.round
        if r is None or r.step != step or r.round_id != req.round_id:
            raise ApiError(
                409,
                "round_closed",
                f"no pipeline round {step} ({req.round_id}) is open",
                "Drop this gradient; take the next task.",
            )
        call = self.call(worker)
        self.deps.seen(worker)
        if call is None or call.stage != req.stage or call.microbatches != sorted(req.microbatches):
            if self.recompute(worker, round_only=True):
                self.deps.strike(worker)  # its gradients are recomputed by others while any serve its stage
            raise ApiError(
                409,
                "wrong_microbatches",
                f"the relay expected micro-batches "
                f"{call.microbatches if call else []} of stage {call.stage if call else req.stage}, "
                f"the ticket asks for {sorted(req.microbatches)}",
                "Drop this gradient (its micro-batches are being recomputed) and take the next task.",
            )
        contributor = _contributor(worker, r.issued.get(worker, 0))
        r.issued[worker] = r.issued.get(worker, 0) + 1
        r.tickets[contributor] = (worker, req.stage, list(call.microbatches))
        start, end = self.deps.owners.cuts[req.stage]
        return sign_ticket(
            Ticket(
                round_id=r.round_id,
                step=step,
                peer_id=contributor,
                samples=len(call.microbatches) * self.deps.microbatch_size,
                version=step,
                plan_version=PLAN_VERSION,
                expires_at=time.time() + 3600.0,
                slices=[SliceDigest(start=start, end=end, header_sha256=req.header_sha256)],
            ),
            self.deps.ticket_key,
        )

    def microbatches_of(self, contributor: str) -> list[int]:
        """The micro-batches the open round's ticket ``contributor`` names (none once it is void)."""
        r = self.round
        return list(r.tickets[contributor][2]) if r is not None and contributor in r.tickets else []

    def check_delivered(self) -> None:
        """Count what every stage's parameter server committed; close the round when all is in."""
        r = self.round
        if r is None or self.finalizing:
            return
        ledger = self.deps.ledger()
        for contributor, (worker, stage, ms) in list(r.tickets.items()):
            owner_round = self.deps.owners.owners[stage].round
            if owner_round is not None and owner_round.round_id == r.round_id and contributor in owner_round.received:
                ledger.deliver(stage, ms, worker)
                self.deps.committed(worker, stage)
                del r.tickets[contributor]
        if ledger.counted:
            self.finalizing = True
            self.finalize_task = asyncio.get_running_loop().create_task(self.finalize())

    def retry_finalize(self) -> None:
        """A finalize that failed (an owner's error) is tried again (owners are idempotent per round)."""
        task = self.finalize_task
        if self.finalizing and task is not None and task.done():
            if not task.cancelled() and task.exception() is not None:
                log.error(
                    "pipeline round %s failed to finalize; retrying",
                    self.round.round_id if self.round else "?",
                    exc_info=task.exception(),
                )
            self.finalize_task = asyncio.get_running_loop().create_task(self.finalize())

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
        self.recompute(worker, only=(stage, set(ms)))

    def recompute(self, worker: str, only: tuple[int, set[int]] | None = None, round_only: bool = False) -> int:
        """``worker``'s undelivered stage gradients (``only`` those of one stage of the round's
        batch; ``round_only``: of the round's batch, not of the batch computing meanwhile) are
        recomputed by others, except what it is uploading now; every ticket of it naming one of
        them is void at once (an upload with it is refused ``round_closed``), so a gradient is
        never counted from both its old holder and its redo. How many were sent to be recomputed."""
        closing = self.deps.ledger()
        redo = closing.orphan(worker, keep=self.in_flight(), only=only)
        if only is None and not round_only:
            for ledger in self.deps.ledgers():
                if ledger is not closing:
                    redo += ledger.orphan(worker)
        gone = {(s.stage, s.microbatch) for s in redo}
        r = self.round
        if r is not None and gone:
            for contributor, (w, stage, ms) in list(r.tickets.items()):
                if w == worker and contributor not in self.uploading and any((stage, m) in gone for m in ms):
                    del r.tickets[contributor]
        for step in redo:
            self.deps.resubmit(step)
        return len(redo)

    def in_flight(self) -> set[tuple[int, int]]:
        r = self.round
        if r is None:
            return set()
        return {(s, m) for c, (_, s, ms) in r.tickets.items() if c in self.uploading for m in ms}

    def uploaders(self) -> set[str]:
        """Workers whose slice upload is streaming now."""
        r = self.round
        return {r.tickets[c][0] for c in self.uploading if r is not None and c in r.tickets}

    def worker_left(self, worker: str) -> None:
        """Its tickets are void, except for an upload still streaming (it may yet commit)."""
        if self.round is not None:
            for contributor, (w, _, _) in list(self.round.tickets.items()):
                if w == worker and contributor not in self.uploading:
                    del self.round.tickets[contributor]

    async def finalize(self) -> None:
        """Every stage steps; publish; the coordinator drops the batch and starts the next."""
        r: OpenRound = self.round  # type: ignore[assignment]  # finalize is started only on an open round
        ledger, mb_size = self.deps.ledger(), self.deps.microbatch_size
        published, grad_norm, counted = await self.deps.owners.finalize(r.step, r.round_id)
        self.counted = (self.counted + [counted])[-20:]
        started = self.batch_started.get(ledger.batch)
        elapsed = self.deps.clock() - (started if started is not None else r.opened_at)
        self.batch_times = (self.batch_times + [elapsed])[-20:]
        contributions: dict[str, int] = {}
        for mb in ledger.microbatches.values():
            for worker in mb.owners.values():
                contributions[worker] = contributions.get(worker, 0) + mb_size
        samples = self.deps.microbatches_per_batch * mb_size
        self.samples_done += samples
        await self.deps.publish(
            BatchOutcome(
                published=published,
                loss_sum=ledger.loss_sum,
                samples=samples,
                elapsed_s=elapsed,
                grad_norm=grad_norm,
                contributions=contributions,
            )
        )
        round_s = self.deps.clock() - r.opened_at
        self.round, self.finalizing = None, False
        self.batch_started = {b: t for b, t in self.batch_started.items() if b > ledger.batch}
        self.deps.batch_over(round_s)


def _contributor(worker: str, serial: int) -> str:
    return f"{worker[:40]}.{serial}"
