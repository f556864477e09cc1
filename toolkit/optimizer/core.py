"""The loop API of :class:`CollaborativeOptimizer`: join, ``zero_grad / backward / step``, report
progress, decide when to contribute or resync, leave. Taking part in a round is
:mod:`toolkit.optimizer.participation`."""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from toolkit.accumulator import Accumulator
from toolkit.client import RelayClient
from toolkit.errors import (
    CollabError,
    ModelMismatch,
    PrecisionUnsupported,
    RelayRejected,
    RelayUnreachable,
    handled_by_peer,
    volunteer_line,
)
from toolkit.optim_base import CollabOptimizerBase
from toolkit.optimizer.local_sgd import LocalSgd
from toolkit.optimizer.own_loop import until_finished
from toolkit.optimizer.participation import RoundParticipation
from toolkit.peer_worker import PeerWorker, shutdown
from toolkit.run_membership import Membership
from toolkit.wire.compression import run_codecs
from toolkit.wire.protocol import PROTOCOL_VERSION, CollabState, Heartbeat, JoinRequest, RunInfo

log = logging.getLogger("toolkit.optimizer")
HOLD_MAX_S = 30.0
"""The longest :meth:`CollaborativeOptimizer.hold` waits for a round to take this peer's samples."""
HOLD_POLL_S = 0.05


class CollaborativeOptimizer(CollabOptimizerBase):
    """A ``torch.optim.Optimizer`` whose ``step()`` trains with every other peer of the run
    (:mod:`toolkit.optimizer`).

    Made of collaborators that each own their state: :attr:`rounds` (:class:`RoundParticipation`:
    the public copy of the parameters, the version loaded, the round in flight) and, in a local
    SGD run, :attr:`local_sgd` (:class:`LocalSgd`: the inner loop, and its overlapped outer round).
    This class owns the loop's side: the accumulator, the progress reports and what they last
    said, the background worker and leaving."""

    def __init__(
        self,
        model: torch.nn.Module,
        relay_url: str | None = None,
        *,
        batch_size_per_step: int,
        client: RelayClient | None = None,
        peer_name: str = "peer",
        delayed_updates: bool = False,
        device_info: dict[str, Any] | None = None,
        precision: str | None = None,
        scaler: Any = None,
        report_interval_s: float = 0.5,
        round_wait_s: float = 120.0,
        accumulate_on_host: bool = False,
        verbose: bool = False,
    ) -> None:
        """
        Args:
            model: the model to train; its parameters must match the run's layout
                (:func:`toolkit.run_model` builds the run's).
            relay_url: the relay's URL (or pass ``client``).
            batch_size_per_step: samples in one local micro-batch (``step(batch_size=...)`` overrides).
            delayed_updates: overlap rounds with computation (needs ``run.max_staleness >= 1``).
            device_info: reported to the relay so the collaboration sees it.
            precision: the policy this peer trains in, reported to the relay; by default the one
                the run pins (if any). A run that pins another refuses to let this peer join.
            scaler: the loop's loss scaler (a ``GradScaler``), when the loop backpropagates a
                scaled loss through losses noted on this optimizer (:mod:`toolkit.optim_base`);
                the integrations find the frameworks' own.
            report_interval_s: minimum seconds between progress reports from ``step()``.
            round_wait_s: how long to wait for a round's result before re-syncing.
            accumulate_on_host: keep the gradient accumulator in host memory (pinned on CUDA),
                saving 4 bytes per parameter of device memory for a copy per micro-batch.
        """
        if client is None and relay_url is None:
            raise ValueError("pass relay_url or client")
        self.model = model
        self._named = list(model.named_parameters())
        # param_groups' lr: the relay's (toolkit.optim_base)
        super().__init__((p for _, p in self._named), grad_unit=batch_size_per_step, scaler=scaler)
        if verbose:
            logging.getLogger("toolkit").setLevel(logging.INFO)
        self.client = client or RelayClient(relay_url)  # type: ignore[arg-type]
        self.batch_size_per_step = batch_size_per_step
        self.delayed_updates = delayed_updates
        self.report_interval_s = report_interval_s
        self.round_wait_s = round_wait_s
        pinned = self.client.get_run().precision
        if precision is None:
            precision = pinned  # the run's pin, if any, as join() takes it
        elif pinned and precision != pinned:
            raise PrecisionUnsupported(
                "precision_mismatch",
                f"this run trains in {pinned} only; the optimizer was asked for {precision}",
                f"Pass precision={pinned!r}, or leave precision out: the optimizer takes the run's pin by itself.",
            )
        # this peer's place in the run, as every role's (toolkit.run_membership); reports are handed to
        # it one by one, so it holds no reference to this optimizer (the finalizer below works)
        self.membership = Membership(
            self.client,
            JoinRequest(peer_name=peer_name, protocol=PROTOCOL_VERSION, device=device_info or {}, precision=precision),
            what="trainer",
        )
        joined = self.membership.join()
        self.run = joined.run
        self._rejoins_seen = 0
        self.precision = precision
        self._check_layout(self.run)
        if delayed_updates and self.run.max_staleness < 1:
            log.warning("the run allows no staleness (max_staleness=0): delayed updates turned off")
            self.delayed_updates = False
        codecs = run_codecs(self.run.compression, self.run.download_compression)
        self.codec, self.download_codec = codecs.up, codecs.down  # of this peer's uploads, of the deltas
        self.accumulator = Accumulator(
            [p for _, p in self._named], self.run.layout, self.run.num_params, self.codec, on_host=accumulate_on_host
        )
        self._report_lock = threading.Lock()  # one progress report in flight at a time
        self.dropped_stale_samples = 0  # handed to contribute() computed on too old a version
        self._reported_samples = 0  # this peer's samples in the relay's last answer (see room())
        self.samples_per_s = 0.0
        self.last_error: CollabError | None = None
        self.finished = joined.state.finished  # joined after the last step: the loop has nothing to do
        self.collab_state = joined.state
        self.last_report_at = 0.0
        self._last_step_end: float | None = None
        self._warned_no_loss = False
        self.local_sgd: LocalSgd | None = None
        self._worker = PeerWorker(
            weakref.ref(self),
            RelayClient(self.client.url, auth=self.client.session.auth),
            self.run.heartbeat_interval_s,
        )  # started once the peer is set up
        self.rounds = RoundParticipation(self, [p for _, p in self._named], self._report_lock, self._worker)
        self.rounds.load_latest()
        # run.mode = "local_sgd": step() runs the inner optimizer and an outer round per budget
        self.local_sgd = LocalSgd(self, self.run.local_sgd) if self.run.local_sgd else None
        if self.local_sgd is not None:
            self.delayed_updates = self.local_sgd.overlap  # rounds run in the background iff they overlap compute
            self.use_local_lr(self.local_sgd.lr_now())
        log.info("joined run %r as %s at step %d", self.run.run_name, self.peer_id[:8], self.version)
        self._worker.start()
        self._finalizer = weakref.finalize(self, shutdown, self._worker, self.client, self.membership)

    # --- the public loop API ------------------------------------------------------------------
    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        batch_size: int | None = None,
        loss: float | torch.Tensor | None = None,
        skip: bool = False,
    ) -> Any:
        """Add this step's gradients to the local accumulator; take part in a round if due.

        What the gradients are the sum over: the micro-batches noted since the last step
        (:meth:`note_loss`, which the integrations call), or else ``batch_size`` samples
        (default ``batch_size_per_step``) whose mean gradient ``.grad`` holds, as in a plain
        loop. The charted loss is ``loss``, else the noted losses' mean, else the closure's.
        A step whose gradients are not finite, or that the caller marks ``skip`` (the fp16 loss
        scaler overflowed), is left out: only this peer's contribution is lost.
        """
        explicit = loss
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        started = time.monotonic()
        noted_loss, noted_n, mode = self._take_notes()
        if mode == "sum" and batch_size is not None and batch_size != noted_n:
            raise ValueError(
                f"step(batch_size={batch_size}) but the noted micro-batches hold {noted_n} samples: "
                "pass no batch_size when the loop notes its losses"
            )
        value = next((float(v) for v in (explicit, noted_loss, loss) if v is not None), None)
        n = batch_size or noted_n or self.batch_size_per_step
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in self._named]
        if value is None and not self._warned_no_loss:
            self._warned_no_loss = True
            log.warning(
                "step() got no loss: pass step(loss=..., batch_size=...) or note it (toolkit.integrations."
                "watch_loss); the relay charts this peer's samples without a loss"
            )
        self.contribute(
            grads, batch_size=n, loss=value, skip=skip, weight=self.grad_unit if mode == "sum" else n, started=started
        )
        return loss

    @torch.no_grad()
    def contribute(
        self,
        grads: list[torch.Tensor],
        *,
        batch_size: int,
        loss: float | None = None,
        version: int | None = None,
        skip: bool = False,
        weight: float | None = None,
        started: float | None = None,
    ) -> bool:
        """Add one micro-batch's gradients, computed on parameters ``version``, to the local
        accumulator; take part in a round if due. :meth:`step` is this with ``.grad``.

        ``grads`` are in ``model.parameters()`` order, per-sample means over ``batch_size``
        samples (``weight``: what they are multiplied by instead, see :meth:`Accumulator.add`).
        ``version`` (default: the parameters loaded now) lets a trainer that computes several
        micro-batches at once, each on its own replica (:mod:`toolkit.moe.inflight`), hand in a
        gradient computed before the latest download: one older than the run's ``max_staleness``
        allows could never join a round, so it is dropped, counted in ``dropped_stale_samples``
        and said on the panel (``last_error``), never silently. ``started``: when the micro-batch's
        compute began (step() passes it, so the local samples/s counts compute, not round waits;
        default now: the interval since the last contribution). Returns whether it was added.
        """
        started = time.monotonic() if started is None else started
        if self.local_sgd is None:  # local SGD settles its round after the inner step (LocalSgd.after_step)
            self.rounds.finish_pending()
        if self.finished:
            return False
        version = self.version if version is None else version
        added = False
        if self.version - version > self.run.max_staleness:
            self.dropped_stale_samples += batch_size
            self.note_error(
                CollabError(
                    "stale_gradient",
                    f"dropped a micro-batch of {batch_size} samples computed on "
                    f"step {version}: step {self.version} was loaded meanwhile and the run "
                    f"allows {self.run.max_staleness} step(s) of staleness "
                    f"({self.dropped_stale_samples} samples dropped so far)",
                )
            )
        elif skip:
            log.info("skipping a micro-batch (loss scaling overflow): only this peer's contribution is lost")
        elif not math.isfinite(float(torch.stack(torch._foreach_norm(grads)).sum())):
            log.warning("skipping a micro-batch with non-finite gradients (loss scaling overflow?)")
        elif self.local_sgd is not None:  # an inner step on the model's .grad (step()'s path; the run has no mixtures)
            self.local_sgd.inner_step(batch_size, loss, batch_size if weight is None else weight)
            self._update_speed(batch_size, started)
            added = True
        else:
            self.accumulator.add(grads, batch_size, loss, version, weight=weight)
            self._update_speed(batch_size, started)
            added = True
        if self.local_sgd is not None:
            self.local_sgd.after_step()
        else:
            self._sync()
        self._last_step_end = time.monotonic()
        return added

    def sync(self) -> None:
        """Settle a finished background round and report, contribute or resync as the collaboration's
        state says, with nothing to add: what a trainer that holds micro-batches back calls while
        it waits for the round they would overshoot (:meth:`room`)."""
        self.rounds.finish_pending()
        if not self.finished:
            self._sync()

    def room(self) -> int:
        """Samples the collaboration may still gather before it reaches ``target_batch``: the
        target less the others' samples (the relay's count less what this peer last reported),
        less this peer's accumulator. A trainer with micro-batches in flight issues another only
        while its in-flight samples stay below this, so it never computes on parameters a round
        is about to replace (with ``max_staleness = 0`` such a gradient would be wasted)."""
        state = self.collab_state
        others = 0 if self.version > state.step else max(0, state.samples_accumulated - self._reported_samples)
        return state.target_batch - others - self.samples

    def hold(self) -> None:
        """Wait, reporting and contributing, while this peer's next micro-batch would only overshoot
        the target: the collaboration already holds it (:meth:`room` is spent) and this peer's
        samples wait for their round. That happens while the previous round is still closing: the
        relay cannot open the next one yet, and a peer that went on computing would bring every
        micro-batch of that time into the next step (a step of 20 samples for a target of 8 on a
        loaded machine) where the run promises the target plus one micro-batch per peer. Bounded
        by :data:`HOLD_MAX_S`: a relay that never opens the round does not stall the loop.
        :meth:`batches` and :func:`toolkit.join` call it before each micro-batch; an own loop over
        other data may too. Not in local SGD: its inner steps go on during the outer round by design."""
        if self.local_sgd is not None:
            return
        give_up = time.monotonic() + HOLD_MAX_S
        poll = min(max(self.report_interval_s, HOLD_POLL_S), 0.5)
        while not self.finished and self.samples and self.room() <= 0 and time.monotonic() < give_up:
            time.sleep(poll)
            self.sync()

    def batches(
        self, data: Iterable[Any] | None = None, *, batch_size: int | None = None, seed: int | str | None = None
    ) -> Iterator[Any]:
        """The micro-batches to train on, ending when the run finishes.

        Without ``data``, the run's own data for this peer, as :func:`toolkit.join` trains on it:
        its shards (leased from the relay), tokenized with the run's tokenizer into its
        ``[objective]``'s dict batches on a background thread; ``batch_size`` defaults to
        ``batch_size_per_step``, ``seed`` to this peer's id. With ``data`` (a DataLoader, say),
        its batches, pass after pass. Either way the loop ends by itself, even when a framework
        wraps this optimizer.
        """
        return until_finished(
            self, data, batch_size or self.batch_size_per_step, self.peer_id if seed is None else seed
        )

    def close(self, finish_round_s: float = 10.0) -> None:
        """Leave the collaboration and stop the background thread (idempotent).

        A round still in flight (delayed updates, local SGD's overlap) is waited for, up to
        ``finish_round_s``: its samples are already on the relay, and this peer's own count should
        say whether they counted. Then it is stopped (:meth:`RoundParticipation.finish_pending_before_leaving
        <toolkit.optimizer.participation.RoundParticipation.finish_pending_before_leaving>`), so that no
        download is left half-written: in local SGD the model ends on the newest global parameters
        the peer holds (the inner steps since its last outer round are not sent).
        """
        alive = self._finalizer.alive
        pending = self.rounds.finish_pending_before_leaving(finish_round_s) if alive else self.rounds.take_pending()
        self._finalizer()
        if self.local_sgd is not None and alive:  # local SGD: the model ends on global parameters
            self.local_sgd.leave(public_whole=pending is None or pending.done() or not self._worker.is_alive())

    def __enter__(self) -> "CollaborativeOptimizer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def samples(self) -> int:
        """Samples in the accumulator, not yet sent."""
        return self.accumulator.samples

    def heartbeat_message(self) -> Heartbeat:
        """What a report says (built under the report lock): the samples not yet credited by the
        relay -- the accumulator's, else those of an upload still under way -- and the version
        they were computed on; with nothing to send, the version this peer computes on (in local
        SGD with a round in flight, the one it will rebase onto: :meth:`LocalSgd.working_version`)."""
        acc, local, sending = self.accumulator, self.local_sgd, self.rounds.sending
        with acc.lock:
            if acc.samples:
                version, samples = acc.version, acc.samples
            elif sending is not None:
                version, samples = sending.version, sending.samples
            else:
                version, samples = (local.working_version() if local is not None else max(self.version, 0)), 0
            return Heartbeat(
                version=version,
                samples=samples,
                samples_per_s=self.samples_per_s,
                inner_steps=local.steps if local is not None else 0,
                busy_fraction=local.busy_fraction if local is not None else None,
            )

    def report_progress(self, client: RelayClient | None = None) -> CollabState:
        """Send progress.

        Both threads report (the worker when the loop is busy), so the message is built and
        sent under one lock: reports reach the relay in the order they were made, and the relay
        never sees an older, smaller count after the one an upload relies on.
        """
        with self._report_lock:
            message = self.heartbeat_message()
            self.collab_state = self.membership.beat(message, client or self.client)
            self._reported_samples = message.samples
            self.last_report_at = time.monotonic()
            return self.collab_state

    @property
    def peer_id(self) -> str:
        """This peer's id in the run (its membership's: a new one after the relay forgot it)."""
        return self.membership.peer_id

    def keep_alive(self, client: RelayClient, interval_s: float) -> None:
        """The background worker's heartbeat while the loop is busy: a report if none went out for
        ``interval_s``; a failed one goes to ``last_error`` (the next report retries)."""
        if time.monotonic() - self.last_report_at < interval_s:
            return
        try:
            self.report_progress(client)
        except CollabError as exc:
            self.last_error = exc

    def note_error(self, exc: CollabError) -> None:
        """What the peer recovers from by itself (:data:`toolkit.errors.HANDLED_BY_PEER`: the
        round it sent to had closed, ...) goes to the debug log only; anything else to the panel
        (``last_error``) and the log, in one line saying what to do."""
        if handled_by_peer(exc):
            log.debug("handled by this peer: %s", exc)
            return
        self.last_error = exc
        log.warning("%s", volunteer_line(exc))

    # --- what the rounds own, as the loop API has always shown it ------------------------------
    @property
    def version(self) -> int:
        """The version of the parameters loaded into the model (-1 before the first)."""
        return self.rounds.version

    @property
    def contributed_samples(self) -> int:
        """This peer's samples that rounds applied."""
        return self.rounds.contributed_samples

    @property
    def last_applied_round(self) -> int:
        """The step of the round that last applied this peer's samples (-1: none yet)."""
        return self.rounds.last_applied_round

    @property
    def step_times(self) -> list[tuple[int, float]]:
        """(version, wall time loaded) of each version loaded, for the panel."""
        return self.rounds.step_times

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

    def _sync(self) -> None:
        """Decide, from the latest collaboration state, whether to contribute or resync."""
        due = time.monotonic() - self.last_report_at >= self.report_interval_s
        expected = self.collab_state.samples_accumulated + self.samples >= self.collab_state.target_batch
        try:
            rounds = self.rounds
            if due or expected or self.collab_state.round or rounds.limbo:
                state = self.report_progress()
            else:
                state = self.collab_state
            if self.membership.rejoins != self._rejoins_seen:  # the relay forgot this peer: joined again
                if rounds.pending is not None:
                    return  # the lost id's round in flight ends first
                self._rejoins_seen = self.membership.rejoins
                rounds.start_over(
                    "the relay forgot this peer and it joined again: its gradient is dropped, the "
                    "relay's parameters downloaded in full"
                )
            if state.finished:
                self.finished = True
                return
            rounds.settle_limbo(state)
            if self.samples and state.step - self.accumulator.version > self.run.max_staleness:
                rounds.discard(
                    f"behind: gradient from step {self.accumulator.version}, relay at {state.step}; resyncing"
                )
            behind = self.version < state.step - self.run.max_staleness
            if rounds.pending is None and (behind or (not self.samples and self.version < state.step)):
                rounds.load_latest()
            r = state.round
            if (
                r is not None
                and self.samples
                and rounds.new_round(r.round_id)
                and rounds.pending is None
                and 0 <= r.step - self.accumulator.version <= self.run.max_staleness
            ):
                rounds.contribute(r.step, r.round_id)
        except (RelayUnreachable, RelayRejected) as exc:
            self.note_error(exc)
