"""``CollaborativeOptimizer``: a training loop's ``zero_grad / backward / step``, collaboratively.

Epochs, DeDLOC style: every peer accumulates gradients at its own pace; once the collaboration
as a whole has ``target_batch`` samples, each peer uploads its accumulated gradient *sum*, the
relay averages them (weighted by samples) and applies the run's optimizer to the master
parameters, and every peer downloads the new parameters. Peers hold no optimizer state: the
backbone does (DESIGN.md s3), so joining late or after a crash just means downloading the
current parameters.

    opt = CollaborativeOptimizer(model, "http://relay:8750", batch_size_per_step=16)
    for batch in data:
        opt.zero_grad()
        model.loss(batch).backward()
        opt.step()                       # returns at once unless a round is due

What you will see in the log (``verbose=True``): "joined at step N" once; "round S: sent K
samples" when this peer contributes; "step S+1 loaded" when new parameters arrive; "behind:
resyncing" when this peer fell more than ``max_staleness`` versions behind (its unsent
gradient is discarded, by the rule in :mod:`toolkit.wire.protocol`).

``delayed_updates=True`` (DeDLOC's delayed parameter updates) runs the round in the background
thread while the next batches compute on the previous parameters: one step of staleness, which
the relay must allow (``run.max_staleness >= 1``). With it off, ``step()`` blocks for the round,
and training is exactly large-batch training.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from toolkit.accumulator import Accumulator, Upload
from toolkit.client import RelayClient
from toolkit.optim_base import CollabOptimizerBase
from toolkit.transfer import slice_part
from toolkit.worker import PeerWorker, shutdown
from toolkit.wire.compression import get_codec
from toolkit.errors import CollabError, ModelMismatch, RelayRejected, RelayUnreachable, RoundLost
from toolkit.wire.protocol import (PROTOCOL_VERSION, CollabState, DoneRequest, Heartbeat, JoinRequest,
                              RunInfo, TicketRequest)

log = logging.getLogger(__name__)

_NOT_RECEIVED = ("round_closed", "rate_limited")  # refusals before any byte of the gradient was used


@dataclass
class _Outcome:
    """What became of one upload: applied (``version`` is the new parameters' version, already in
    the public copy; or ``fate`` "applied": the relay moved past its round, but a slice of the
    result could not be downloaded yet), or not. ``fate`` then says whether the relay certainly
    never received it ("not_received"), cannot tell ("unknown"), or refused or partly used it
    ("dropped")."""

    upload: Upload
    version: int | None = None
    error: CollabError | None = None
    fate: str = ""


class CollaborativeOptimizer(CollabOptimizerBase):
    def __init__(self, model: torch.nn.Module, relay_url: str | None = None, *, batch_size_per_step: int,
                 client: RelayClient | None = None, peer_name: str = "peer", delayed_updates: bool = False,
                 device_info: dict[str, Any] | None = None, precision: str | None = None,
                 report_interval_s: float = 0.5, round_wait_s: float = 120.0, accumulate_on_host: bool = False,
                 verbose: bool = False) -> None:
        """
        Args:
            model: the model to train; its parameters must match the run's layout.
            relay_url: the relay's URL (or pass ``client``).
            batch_size_per_step: samples in one local micro-batch (``step(batch_size=...)`` overrides).
            delayed_updates: overlap rounds with computation (needs ``run.max_staleness >= 1``).
            device_info / precision: reported to the relay so the collaboration sees them.
            report_interval_s: minimum seconds between progress reports from ``step()``.
            round_wait_s: how long to wait for a round's result before re-syncing.
            accumulate_on_host: keep the gradient accumulator in host memory (pinned on CUDA),
                saving 4 bytes per parameter of device memory for a copy per micro-batch.
        """
        if client is None and relay_url is None:
            raise ValueError("pass relay_url or client")
        self.model = model
        self._named = list(model.named_parameters())
        super().__init__(p for _, p in self._named)  # param_groups' lr: the relay's (toolkit.optim_base)
        if verbose:
            logging.getLogger("toolkit").setLevel(logging.INFO)
        self.client = client or RelayClient(relay_url)  # type: ignore[arg-type]
        self.batch_size_per_step = batch_size_per_step
        self.delayed_updates, self.report_interval_s, self.round_wait_s = delayed_updates, report_interval_s, round_wait_s

        joined = self.client.join(JoinRequest(peer_name=peer_name, protocol=PROTOCOL_VERSION,
                                              device=device_info or {}, precision=precision))
        self.peer_id, self.run = joined.peer_id, joined.run
        self._check_layout(self.run)
        if delayed_updates and self.run.max_staleness < 1:
            log.warning("the run allows no staleness (max_staleness=0): delayed updates turned off")
            self.delayed_updates = False
        self.codec = get_codec(self.run.compression)
        self.accumulator = Accumulator([p for _, p in self._named], self.run.layout, self.run.num_params, self.codec,
                                       on_host=accumulate_on_host)
        # The parameters every peer shares (deltas apply to it), at version `_public_version`.
        # Written by downloads only: in the training thread, or in the worker while a round is
        # pending (never both); loaded into the model by the training thread.
        self._public = np.empty(self.run.num_params, dtype=np.float32)
        self._public_version = -1
        self._report_lock = threading.Lock()  # one progress report in flight at a time
        self.version = -1
        self.contributed_samples = 0
        self.samples_per_s = 0.0
        self.last_error: CollabError | None = None
        self.finished = False
        self.collab_state = joined.state
        self.last_report_at = 0.0
        self._last_step_end: float | None = None
        self._last_round_id = ""  # the round this peer last uploaded to
        self._pending: Future | None = None
        self._limbo: _Outcome | None = None  # a gradient whose round ended without applying it
        self.step_times: list[tuple[int, float]] = []  # (version, wall time loaded) for the panel
        self._load_latest()
        log.info("joined run %r as %s at step %d", self.run.run_name, self.peer_id[:8], self.version)
        self._worker = PeerWorker(weakref.ref(self), RelayClient(self.client.url, auth=self.client.session.auth),
                               self.run.heartbeat_interval_s)
        self._worker.start()
        self._finalizer = weakref.finalize(self, shutdown, self._worker, self.client, self.peer_id)

    # --- the public loop API ------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, batch_size: int | None = None,
             loss: float | torch.Tensor | None = None, skip: bool = False) -> Any:
        """Add this micro-batch's gradients to the local accumulator; take part in a round if due.

        Without ``loss``/``batch_size``, those noted since the last step (:meth:`note_loss`), else the
        closure's loss. A micro-batch whose gradients are not finite, or that the caller marks ``skip``
        (the fp16 loss scaler overflowed), is left out: only this peer's contribution is lost.
        """
        explicit = loss
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        started = time.monotonic()
        noted_loss, noted_n = self._take_notes()
        value = next((float(v) for v in (explicit, noted_loss, loss) if v is not None), None)
        self._finish_pending()
        if self.finished:
            return loss
        n = batch_size or noted_n or self.batch_size_per_step
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in self._named]
        if skip:
            log.info("skipping a micro-batch (loss scaling overflow): only this peer's contribution is lost")
        elif not math.isfinite(float(torch.stack(torch._foreach_norm(grads)).sum())):
            log.warning("skipping a micro-batch with non-finite gradients (loss scaling overflow?)")
        else:
            self.accumulator.add(grads, n, value, self.version)
            self._update_speed(n, started)
        self._sync()
        self._last_step_end = time.monotonic()
        return loss

    def close(self, finish_round_s: float = 10.0) -> None:
        """Leave the collaboration and stop the background thread (idempotent).

        A round still in flight (delayed updates) is waited for, up to ``finish_round_s``: its
        samples are already on the relay, and this peer's own count should say whether they
        counted. An interrupted cell never waits longer than that."""
        pending, self._pending = self._pending, None
        if pending is not None and self._finalizer.alive:
            try:
                self._settle(pending.result(timeout=finish_round_s))
            except (TimeoutError, CollabError) as exc:
                log.info("left with a round in flight (%s)", type(exc).__name__)
        self._finalizer()

    def __enter__(self) -> "CollaborativeOptimizer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ----------------------------------------------------------------------------
    def _check_layout(self, run: RunInfo) -> None:
        local = [(n, list(p.shape)) for n, p in self._named]
        remote = [(s.name, list(s.shape)) for s in run.layout]
        if local != remote:
            diff = next(((a, b) for a, b in zip(local, remote) if a != b), (len(local), len(remote)))
            raise ModelMismatch("model_mismatch", f"local model differs from run {run.run_name!r} at {diff}")

    def _update_speed(self, n: int, started: float) -> None:
        if self._last_step_end is not None:
            elapsed = max(1e-6, started - self._last_step_end)  # compute time only, not round waits
            rate = n / elapsed
            self.samples_per_s = rate if self.samples_per_s == 0 else 0.8 * self.samples_per_s + 0.2 * rate

    @property
    def samples(self) -> int:
        """Samples in the accumulator, not yet sent."""
        return self.accumulator.samples

    def heartbeat_message(self) -> Heartbeat:
        acc = self.accumulator
        with acc.lock:
            return Heartbeat(version=acc.version if acc.samples else max(self.version, 0),
                             samples=acc.samples, samples_per_s=self.samples_per_s)

    def report_progress(self, client: RelayClient | None = None) -> CollabState:
        """Send progress. Both threads report (the worker when the loop is busy), so the message is
        built and sent under one lock: reports reach the relay in the order they were made, and
        the relay never sees an older, smaller count after the one an upload relies on."""
        with self._report_lock:
            self.collab_state = (client or self.client).heartbeat(self.peer_id, self.heartbeat_message())
            self.last_report_at = time.monotonic()
            return self.collab_state

    def _sync(self) -> None:
        """Decide, from the latest collaboration state, whether to contribute or resync."""
        due = time.monotonic() - self.last_report_at >= self.report_interval_s
        expected = self.collab_state.samples_accumulated + self.samples >= self.collab_state.target_batch
        try:
            state = self.report_progress() if due or expected or self.collab_state.round or self._limbo else self.collab_state
            if state.finished:
                self.finished = True
                return
            self._settle_limbo(state)
            if self.samples and state.step - self.accumulator.version > self.run.max_staleness:
                self._discard(f"behind: gradient from step {self.accumulator.version}, relay at {state.step}; resyncing")
            behind = self.version < state.step - self.run.max_staleness
            if self._pending is None and (behind or (not self.samples and self.version < state.step)):
                self._load_latest()
            r = state.round
            if (r is not None and self.samples and r.round_id != self._last_round_id and self._pending is None
                    and 0 <= r.step - self.accumulator.version <= self.run.max_staleness):
                self._contribute(r.step, r.round_id)
        except (RelayUnreachable, RelayRejected) as exc:
            self._note_error(exc)

    def _contribute(self, round_step: int, round_id: str) -> None:
        state = self.report_progress()  # final counts; the relay caps our weight by this report
        if state.round is None or state.round.round_id != round_id:
            return
        meta, grad = self.accumulator.take(self.peer_id, round_step)
        try:
            upload = self.accumulator.encode(meta, grad, state.round.slices)
        except ValueError as exc:  # e.g. a sum that overflowed float16's range
            self._note_error(CollabError("encode_failed", f"round {round_step}: {exc}; {meta.samples} samples dropped"))
            return
        self._last_round_id = round_id
        if self.delayed_updates:
            self._pending = self._worker.submit(lambda client: self._round_job(client, upload, round_id))
        else:
            self._settle(self._round_job(self.client, upload, round_id))

    def _round_job(self, client: RelayClient, upload: Upload, round_id: str) -> _Outcome:
        """Upload, then wait for the version the round produces (in the worker thread with delayed
        updates). The relay publishes a version only once it is durable, so after a successful
        upload the gradient was applied iff the relay's step moves past ``meta.step``; if the
        step stays and the open round has another id, the round died (relay restart) and the
        gradient goes back into the accumulator."""
        meta = upload.meta
        if upload.parts:
            failed = self._upload_sliced(client, upload, round_id)
            if failed is not None:
                return failed
        else:
            try:
                client.upload_gradient(upload.tensors, meta, self.codec.name)
            except RelayRejected as exc:
                if exc.code in _NOT_RECEIVED:  # never received: reusable if still fresh enough
                    return _Outcome(upload, error=exc, fate="not_received")
                return _Outcome(upload, error=exc, fate="dropped")  # duplicate, stale, invalid or partly used
            except RelayUnreachable as exc:
                return _Outcome(upload, error=exc, fate="unknown")
        give_up = time.monotonic() + self.round_wait_s
        try:
            while time.monotonic() < give_up:
                try:
                    step = self._download(client, min_step=meta.step + 1, wait_s=5)
                except RelayUnreachable:  # the new version is there but a slice is not (yet)
                    if client.get_progress().step > meta.step:
                        return _Outcome(upload, fate="applied")  # loaded by the next sync
                    raise
                if step is not None:
                    return _Outcome(upload, version=step)
                progress = client.get_progress()
                if progress.step <= meta.step and (progress.round is None or progress.round.round_id != round_id):
                    return _Outcome(upload, error=RoundLost("round_lost", f"round {meta.step} ended without "
                                                            "a result (relay restarted?)"), fate="not_received")
        except RelayUnreachable as exc:
            return _Outcome(upload, error=exc, fate="unknown")
        return _Outcome(upload, error=RoundLost("round_timeout", f"no result for round {meta.step} after "
                                                f"{self.round_wait_s:.0f}s"), fate="unknown")

    def _upload_sliced(self, client: RelayClient, upload: Upload, round_id: str) -> _Outcome | None:
        """Ticket from the relay, each slice to its owner (in parallel), then "done". None when at
        least one slice was accepted: the gradient is in the round (part-wise), so the caller waits
        for the version; a slice that failed only loses that slice's contribution."""
        meta = upload.meta
        parts = [slice_part(plan, tensors, meta, self.codec.name, signed=client.signed) for plan, tensors in upload.parts]
        try:
            ticket = client.request_ticket(meta.step, self.peer_id, TicketRequest(
                round_id=round_id, version=meta.version, samples=meta.samples, loss_sum=meta.loss_sum,
                slices=[p.digest for p in parts]))
        except RelayRejected as exc:
            return _Outcome(upload, error=exc, fate="not_received" if exc.code in _NOT_RECEIVED else "dropped")
        except RelayUnreachable as exc:  # no ticket in hand: nothing was sent anywhere
            return _Outcome(upload, error=exc, fate="not_received")
        errors = client.upload_slices(meta.step, ticket, parts, keepalive=lambda: self.report_progress(client),
                                      keepalive_s=self.run.heartbeat_interval_s)
        delivered = [p.plan.start for p, e in zip(parts, errors) if e is None]
        failures = [e for e in errors if e is not None]
        partial = any(not (isinstance(e, RelayRejected) and e.code in _NOT_RECEIVED) for e in failures)
        try:
            client.report_done(meta.step, self.peer_id, DoneRequest(round_id=round_id, delivered=delivered,
                                                                     partial=partial))
        except (RelayRejected, RelayUnreachable) as exc:
            if not delivered:
                return _Outcome(upload, error=exc, fate="dropped" if partial else "not_received")
            log.info("round %d: the relay did not take our done (%s); the slices sent still count", meta.step, exc)
        if not delivered:
            return _Outcome(upload, error=failures[0], fate="dropped" if partial else "not_received")
        if failures:
            self._note_error(CollabError("slice_lost", f"round {meta.step}: {len(failures)} of {len(parts)} slices "
                                         f"not delivered ({failures[0]}); only their contribution is lost"))
        return None

    def _settle(self, outcome: _Outcome) -> None:
        """Apply a round's outcome in the training thread."""
        if outcome.error is not None:
            self._note_error(outcome.error)
        if outcome.version is not None or outcome.fate == "applied":
            self.contributed_samples += outcome.upload.meta.samples
            log.info("round %d: sent %d samples", outcome.upload.meta.step, outcome.upload.meta.samples)
            self._load()
        elif outcome.fate != "dropped":
            self._limbo = outcome  # decided by the next collaboration state we see

    def _settle_limbo(self, state: CollabState) -> None:
        """Put an unapplied gradient back into the accumulator when that cannot double-count it:
        a gradient the relay never received may join any round its version is fresh enough for;
        one whose fate is unknown only while the relay is still at the round's step (had it been
        applied, the relay would have moved on: it publishes a step only after persisting it)."""
        outcome, self._limbo = self._limbo, None
        if outcome is None:
            return
        meta = outcome.upload.meta
        fresh = state.step - meta.version <= self.run.max_staleness
        if fresh and (outcome.fate == "not_received" or state.step == meta.step):
            self.accumulator.restore(outcome.upload)
            self._last_round_id = ""
            log.info("round %d: kept %d samples for the next round", meta.step, meta.samples)
        else:
            log.info("round %d: dropped %d samples (their round is gone)", meta.step, meta.samples)

    def _finish_pending(self) -> None:
        if self._pending is not None and self._pending.done():
            pending, self._pending = self._pending, None
            self._settle(pending.result())

    def _discard(self, why: str) -> None:
        log.info(why)
        self.accumulator.discard()

    def _download(self, client: RelayClient, *, min_step: int = 0, wait_s: float = 0) -> int | None:
        """Bring the public copy to the relay's version >= ``min_step`` (a delta when possible)."""
        try:
            step = client.download_params(self._public, have=self._public_version, codec=self.codec,
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

    def _load(self) -> None:
        """Copy the public parameters into the model (training thread)."""
        step = self._public_version
        if step <= self.version:
            return
        flat = torch.from_numpy(self._public)
        for spec, (_, p) in zip(self.run.layout, self._named):
            p.data.copy_(flat[spec.offset:spec.offset + p.numel()].view_as(p))
        self.version = step
        self.step_times.append((step, time.time()))
        log.info("step %d loaded", step)

    def _note_error(self, exc: CollabError) -> None:
        self.last_error = exc
        log.warning("%s", exc)
