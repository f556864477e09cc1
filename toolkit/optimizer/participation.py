"""Taking part in a round: upload this peer's gradient, wait for the version it produces, and
settle what became of it.

Kept apart from the loop API in :mod:`toolkit.optimizer.core` because it is the part that talks
to the relay on the round's behalf (in the training thread, or in the background worker with
delayed updates) and decides, for every way a round can end, whether the gradient counted, can go
back into the accumulator, or is lost. The rule it follows is :mod:`toolkit.wire.protocol`'s: a
gradient is put back only where that can never count it twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from toolkit.accumulator import Upload
from toolkit.client import RelayClient
from toolkit.errors import CollabError, RelayRejected, RelayUnreachable, RoundLost
from toolkit.transfer import slice_part
from toolkit.wire.protocol import CollabState, DoneRequest, GradientMeta, TicketRequest

if TYPE_CHECKING:
    from toolkit.optimizer.core import CollaborativeOptimizer
    from toolkit.peer_worker import PeerWorker

log = logging.getLogger("toolkit.optimizer")

NOT_RECEIVED = ("round_closed", "rate_limited")
"""Refusals that come before any byte of the gradient was used."""

STOP_WAIT_S = 8.0
"""How long leaving waits, after ``finish_round_s``, for a stopped round job to end its current
poll (a long poll lasts 5 s) so that the worker leaves the public parameters whole."""


@dataclass
class Outcome:
    """What became of one upload.

    Applied: ``version`` is the new parameters' version, already in the public copy; or ``fate``
    is "applied" (the relay moved past its round, but a slice of the result could not be
    downloaded yet). Otherwise ``fate`` says whether the relay certainly never received it
    ("not_received"), cannot tell ("unknown"), or refused or partly used it ("dropped").
    """

    upload: Upload
    version: int | None = None
    error: CollabError | None = None
    fate: str = ""


class RoundParticipation:
    """This peer's part in the rounds (module docstring), for one
    :class:`~toolkit.optimizer.CollaborativeOptimizer`, whose public fields it reads (the client,
    the run, the accumulator, ...).

    It owns the public copy of the parameters and the version loaded into the model (with the
    round counts that go with them), and the round in flight: the background job (``pending``),
    the gradient taken for an upload not ended yet (``sending``), one whose round ended without
    applying it (``limbo``), the round last uploaded to. The optimizer, local SGD and its overlap
    go through the methods below.
    """

    def __init__(
        self,
        opt: CollaborativeOptimizer,
        params: list[torch.nn.Parameter],
        report_lock: threading.Lock,
        worker: PeerWorker,
    ) -> None:
        """``report_lock``: the lock the optimizer builds its reports under, so that a report
        never sees a gradient neither in the accumulator nor ``sending``; ``worker``: the thread
        background rounds run on."""
        self.opt = opt
        self.params = params
        self._report_lock = report_lock
        self._worker = worker
        # The parameters every peer shares (deltas apply to it), at version `_public_version`.
        # Written by downloads only: in the training thread, or in the worker while a round is
        # pending (never both); loaded into the model by the training thread.
        self._public = np.empty(opt.run.num_params, dtype=np.float32)
        self._public_version = -1
        self.version = -1  # loaded into the model
        self.contributed_samples = 0
        # The step of the round that last applied this peer's samples: the version it produced
        # may already be older than ``version`` (a download returns the newest one).
        self.last_applied_round = -1
        self.step_times: list[tuple[int, float]] = []  # (version, wall time loaded) for the panel
        self._last_round_id = ""  # the round this peer last uploaded to
        self._pending: Future | None = None
        self._limbo: Outcome | None = None  # a gradient whose round ended without applying it
        self._sending: GradientMeta | None = None  # taken from the accumulator, upload not ended yet

    # --- what the others may look at ---------------------------------------------------------------
    @property
    def public(self) -> np.ndarray:
        """The public copy of the parameters (flat float32, version :attr:`public_version`); read only."""
        return self._public

    @property
    def public_version(self) -> int:
        """The public copy's version; -1 when it is missing or may be half-written."""
        return self._public_version

    @property
    def pending(self) -> Future | None:
        """The round job in the background worker, until :meth:`finish_pending` settles it."""
        return self._pending

    @property
    def sending(self) -> GradientMeta | None:
        """The meta of a gradient taken from the accumulator whose upload has not ended (reports count it)."""
        return self._sending

    @property
    def limbo(self) -> Outcome | None:
        """A gradient whose round ended without applying it, decided by the next state seen."""
        return self._limbo

    def new_round(self, round_id: str) -> bool:
        """Whether ``round_id`` is not the round this peer last uploaded to."""
        return round_id != self._last_round_id

    @property
    def stopping(self) -> threading.Event:
        """Set when the optimizer closes: background waits end at their next poll."""
        return self._worker.stopping

    def submit(self, job: Callable[[RelayClient], Outcome | None]) -> None:
        """Run a round job in the background worker; :meth:`finish_pending` settles its outcome."""
        self._pending = self._worker.submit(job)

    def take_pending(self) -> Future | None:
        """The job in the background, handed over to a caller that settles it (closing, the run's end)."""
        pending, self._pending = self._pending, None
        return pending

    def finish_pending_before_leaving(self, finish_round_s: float) -> Future | None:
        """The optimizer is closing: the round job in the background, if any, is waited for up to
        ``finish_round_s`` and settled (its samples are already on the relay, and this peer's own
        count should say whether they counted); past that the worker is told to stop, and the job
        waited for up to :data:`STOP_WAIT_S` more (it ends at its next poll). Returns the job, done
        or not, so the caller can tell whether the public copy may be half-written."""
        pending = self.take_pending()
        if pending is None:
            return None
        try:
            self.settle(pending.result(timeout=finish_round_s))
        except TimeoutError:
            self._worker.stopping.set()  # the round's wait ends at its next poll, the public copy whole
            try:
                self.settle(pending.result(timeout=STOP_WAIT_S))
            except (TimeoutError, CollabError) as exc:
                log.info("left with a round in flight (%s)", type(exc).__name__)
        except CollabError as exc:
            log.info("left with a round in flight (%s)", type(exc).__name__)
        return pending

    def drop_limbo(self) -> None:
        """Forget a gradient whose round ended without it (the caller discards what it holds)."""
        self._limbo = None

    def contribute(self, round_step: int, round_id: str) -> None:
        """Send the accumulated gradient to the open round ``round_id`` (in the background with
        delayed updates)."""
        upload = self.take_upload(self.opt.client, round_step, round_id)
        if upload is None:
            return
        if self.opt.delayed_updates:
            self._pending = self._worker.submit(lambda client: self.round_job(client, upload, round_id))
        else:
            self.settle(self.round_job(self.opt.client, upload, round_id))

    def take_upload(self, client: RelayClient, round_step: int, round_id: str) -> Upload | None:
        """The accumulated gradient, encoded for the open round ``round_id``, after a last progress
        report (the relay caps our weight by it); None if that round is gone or encoding failed."""
        state = self.opt.report_progress(client)
        if state.round is None or state.round.round_id != round_id:
            return None
        with self._report_lock:  # a report between the take and the upload must still say what we send
            meta, grad = self.opt.accumulator.take(self.opt.peer_id, round_step)
            self._sending = meta
        try:
            upload = self.opt.accumulator.encode(meta, grad, state.round.slices)
        except ValueError as exc:  # e.g. a sum that overflowed float16's range
            self._sent()
            self.opt.note_error(
                CollabError("encode_failed", f"round {round_step}: {exc}; {meta.samples} samples dropped")
            )
            return None
        self._last_round_id = round_id
        return upload

    def round_job(self, client: RelayClient, upload: Upload, round_id: str) -> Outcome:
        """Upload, then wait for the version the round produces (in the worker thread with delayed
        updates).

        The relay publishes a version only once it is durable, so after a successful upload the
        gradient was applied iff the relay's step moves past ``meta.step``; if the step stays and
        the open round has another id, the round died (relay restart) and the gradient goes back
        into the accumulator.
        """
        meta = upload.meta
        try:
            failed = self._upload(client, upload, round_id)
        finally:
            self._sent()
        if failed is not None:
            return failed
        give_up = time.monotonic() + self.opt.round_wait_s
        try:
            while time.monotonic() < give_up and not self._worker.stopping.is_set():
                try:
                    step = self.download(client, min_step=meta.step + 1, wait_s=5)
                except RelayUnreachable:  # the new version is there but a slice is not (yet)
                    if client.get_progress().step > meta.step:
                        return Outcome(upload, fate="applied")  # loaded by the next sync
                    raise
                if step is not None:
                    return Outcome(upload, version=step)
                progress = client.get_progress()
                if progress.step <= meta.step and (progress.round is None or progress.round.round_id != round_id):
                    lost = RoundLost("round_lost", f"round {meta.step} ended without a result (relay restarted?)")
                    return Outcome(upload, error=lost, fate="not_received")
        except RelayUnreachable as exc:
            return Outcome(upload, error=exc, fate="unknown")
        if self._worker.stopping.is_set():  # close(): a background wait ends here, between downloads
            return Outcome(upload, error=RoundLost("closing", f"left before round {meta.step} ended"), fate="unknown")
        timeout = RoundLost("round_timeout", f"no result for round {meta.step} after {self.opt.round_wait_s:.0f}s")
        return Outcome(upload, error=timeout, fate="unknown")

    def _upload(self, client: RelayClient, upload: Upload, round_id: str) -> Outcome | None:
        """Send the gradient, whole or sliced; None when (part of) it reached the round."""
        if upload.parts:
            return self._upload_sliced(client, upload, round_id)
        try:
            client.upload_gradient(upload.tensors, upload.meta, self.opt.codec.name)
        except RelayRejected as exc:
            if exc.code in NOT_RECEIVED:  # never received: reusable if still fresh enough
                return Outcome(upload, error=exc, fate="not_received")
            return Outcome(upload, error=exc, fate="dropped")  # duplicate, stale, invalid or partly used
        except RelayUnreachable as exc:
            return Outcome(upload, error=exc, fate="unknown")
        return None

    def _sent(self) -> None:
        """The upload ended (the relay credited it, refused it, or never saw it): reports say what
        the accumulator holds again."""
        with self._report_lock:
            self._sending = None

    def _upload_sliced(self, client: RelayClient, upload: Upload, round_id: str) -> Outcome | None:
        """Ticket from the relay, each slice to its owner (in parallel), then "done".

        None when at least one slice was accepted: the gradient is in the round (part-wise), so
        the caller waits for the version; a slice that failed only loses that slice's
        contribution.
        """
        meta = upload.meta
        parts = [
            slice_part(plan, tensors, meta, self.opt.codec.name, signed=client.signed)
            for plan, tensors in upload.parts
        ]
        try:
            ticket = client.request_ticket(
                meta.step,
                self.opt.peer_id,
                TicketRequest(
                    round_id=round_id,
                    version=meta.version,
                    samples=meta.samples,
                    loss_sum=meta.loss_sum,
                    slices=[p.digest for p in parts],
                ),
            )
        except RelayRejected as exc:
            return Outcome(upload, error=exc, fate="not_received" if exc.code in NOT_RECEIVED else "dropped")
        except RelayUnreachable as exc:  # no ticket in hand: nothing was sent anywhere
            return Outcome(upload, error=exc, fate="not_received")
        errors = client.params.upload_slices(
            meta.step,
            ticket,
            parts,
            keepalive=lambda: self.opt.report_progress(client),
            keepalive_s=self.opt.run.heartbeat_interval_s,
        )
        delivered = [p.plan.start for p, e in zip(parts, errors) if e is None]
        failures = [e for e in errors if e is not None]
        partial = any(not (isinstance(e, RelayRejected) and e.code in NOT_RECEIVED) for e in failures)
        try:
            client.report_done(
                meta.step, self.opt.peer_id, DoneRequest(round_id=round_id, delivered=delivered, partial=partial)
            )
        except (RelayRejected, RelayUnreachable) as exc:
            if not delivered:
                return Outcome(upload, error=exc, fate="dropped" if partial else "not_received")
            log.info("round %d: the relay did not take our done (%s); the slices sent still count", meta.step, exc)
        if not delivered:
            return Outcome(upload, error=failures[0], fate="dropped" if partial else "not_received")
        if failures:
            self.opt.note_error(
                CollabError(
                    "slice_lost",
                    f"round {meta.step}: {len(failures)} of {len(parts)} slices "
                    f"not delivered ({failures[0]}); only their contribution is lost",
                )
            )
        return None

    def settle(self, outcome: Outcome | None) -> None:
        """Apply a round's outcome in the training thread (None: a background job that ended
        before uploading anything, see :meth:`OverlappedRound.outer_job
        <toolkit.optimizer.overlap.OverlappedRound.outer_job>`)."""
        if outcome is None:
            return
        if outcome.error is not None:
            self.opt.note_error(outcome.error)
        if outcome.version is not None or outcome.fate == "applied":
            self.contributed_samples += outcome.upload.meta.samples
            self.last_applied_round = outcome.upload.meta.step
            log.info("round %d: sent %d samples", outcome.upload.meta.step, outcome.upload.meta.samples)
            self.load()
        elif outcome.fate != "dropped":
            self._limbo = outcome  # decided by the next collaboration state we see

    def settle_limbo(self, state: CollabState) -> None:
        """Put an unapplied gradient back into the accumulator when that cannot double-count it.

        A gradient the relay never received may join any round its version is fresh enough for;
        one whose fate is unknown only while the relay is still at the round's step (had it been
        applied, the relay would have moved on: it publishes a step only after persisting it).
        """
        outcome, self._limbo = self._limbo, None
        if outcome is None:
            return
        meta = outcome.upload.meta
        fresh = state.step - meta.version <= self.opt.run.max_staleness
        if fresh and (outcome.fate == "not_received" or state.step == meta.step):
            self.opt.accumulator.restore(outcome.upload)
            self._last_round_id = ""
            log.debug("round %d: kept %d samples for the next round", meta.step, meta.samples)
        else:
            log.info("round %d: dropped %d samples (their round is gone)", meta.step, meta.samples)

    def finish_pending(self) -> None:
        """Settle the background round, if it ended (delayed updates)."""
        if self._pending is not None and self._pending.done():
            pending, self._pending = self._pending, None
            self.settle(pending.result())

    def discard(self, why: str) -> None:
        log.info(why)
        self.opt.accumulator.discard()

    def start_over(self, why: str) -> None:
        """After a rejoin (a relay that lost its state): what this peer holds was computed on
        parameters the relay may no longer have and reported under the lost id, so the
        accumulator and any unapplied gradient are dropped, and the public copy is marked missing:
        the next download is a full one."""
        self._limbo = None
        self.discard(why)
        self._public_version = self.version = -1

    def download(self, client: RelayClient, *, min_step: int = 0, wait_s: float = 0) -> int | None:
        """Bring the public copy to the relay's version >= ``min_step`` (a delta when possible)."""
        try:
            step = client.params.download_params(
                self._public,
                have=self._public_version,
                codec=self.opt.download_codec,
                min_step=min_step,
                wait_s=wait_s,
                peer_id=self.opt.peer_id,
            )
        except BaseException:
            self._public_version = -1  # possibly half-overwritten: the next download is a full one
            raise
        if step is not None:
            self._public_version = step
        return step

    def load_latest(self) -> None:
        self.download(self.opt.client)
        self.load()

    def load(self, *, force: bool = False) -> None:
        """Copy the public parameters into the model (training thread) if they are newer, or
        ``force``: again. In local SGD with overlap a round's snapshot turns the copy into the
        rebase (:meth:`OverlappedRound.rebase_carry <toolkit.optimizer.overlap.OverlappedRound.rebase_carry>`)."""
        step = self._public_version
        if step < 0 or (step <= self.version and not force):
            return
        params = self.params
        carry = self.opt.local_sgd.rebase_carry(params) if self.opt.local_sgd is not None else None
        flat = torch.from_numpy(self._public)
        with torch.no_grad():
            for spec, p in zip(self.opt.run.layout, params):
                p.copy_(flat[spec.offset : spec.offset + p.numel()].view_as(p))
            if carry is not None:
                torch._foreach_sub_(params, carry)  # carry = snapshot - local: theta + (local - snapshot)
        self.version = step
        self.step_times.append((step, time.time()))
        if self.opt.local_sgd is not None:
            self.opt.local_sgd.loaded(step, rebased=carry is not None)
        log.info("step %d loaded%s", step, " (rebased)" if carry is not None else "")
