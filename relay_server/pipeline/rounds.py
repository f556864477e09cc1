"""A pipeline batch's round: from the moment its last backward finished to the published step.

When every micro-batch finished its backward the round opens (waiting workers are woken); every
worker holding stage gradients gets its list of micro-batches with its next poll, asks for a
ticket naming exactly those (anything else is refused, and its micro-batches recomputed), and
uploads its stage's slice to that stage's parameter server through the ticketed route every
sliced run uses. What a parameter server committed counts (never what a worker says); the round
closes when every stage counted every micro-batch, at once (not at the next tick): every stage
steps, the version is published, and the next batch starts on it. A mixin of
:class:`~relay_server.pipeline.coordinator.PipelineCoordinator`, whose state it shares.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass

from relay_server.backbone.slicing import Published
from relay_server.backbone.tickets import sign_ticket
from relay_server.core.errors import ApiError
from relay_server.pipeline.stage_owners import PLAN_VERSION
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


@dataclass
class OpenRound:
    step: int
    round_id: str
    opened_at: float
    tickets: dict[str, tuple[str, int, list[int]]]
    """contributor id -> (worker, stage, micro-batches) of every ticket issued and not yet counted."""
    issued: dict[str, int]
    """worker -> tickets issued to it in this round (its next contributor id's serial)."""



class PipelineRounds:
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
        self._seen(worker)
        if call is None or call.stage != req.stage or call.microbatches != sorted(req.microbatches):
            if self._recompute(worker):
                self._strike(worker)  # its gradients are recomputed by others while any serve its stage
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
                self.ledger.deliver(stage, ms, worker)
                self._committed(worker, stage)
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
        self._recompute(worker, only=(stage, set(ms)))

    def _recompute(self, worker: str, only: tuple[int, set[int]] | None = None) -> int:
        """``worker``'s undelivered stage gradients (``only`` those of one stage) are recomputed
        by others, except what it is uploading now; every ticket of it naming one of them is void
        at once (an upload with it is refused ``round_closed``), so a gradient is never counted
        from both its old holder and its redo. How many were sent to be recomputed."""
        redo = self.ledger.orphan(worker, keep=self._in_flight(), only=only)
        gone = {(s.stage, s.microbatch) for s in redo}
        r = self.round
        if r is not None and gone:
            for contributor, (w, stage, ms) in list(r.tickets.items()):
                if w == worker and contributor not in self.uploading and any((stage, m) in gone for m in ms):
                    del r.tickets[contributor]
        for step in redo:
            self._submit(step)
        return len(redo)

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
        await self.publish(BatchOutcome(published=published, loss_sum=self.ledger.loss_sum, samples=self.d * self.mb_size,
                                        elapsed_s=elapsed, grad_norm=grad_norm, contributions=contributions))
        for task_id in list(self.steps):  # nothing of the finished batch may be leased after its boundaries go
            self.broker.cancel(task_id, ApiError(410, "batch_over", "the batch this task belonged to is over"))
        self.steps.clear()
        self._batch_over()
        for m in self.ledger.microbatches:
            self.boundaries.drop(m)
        self._replan(self.clock() - r.opened_at)
        self.round, self.finalizing = None, False
        self.batch_index += 1
        self.batch_started = None
        self._mint()


def _contributor(worker: str, serial: int) -> str:
    return f"{worker[:40]}.{serial}"

