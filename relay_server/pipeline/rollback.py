"""A lie found after its batch was counted: every stage returns to the version before it.

Spot checks at the base share let a patient liar's lies through now and then, and a batch whose
checks all settled is counted. When the liar is caught later (a check, or the monitors making
every result of it a check), what it delivered unchecked in committed batches is in the model.
The relay cannot tell which of those results lied, so it undoes them all:

* **What is kept.** Per committed batch, which workers delivered a result no check covered
  (:meth:`PipelineRollback.unchecked`, fed by :mod:`relay_server.trust.checks`); per worker, the
  first committed batch holding one. The stages' state before every batch -- masters and
  optimizer state -- is the version the batch computed on, whose file each stage's store keeps
  for ``[pipeline] rollback_batches`` batches (:class:`~.stage_owners.StageOwners`: disk, no memory);
  and each of those batches' first-stage data (:attr:`PipelineRollback.inputs`,
  :mod:`.kept_inputs`: a few hundred bytes to a few hundred KB per batch, in memory).
* **On a ban** of worker ``w`` (:meth:`PipelineRollback.decide`): ``b0`` is the first committed
  batch holding an unchecked result of ``w``. Within the window, every stage's state at version
  ``b0`` is published as the next version (:meth:`~.stage_owners.StageOwners.rollback`; versions
  only move forward, as the data-parallel rollback's do), the batch in flight is dropped and the
  next one starts on that version with the micro-batch ids batch ``b0`` had. **The undone batches
  are replayed**: the first-stage tasks of their ids -- every committed batch ``b0 ..`` and the
  micro-batches of the batch in flight whose data had been read -- carry the data kept for them,
  so the run equals one process that trained on every batch once, each micro-batch with the data
  first read for it (an honest run). Only the computation is done twice, not lost. The batch in
  flight's micro-batches not read yet read fresh data, as every batch does. Older than the
  window, or with a stage's file pruned, nothing is undone nor replayed: the moderation log and
  ``/api/pipeline`` say ``too late``.

Owns its records and the rollbacks' history; reaches the stages, the publisher and the
coordinator's next batch only through :class:`RollbackDeps`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from relay_server.pipeline.batch_rounds import BatchOutcome
from relay_server.pipeline.kept_inputs import KeptInputs
from toolkit.wire.protocol import TrustRollback

if TYPE_CHECKING:
    from relay_server.backbone.slicing import Published

log = logging.getLogger(__name__)
TOO_LATE = "too late"
ROLLED_BACK = "rolled back"
MAX_HISTORY = 64


@dataclass(frozen=True)
class RollbackDeps:
    """The stages, the relay's publisher and the coordinator, as a rollback uses them."""

    step: Callable[[], int]
    """The published version (batches counted so far)."""
    holds: Callable[[int], bool]
    """Whether every stage's store still holds version ``b``'s state."""
    restore: Callable[[int], Awaitable[Published]]
    """Every stage's state at version ``b``, published as the next version (its manifest)."""
    publish: Callable[[BatchOutcome], Awaitable[None]]
    """The relay's after-publish sequence (the step with no contributions)."""
    batch_over: Callable[[], None]
    """The coordinator: drop the batch in flight, start the next on the new version."""
    restart_from: Callable[[int], None]
    """The coordinator: the next batch minted takes the micro-batch ids batch ``b`` had."""
    resume: Callable[[], None]
    """The coordinator: a rollback that failed restarts the batch in flight instead."""


@dataclass(frozen=True)
class Decision:
    """What a ban undoes: ``to`` (``b0``) or nothing (``outcome`` says why)."""

    to: int | None
    outcome: str


class PipelineRollback:
    def __init__(self, keep: int, deps: RollbackDeps) -> None:
        """``keep``: ``[pipeline] rollback_batches`` (0: never roll back)."""
        self.keep, self.deps = keep, deps
        self.open: dict[int, set[str]] = {}
        """batch in flight -> workers with an unchecked accepted result in it (not counted yet)."""
        self.first: dict[str, int] = {}
        """worker -> the first committed batch holding an unchecked result of it."""
        self.inputs = KeptInputs(keep)
        """The first-stage data of the committed batches in the window, and the replay (:mod:`.kept_inputs`)."""
        self.history: list[TrustRollback] = []
        self.running: asyncio.Task[None] | None = None
        self.dropping = False
        """While the batch in flight is dropped after a rollback (its close counts nothing)."""

    # --- records --------------------------------------------------------------------------------
    def unchecked(self, batch: int, worker: str) -> None:
        """``worker``'s accepted result of ``batch`` is covered by no check."""
        self.open.setdefault(batch, set()).add(worker)

    def restarted(self, batch: int) -> None:
        """``batch`` (and any after it) restarted: its results will never be counted."""
        self.open = {b: ws for b, ws in self.open.items() if b < batch}

    def committed(self, batch: int, data: dict[int, bytes] | None = None) -> None:
        """``batch``'s round published: its unchecked results are in the model now; ``data``
        (micro-batch id -> its first-stage data) is kept while a rollback can reach it."""
        for worker in self.open.pop(batch, set()):
            self.first.setdefault(worker, batch)
        self.inputs.committed(batch, data or {})

    # --- a ban ----------------------------------------------------------------------------------
    def decide(self, worker: str) -> Decision:
        """What banning ``worker`` undoes (:class:`Decision`)."""
        b0 = self.first.get(worker)
        if b0 is None:
            return Decision(None, "nothing counted unchecked")
        if self.running is not None:
            return Decision(None, "a rollback was in progress")
        if self.keep <= 0 or b0 < self.deps.step() - self.keep or not self.deps.holds(b0):
            return Decision(None, TOO_LATE)
        return Decision(b0, ROLLED_BACK)

    def banned(self, worker: str, batch: int, in_flight: dict[int, bytes] | None = None) -> Decision:
        """``worker`` was banned while ``batch`` was in flight (it restarts): roll back if its
        unchecked results were counted within the window, and replay the undone batches
        (``in_flight``: the first-stage data accepted in the batch in flight, replayed too). While
        a rollback runs (:attr:`rolling`) the coordinator mints no batch: the rollback's publish
        starts the next."""
        self.restarted(batch)
        decision = self.decide(worker)
        now = self.deps.step()
        if decision.to is None:
            if decision.outcome == TOO_LATE:
                log.warning(
                    "pipeline worker %s: its unchecked results since batch %d were counted more than "
                    "pipeline.rollback_batches = %d batches ago: too late to roll back, they stay in the model",
                    worker[:16],
                    self.first[worker],
                    self.keep,
                )
            self._record(TrustRollback(worker=worker, outcome=decision.outcome, at_version=now))
            return decision
        b0 = decision.to
        record = TrustRollback(
            worker=worker, outcome=ROLLED_BACK, at_version=now, to_version=b0, batches_undone=now - b0
        )
        log.warning(
            "pipeline worker %s was banned with unchecked results counted since batch %d: rolling every "
            "stage back to version %d (%d batches undone)",
            worker[:16],
            b0,
            b0,
            now - b0,
        )
        self.running = asyncio.get_running_loop().create_task(self._roll(record, b0, dict(in_flight or {})))
        return decision

    async def _roll(self, record: TrustRollback, b0: int, in_flight: dict[int, bytes]) -> None:
        d = self.deps
        try:
            published = await d.restore(b0)
            await d.publish(
                BatchOutcome(
                    published=published,
                    loss_sum=0.0,
                    samples=0,
                    elapsed_s=0.0,
                    grad_norm=0.0,
                    contributions={},
                    finalized_by="rollback",
                )
            )
        except Exception:  # a disk error: nothing is undone, the batch in flight restarts as after any ban
            log.exception("the pipeline's rollback to version %d failed; the batch in flight restarts", b0)
            self.running = None
            self._record(dataclasses.replace(record, outcome="failed"))
            d.resume()
            return
        self.running = None
        # every unchecked result of the undone batches is gone with them
        self.first = {w: b for w, b in self.first.items() if b < b0}
        self.open.clear()
        batches, microbatches = self.inputs.replay(b0, in_flight)  # before the next batch is minted
        self._record(
            dataclasses.replace(
                record, published_as=published.step, batches_replayed=batches, microbatches_replayed=microbatches
            )
        )
        log.warning(
            "pipeline rollback to version %d: %d undone batches (%d micro-batches) are replayed on their kept data",
            b0,
            batches,
            microbatches,
        )
        d.restart_from(b0)
        self.dropping = True  # the batch in flight closes uncounted
        try:
            d.batch_over()
        finally:
            self.dropping = False

    def _record(self, record: TrustRollback) -> None:
        self.history = (self.history + [record])[-MAX_HISTORY:]

    @property
    def rolling(self) -> bool:
        return self.running is not None
