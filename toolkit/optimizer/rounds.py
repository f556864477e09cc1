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

from toolkit.accumulator import Accumulator, Upload
from toolkit.client import RelayClient
from toolkit.errors import CollabError, RelayRejected, RelayUnreachable, RoundLost, handled_by_peer, volunteer_line
from toolkit.transfer import slice_part
from toolkit.wire.compression import Codec
from toolkit.wire.protocol import CollabState, DoneRequest, GradientMeta, RunInfo, TicketRequest

if TYPE_CHECKING:
    from toolkit.optimizer.local_sgd import LocalSgd
    from toolkit.worker import PeerWorker

log = logging.getLogger("toolkit.optimizer")

NOT_RECEIVED = ("round_closed", "rate_limited")
"""Refusals that come before any byte of the gradient was used."""


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
    """The round half of :class:`~toolkit.optimizer.CollaborativeOptimizer` (see the module
    docstring); the attributes below are set by the optimizer's constructor."""

    client: RelayClient
    run: RunInfo
    peer_id: str
    codec: Codec
    download_codec: Codec
    accumulator: Accumulator
    delayed_updates: bool
    round_wait_s: float
    version: int
    contributed_samples: int
    last_error: CollabError | None
    step_times: list[tuple[int, float]]
    _named: list[tuple[str, torch.nn.Parameter]]
    _public: np.ndarray
    _public_version: int
    _pending: Future | None
    _limbo: Outcome | None
    _sending: GradientMeta | None  # taken from the accumulator, upload not ended yet
    _last_round_id: str
    _report_lock: threading.Lock
    _worker: PeerWorker
    local_sgd: LocalSgd | None
    report_progress: Callable[..., CollabState]

    def _contribute(self, round_step: int, round_id: str) -> None:
        """Send the accumulated gradient to the open round ``round_id`` (in the background with
        delayed updates)."""
        upload = self._take_upload(self.client, round_step, round_id)
        if upload is None:
            return
        if self.delayed_updates:
            self._pending = self._worker.submit(lambda client: self._round_job(client, upload, round_id))
        else:
            self._settle(self._round_job(self.client, upload, round_id))

    def _take_upload(self, client: RelayClient, round_step: int, round_id: str) -> Upload | None:
        """The accumulated gradient, encoded for the open round ``round_id``, after a last progress
        report (the relay caps our weight by it); None if that round is gone or encoding failed."""
        state = self.report_progress(client)
        if state.round is None or state.round.round_id != round_id:
            return None
        with self._report_lock:  # a report between the take and the upload must still say what we send
            meta, grad = self.accumulator.take(self.peer_id, round_step)
            self._sending = meta
        try:
            upload = self.accumulator.encode(meta, grad, state.round.slices)
        except ValueError as exc:  # e.g. a sum that overflowed float16's range
            self._sent()
            self._note_error(CollabError("encode_failed", f"round {round_step}: {exc}; {meta.samples} samples dropped"))
            return None
        self._last_round_id = round_id
        return upload

    def _round_job(self, client: RelayClient, upload: Upload, round_id: str) -> Outcome:
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
        give_up = time.monotonic() + self.round_wait_s
        try:
            while time.monotonic() < give_up and not self._worker.stopping.is_set():
                try:
                    step = self._download(client, min_step=meta.step + 1, wait_s=5)
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
        timeout = RoundLost("round_timeout", f"no result for round {meta.step} after {self.round_wait_s:.0f}s")
        return Outcome(upload, error=timeout, fate="unknown")

    def _upload(self, client: RelayClient, upload: Upload, round_id: str) -> Outcome | None:
        """Send the gradient, whole or sliced; None when (part of) it reached the round."""
        if upload.parts:
            return self._upload_sliced(client, upload, round_id)
        try:
            client.upload_gradient(upload.tensors, upload.meta, self.codec.name)
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
        parts = [slice_part(plan, tensors, meta, self.codec.name, signed=client.signed)
                 for plan, tensors in upload.parts]
        try:
            ticket = client.request_ticket(meta.step, self.peer_id, TicketRequest(
                round_id=round_id, version=meta.version, samples=meta.samples, loss_sum=meta.loss_sum,
                slices=[p.digest for p in parts]))
        except RelayRejected as exc:
            return Outcome(upload, error=exc, fate="not_received" if exc.code in NOT_RECEIVED else "dropped")
        except RelayUnreachable as exc:  # no ticket in hand: nothing was sent anywhere
            return Outcome(upload, error=exc, fate="not_received")
        errors = client.upload_slices(meta.step, ticket, parts, keepalive=lambda: self.report_progress(client),
                                      keepalive_s=self.run.heartbeat_interval_s)
        delivered = [p.plan.start for p, e in zip(parts, errors) if e is None]
        failures = [e for e in errors if e is not None]
        partial = any(not (isinstance(e, RelayRejected) and e.code in NOT_RECEIVED) for e in failures)
        try:
            client.report_done(meta.step, self.peer_id, DoneRequest(round_id=round_id, delivered=delivered,
                                                                     partial=partial))
        except (RelayRejected, RelayUnreachable) as exc:
            if not delivered:
                return Outcome(upload, error=exc, fate="dropped" if partial else "not_received")
            log.info("round %d: the relay did not take our done (%s); the slices sent still count", meta.step, exc)
        if not delivered:
            return Outcome(upload, error=failures[0], fate="dropped" if partial else "not_received")
        if failures:
            self._note_error(CollabError("slice_lost", f"round {meta.step}: {len(failures)} of {len(parts)} slices "
                                         f"not delivered ({failures[0]}); only their contribution is lost"))
        return None

    def _settle(self, outcome: Outcome | None) -> None:
        """Apply a round's outcome in the training thread (None: a background job that ended
        before uploading anything, see :meth:`LocalSgd.outer_job`)."""
        if outcome is None:
            return
        if outcome.error is not None:
            self._note_error(outcome.error)
        if outcome.version is not None or outcome.fate == "applied":
            self.contributed_samples += outcome.upload.meta.samples
            self.last_applied_round = outcome.upload.meta.step
            log.info("round %d: sent %d samples", outcome.upload.meta.step, outcome.upload.meta.samples)
            self._load()
        elif outcome.fate != "dropped":
            self._limbo = outcome  # decided by the next collaboration state we see

    def _settle_limbo(self, state: CollabState) -> None:
        """Put an unapplied gradient back into the accumulator when that cannot double-count it.

        A gradient the relay never received may join any round its version is fresh enough for;
        one whose fate is unknown only while the relay is still at the round's step (had it been
        applied, the relay would have moved on: it publishes a step only after persisting it).
        """
        outcome, self._limbo = self._limbo, None
        if outcome is None:
            return
        meta = outcome.upload.meta
        fresh = state.step - meta.version <= self.run.max_staleness
        if fresh and (outcome.fate == "not_received" or state.step == meta.step):
            self.accumulator.restore(outcome.upload)
            self._last_round_id = ""
            log.debug("round %d: kept %d samples for the next round", meta.step, meta.samples)
        else:
            log.info("round %d: dropped %d samples (their round is gone)", meta.step, meta.samples)

    def _finish_pending(self) -> None:
        """Settle the background round, if it ended (delayed updates)."""
        if self._pending is not None and self._pending.done():
            pending, self._pending = self._pending, None
            self._settle(pending.result())

    def _discard(self, why: str) -> None:
        log.info(why)
        self.accumulator.discard()

    def _download(self, client: RelayClient, *, min_step: int = 0, wait_s: float = 0) -> int | None:
        """Bring the public copy to the relay's version >= ``min_step`` (a delta when possible)."""
        try:
            step = client.download_params(self._public, have=self._public_version, codec=self.download_codec,
                                          min_step=min_step, wait_s=wait_s, peer_id=self.peer_id)
        except BaseException:
            self._public_version = -1  # possibly half-overwritten: the next download is a full one
            raise
        if step is not None:
            self._public_version = step
        return step

    def _load_latest(self) -> None:
        self._download(self.client)
        self._load()

    def _load(self, *, force: bool = False) -> None:
        """Copy the public parameters into the model (training thread) if they are newer, or
        ``force``: again. In local SGD with overlap a round's snapshot turns the copy into the
        rebase (:meth:`LocalSgd.rebase_carry <toolkit.optimizer.local_sgd.LocalSgd.rebase_carry>`)."""
        step = self._public_version
        if step < 0 or (step <= self.version and not force):
            return
        params = [p for _, p in self._named]
        carry = self.local_sgd.rebase_carry(params) if self.local_sgd is not None else None
        flat = torch.from_numpy(self._public)
        with torch.no_grad():
            for spec, p in zip(self.run.layout, params):
                p.copy_(flat[spec.offset:spec.offset + p.numel()].view_as(p))
            if carry is not None:
                torch._foreach_sub_(params, carry)  # carry = snapshot - local: theta + (local - snapshot)
        self.version = step
        self.step_times.append((step, time.time()))
        if self.local_sgd is not None:
            self.local_sgd.loaded(step, rebased=carry is not None)
        log.info("step %d loaded%s", step, " (rebased)" if carry is not None else "")

    def _note_error(self, exc: CollabError) -> None:
        """What the peer recovers from by itself (:data:`toolkit.errors.HANDLED_BY_PEER`: the
        round it sent to had closed, ...) goes to the debug log only; anything else to the panel
        (``last_error``) and the log, in one line saying what to do."""
        if handled_by_peer(exc):
            log.debug("handled by this peer: %s", exc)
            return
        self.last_error = exc
        log.warning("%s", volunteer_line(exc))
