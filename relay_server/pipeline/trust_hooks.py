"""Where the pipeline meets its checks (:mod:`relay_server.trust`): the spot checks submitted
and cancelled through the task pool, a check's inputs read from the stored boundaries, and what
a ban does to the batch in flight (it restarts, so no lie found in it is ever counted) and to
the committed batches holding the liar's unchecked results (:mod:`.rollback`), whose first-stage
data it hands the rollback to keep and replay (:mod:`.kept_inputs`).

Owns the run's :class:`~relay_server.trust.checks.PipelineTrust`, its audits of stage gradients
(:class:`~relay_server.trust.gradient_audit.GradientAudits`: a ticket's upload, checked before it
commits) and :class:`~.rollback.PipelineRollback`; the coordinator hands it the few calls it needs (mint a
batch again, a worker left, open the round when it may, publish, close the batch in flight).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from relay_server.pipeline.rollback import TOO_LATE, PipelineRollback, RollbackDeps
from relay_server.trust.checks import PipelineTrust, TrustDeps
from relay_server.trust.compare import tolerance
from relay_server.trust.gradient_audit import AuditDeps, GradientAudits
from relay_server.trust.task_kinds import StepLike

if TYPE_CHECKING:
    import numpy as np

    from relay_server.pipeline.batch_rounds import BatchOutcome
    from relay_server.pipeline.boundaries import Boundaries
    from relay_server.pipeline.coordinator import PipelineShape
    from relay_server.pipeline.guard import PipelineGuard
    from relay_server.pipeline.in_flight import InFlight
    from relay_server.pipeline.ledger import Ledger
    from relay_server.pipeline.stage_owners import StageOwners
    from relay_server.pipeline.task_pool import TaskPool
    from relay_server.pipeline.workers import Workers
    from relay_server.trust.referee import Referee
    from toolkit.wire.protocol import Ticket, TrustStatus

AUDIT_MARGIN_S = 0.25
"""Of an upload's deadline, what an audit leaves for the commit after it."""


@dataclass(frozen=True)
class HookDeps:
    """The coordinator's collaborators and calls the checks and a ban work through."""

    pool: TaskPool
    guard: PipelineGuard
    boundaries: Boundaries
    flight: InFlight
    workers: Workers
    newest: Callable[[], Ledger]
    """The newest batch in flight (the one computing)."""
    remint: Callable[[int], object]
    """Mint batch ``b`` again (a ban restarts it)."""
    worker_left: Callable[[str], None]
    advance: Callable[[], None]
    """Open the oldest batch's round when it may (its checks settled)."""
    on_ban: Callable[[str, str], None]
    """The relay's moderation: a worker was banned for lying (the reason)."""
    referee: Referee | None
    owners: StageOwners
    publish: Callable[[BatchOutcome], Awaitable[None]]
    """The relay's after-publish sequence (a rollback's step)."""
    batch_over: Callable[[], None]
    """Close the batch in flight and start the next on the published version."""


class TrustHooks:
    """The run's checks (:attr:`trust`), what a ban does to the pipeline, and the rollbacks
    (:attr:`rollback`)."""

    def __init__(self, shape: PipelineShape, deps: HookDeps) -> None:
        self.deps = deps
        self.per_batch = shape.microbatches_per_batch
        self.rollback = PipelineRollback(
            shape.rollback_batches if shape.check_share > 0 else 0,
            RollbackDeps(
                step=lambda: deps.owners.step,
                holds=deps.owners.holds,
                restore=deps.owners.rollback,
                publish=deps.publish,
                batch_over=deps.batch_over,
                restart_from=self.restart_from,
                resume=self.resume,
            ),
        )
        self.trust = PipelineTrust(
            TrustDeps(
                share=shape.check_share,
                tolerance=tolerance(shape.precision, shape.codec.name),
                width=shape.shapes.width,
                codec=shape.codec,
                probation=shape.probation,
                unchecked=self.rollback.unchecked,
                submit_check=lambda step, exclude: deps.pool.submit(step, exclude),  # type: ignore[arg-type]  # our own Steps
                cancel=lambda task_id: deps.pool.drop(task_id, "check_dropped"),
                can_serve=self.can_serve,
                inputs=self.inputs,
                version=lambda: deps.newest().version,
                batch=lambda: deps.newest().batch,
                banned=self.banned,
                settled=deps.advance,
                referee=deps.referee,
            )
        )
        self.last_stage = len(shape.layers) - 1
        self.audits = GradientAudits(
            AuditDeps(
                share=shape.check_share,
                tolerance=tolerance(shape.precision, "none"),
                codec=deps.owners.owners[0].codecs.up,
                referee=deps.referee,
                suspect=self.trust.monitor.suspect,
                probation=shape.probation,
            )
        )
        self.lied: dict[str, str] = {}  # worker -> reason: banned at a round, its rollback decided once it closed

    # --- audits of stage gradients ------------------------------------------------------------------
    def ticketed(self, ticket: Ticket, worker: str, stage: int, microbatches: list[int], ledger: Ledger) -> None:
        """A round's ticket was issued for ``ledger``'s batch: audit its upload, or count it
        unchecked (a later ban may undo the batch it is counted in). Only a chosen ticket reads
        the boundaries its micro-batches' backwards read (a backward's inputs: the stage's input,
        and the gradient of its output or the labels)."""
        if self.audits.chosen(ticket.round_id, ticket.peer_id, worker):
            first = "batch" if stage == 0 else f"a{stage - 1}"
            names = list(dict.fromkeys([first, "batch" if stage == self.last_stage else f"g{stage}"]))
            b = self.deps.boundaries
            held = all(b.has(m, n) for m in microbatches for n in names)
            inputs = [(m, {n: b.get(m, n) for n in names}) for m in microbatches] if held else None
            args = (ticket.round_id, ticket.peer_id, worker, stage, ledger.version, ledger.batch, inputs)
            if self.audits.begin(*args):
                return
        self.rollback.unchecked(ledger.batch, worker)

    def verifier(self, contributor: str, deadline: float) -> Callable[[np.ndarray], Awaitable[None]] | None:
        """What checks ``contributor``'s upload before it commits (None: not audited); it waits
        for the relay's sum until shortly before ``deadline`` (the event loop's time at which the
        upload is cut), then lets the upload commit unaudited."""
        if not self.audits.audited(contributor):
            return None

        async def verify(values: np.ndarray) -> None:
            left = deadline - asyncio.get_running_loop().time() - AUDIT_MARGIN_S
            await self.audits.verify(contributor, values, left)

        return verify

    def gradient_lie(self, worker: str, reason: str) -> None:
        """``worker``'s audited upload lied (refused, nothing of it counted): it is banned now, its
        stage gradients are recomputed by others from the held boundaries (the round closes on
        those), and once the round closed the batches holding its unchecked results are rolled
        back as after any ban (:meth:`banned`, from :meth:`batch_over`)."""
        self.trust.record_ban(worker, reason)
        self.lied[worker] = reason
        if worker in self.deps.workers.by_id:
            self.deps.worker_left(worker)
        self.deps.on_ban(worker, reason)

    def resume(self) -> None:
        """A rollback failed: the batch in flight restarts, as after a ban with nothing to undo."""
        self.deps.remint(self.deps.newest().batch)

    def restart_from(self, batch: int) -> None:
        """The next batch minted takes batch ``batch``'s micro-batch ids (a rollback to it)."""
        self.deps.flight.next_microbatch = batch * self.per_batch

    def batch_over(self, closed: Ledger) -> None:
        """``closed`` closed: committed by its round (its first-stage data kept for a rollback),
        or dropped by a rollback."""
        self.trust.batch_over()
        self.audits.round_over()
        if not self.rollback.dropping:
            self.rollback.committed(closed.batch, self.data_of(closed))

    def after_round(self) -> None:
        """The next batch started: a worker banned at the round just closed restarts it, and
        the batches holding its unchecked results roll back (:meth:`banned`)."""
        while self.lied:
            worker, reason = self.lied.popitem()
            self.banned(worker, reason, announced=True)

    def data_of(self, ledger: Ledger) -> dict[int, bytes]:
        """The first-stage data of ``ledger``'s micro-batches that were read (none without a window)."""
        if self.rollback.keep <= 0:
            return {}
        b = self.deps.boundaries
        return {m: b.get(m, "batch") for m in ledger.microbatches if b.has(m, "batch")}

    def carried(self, microbatch: int) -> bytes | None:
        """The data a first-stage task of ``microbatch`` carries: a rollback replays it."""
        return self.rollback.inputs.carried(microbatch)

    def status(self) -> TrustStatus:
        """The checks' figures with the rollbacks'."""
        return dataclasses.replace(
            self.trust.status(),
            rollback_batches=self.rollback.keep,
            kept_input_bytes=self.rollback.inputs.bytes,
            rollbacks=list(self.rollback.history),
            gradient_audits=self.audits.counters.audits,
            gradient_audits_agreed=self.audits.counters.agreed,
            gradient_lies=self.audits.counters.lies,
            gradient_audits_unserved=self.audits.counters.unserved,
            gradient_audit_microbatches=self.audits.counters.microbatches,
            gradient_audit_probation_microbatches=self.audits.counters.probation_microbatches,
            max_audit_distance=self.audits.counters.max_agreeing_distance,
        )

    def can_serve(self, stage: int, exclude: frozenset[str]) -> bool:
        """Whether some worker of ``stage``, outside ``exclude`` and not banned, serves it now."""
        return any(
            k == stage and w not in exclude and w not in self.trust.banned
            for w, (k, _) in self.deps.guard.serving_placement().items()
        )

    def inputs(self, step: StepLike) -> dict[str, bytes]:
        """The stored boundaries a check of ``step`` reads."""
        return {n: self.deps.boundaries.get(step.microbatch, n) for n in step.inputs()}

    def banned(self, worker: str, reason: str, announced: bool = False) -> None:
        """``worker`` lied (:class:`~relay_server.trust.checks.PipelineTrust` proved it): the open
        batch restarts -- every task cancelled, every boundary dropped, the same micro-batches
        queued again from their first stage -- so every result the liar delivered, and all that
        was computed from it, is recomputed by others before the round counts (the round cannot
        have opened: it waits for the batch's checks). Workers holding stage gradients of the
        batch drop them at their next request (``batch_restarted``). Then it leaves the pipeline,
        and the relay's moderation records the ban (``announced``: it did, at the round where an
        audit found the lie: :meth:`gradient_lie`)."""
        d = self.deps
        ledger = d.newest()
        holders = {w for mb in ledger.microbatches.values() for w in mb.owners.values()}
        in_flight = self.data_of(ledger)  # a rollback replays it; a plain restart reads afresh
        d.pool.cancel_all()
        d.guard.batch_over(ledger.batch)
        self.trust.batch_over()
        for m in ledger.microbatches:
            d.boundaries.drop(m)
        d.flight.next_microbatch = min(ledger.microbatches)
        decision = self.rollback.banned(worker, ledger.batch, in_flight)
        if decision.to is not None:
            reason += (
                f"; every stage rolled back to version {decision.to}, before its first unchecked result "
                "counted, and the undone batches are replayed on their kept data"
            )
        elif decision.outcome == TOO_LATE:
            reason += "; its unchecked results counted earlier than pipeline.rollback_batches: too late to roll back"
        if not self.rollback.rolling:  # a rollback mints the next batch itself
            d.remint(ledger.batch)
        self.trust.must_reset(sorted(holders - {worker}))
        if worker in d.workers.by_id:
            d.worker_left(worker)
        if not announced:
            d.on_ban(worker, reason)
