"""Where the pipeline meets its checks (:mod:`relay_server.trust`): the spot checks submitted
and cancelled through the task pool, a check's inputs read from the stored boundaries, and what
a ban does to the batch in flight (it restarts, so no lie is ever counted).

Owns the run's :class:`~relay_server.trust.checks.PipelineTrust`; the coordinator hands it the
few calls it needs (mint a batch again, a worker left, open the round when it may).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from relay_server.trust.checks import PipelineTrust, TrustDeps
from relay_server.trust.compare import tolerance
from relay_server.trust.task_kinds import StepLike

if TYPE_CHECKING:
    from relay_server.pipeline.boundaries import Boundaries
    from relay_server.pipeline.guard import PipelineGuard
    from relay_server.pipeline.in_flight import InFlight
    from relay_server.pipeline.ledger import Ledger
    from relay_server.pipeline.task_pool import TaskPool
    from relay_server.pipeline.workers import Workers
    from relay_server.trust.referee import Referee
    from toolkit.wire.compression import Codec


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
    referee: Referee | None = None


class TrustHooks:
    """The run's checks (:attr:`trust`) and what a ban does to the pipeline."""

    def __init__(self, share: float, precision: str, width: int, codec: Codec, deps: HookDeps) -> None:
        self.deps = deps
        self.trust = PipelineTrust(
            TrustDeps(
                share=share,
                tolerance=tolerance(precision, codec.name),
                width=width,
                codec=codec,
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

    def can_serve(self, stage: int, exclude: frozenset[str]) -> bool:
        """Whether some worker of ``stage``, outside ``exclude`` and not banned, serves it now."""
        return any(
            k == stage and w not in exclude and w not in self.trust.banned
            for w, (k, _) in self.deps.guard.serving_placement().items()
        )

    def inputs(self, step: StepLike) -> dict[str, bytes]:
        """The stored boundaries a check of ``step`` reads."""
        return {n: self.deps.boundaries.get(step.microbatch, n) for n in step.inputs()}

    def banned(self, worker: str, reason: str) -> None:
        """``worker`` lied (:class:`~relay_server.trust.checks.PipelineTrust` proved it): the open
        batch restarts -- every task cancelled, every boundary dropped, the same micro-batches
        queued again from their first stage -- so every result the liar delivered, and all that
        was computed from it, is recomputed by others before the round counts (the round cannot
        have opened: it waits for the batch's checks). Workers holding stage gradients of the
        batch drop them at their next request (``batch_restarted``). Then it leaves the pipeline,
        and the relay's moderation records the ban."""
        d = self.deps
        ledger = d.newest()
        holders = {w for mb in ledger.microbatches.values() for w in mb.owners.values()}
        d.pool.cancel_all()
        d.guard.batch_over(ledger.batch)
        self.trust.batch_over()
        for m in ledger.microbatches:
            d.boundaries.drop(m)
        d.flight.next_microbatch = min(ledger.microbatches)
        d.remint(ledger.batch)
        self.trust.must_reset(sorted(holders - {worker}))
        if worker in d.workers.by_id:
            d.worker_left(worker)
        d.on_ban(worker, reason)
