"""The peer's half of ``run.mode = "local_sgd"`` (issue 26): the inner loop and the outer round.

:class:`~toolkit.optimizer.CollaborativeOptimizer` hands every ``step()`` to :class:`LocalSgd`
when the run says so, so the loops, ``join()`` and the notebooks need nothing new. Each step
takes one step of the inner optimizer (the run's ``[optimizer]``, built here with the relay's
parameter groups: decay on tensors with two or more dimensions) on the peer's own copy of the
parameters. When the inner budget ends (``inner_steps`` steps or ``inner_seconds`` of training,
whichever first) the peer puts its pseudo-gradient ``global - local`` times the samples it
processed into the accumulator -- the same sum a sync peer sends, so the upload path (signing,
digests, finite checks, whole-or-nothing, byte caps) and the relay's sample-weighted mean apply
unchanged -- and takes part in the outer round through the sync machinery
(:meth:`CollaborativeOptimizer._sync`, :mod:`toolkit.optimizer.rounds`). The relay applies
``params -= outer_lr * mean_pseudo_grad`` (with Nesterov momentum): a pseudo-gradient points
uphill like a gradient, so the outer step lowers the loss. The inner optimizer's state (Adam's
moments) stays on the peer across outer rounds, as DiLoCo keeps it: that is the mode's memory cost.

**Without overlap** (``[local_sgd] overlap = false``, the default) ``step()`` blocks for the outer
round and loads the new global parameters: with H = 1, inner SGD lr 1 and outer SGD lr 1 this is
sync mode exactly.

**With overlap** the round runs behind the next inner steps, a *one-step-delayed outer update*
(as DiLoCoX and "eager updates" do): at the budget end the peer keeps its local parameters as a
snapshot ``x_s``, hands the upload and the wait for version ``t + 1`` to the background worker
(the same ``_contribute`` / ``_round_job`` / ``_pending`` as sync mode's delayed updates) and
goes on training from ``x_s``. When ``theta_{t+1}`` arrives, the next ``step()`` rebases after its
inner step: ``x <- theta_{t+1} + (x - x_s)`` -- the inner steps taken meanwhile are carried onto
the new global parameters, the inner optimizer's state stays -- and that loop's pseudo-gradient
is ``theta_{t+1} - x`` at its end, on version ``t + 1``. If the next budget ends before the result
arrived, the peer waits then: that wait is what :attr:`LocalSgd.busy_fraction` sees. The
pseudo-gradient is one outer step late relative to the parameters it is applied to, and the
peer holds one more copy of the parameters (the snapshot). Why not Streaming DiLoCo's fragments:
they cut *peak* bandwidth by syncing a slice of the layers at staggered times, but each fragment
is its own outer round with its own version -- the relay's one-version-per-step publishing, the
whole-vector delta downloads and the registry's version rule would all have to become
per-fragment; a whole-model delayed round hides the same time behind compute with none of that,
and the upload still moves only once per H steps.

Versions stay consistent with :class:`OuterRoundRule <relay_server.rounds.local_sgd.OuterRoundRule>`:
while a round is in flight a peer with nothing to send reports the version it will rebase onto
(:meth:`LocalSgd.working_version`: the relay's newest once it moved past the round), so the next
outer round waits for it on ``t + 1`` like any peer that loaded ``t + 1``; an upload under way
still reports its samples (``_sending``), so the relay never drops it from the round it joins.

**A late pseudo-gradient is dropped, never applied late** (``run.max_staleness = 0`` is
required). Until its budget ends the peer reports no samples, so the relay waits for it
(:mod:`relay_server.rounds.local_sgd`); if the relay moved on meanwhile (the others held the target
batch, or ``straggler_wait_s`` ran out), the inner steps are late: dropped, counted in
``late_rounds``, and the peer goes on from the new global parameters (with overlap, keeping the
steps taken since the snapshot). Why not apply it with a weight such as ``1 / (1 + staleness)``
(staleness-aware ASGD, Zhang et al. 2016): that rule was made for per-step gradients, where one
version of staleness is one small step; here one version is a whole outer step (H inner steps)
and the relay's Nesterov momentum would carry a stale pseudo-gradient into later steps as well --
Liu et al. 2024 ("Asynchronous Local-SGD Training for Language Modeling") found exactly that
stale pseudo-gradients under outer Nesterov momentum hurt, and needed a delayed-momentum variant
to recover. DiLoCo (Douillard et al. 2023) shows the other side: dropping a share of the
replicas' outer gradients at random costs little. With the time budget and the outer-round rule
waiting for every live peer, lateness is rare (a peer past ``straggler_wait_s``, a lost
upload), dropping keeps each outer step the exact sample-weighted mean of pseudo-gradients on
one version, and overlap -- not late application -- is how this mode keeps peers busy.

Every failure ends with the accumulator empty and the model on global parameters (plus, with
overlap, the peer's own steps since its snapshot): a lost round (relay restart) is retried while
the relay stays on its version (``_limbo``); a round that never opens is dropped after
``round_wait_s``; the run finishing and ``close()`` leave the model on the newest global
parameters the peer holds.
"""

from __future__ import annotations

import logging
import time
from concurrent import futures
from typing import TYPE_CHECKING, Any

import torch

from toolkit.errors import CollabError

if TYPE_CHECKING:
    from toolkit.client import RelayClient
    from toolkit.optimizer.core import CollaborativeOptimizer
    from toolkit.optimizer.rounds import Outcome

log = logging.getLogger("toolkit.optimizer")

WAIT_POLL_S = 0.05
"""How often a peer whose budget ended looks for its outer round (reports stay rate-limited by
``report_interval_s``)."""


def inner_optimizer(params: list[tuple[str, torch.nn.Parameter]], cfg: dict[str, Any]) -> torch.optim.Optimizer:
    """The run's ``[optimizer]`` as the relay would build it (``relay_server.rounds.master``),
    over the peer's own parameters."""
    decay = [p for _, p in params if p.ndim >= 2]
    no_decay = [p for _, p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": float(cfg["weight_decay"])}, {"params": no_decay, "weight_decay": 0.0}]
    lr, name = float(cfg["lr"]), cfg["name"]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=float(cfg.get("momentum", 0.0)))
    betas = (float(cfg["betas"][0]), float(cfg["betas"][1]))
    if name == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=betas, eps=float(cfg["eps"]))
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=float(cfg["eps"]))
    raise ValueError(f"inner optimizer {name!r} is not supported: the relay should have refused this run")


class LocalSgd:
    """Inner-loop state of one peer: the inner optimizer, what this inner loop processed, and (with
    overlap) the snapshot whose pseudo-gradient is in its outer round."""

    def __init__(self, opt: CollaborativeOptimizer, settings: dict[str, Any]) -> None:
        self.opt = opt
        self.inner = settings["inner"]
        self.inner_steps = int(settings.get("inner_steps", 0))
        self.inner_seconds = float(settings.get("inner_seconds", 0.0))
        self.overlap = bool(settings.get("overlap", False))
        opt.delayed_updates = self.overlap  # rounds run in the background worker iff they overlap compute
        self.optimizer = inner_optimizer(opt._named, self.inner)
        self.clip = float(self.inner.get("clip_grad_norm", 0.0))
        self.late_rounds = 0  # outer rounds whose pseudo-gradient did not count (late or lost: dropped)
        self.outer_rounds = 0  # outer rounds this peer's pseudo-gradient counted in
        self.first_step_at: float | None = None  # when this peer's first inner step began
        self.waited_s = 0.0  # seconds step() spent on the collaboration (reports, outer rounds) rather than training
        # overlap: the local parameters whose pseudo-gradient is in flight, and the version it is on
        self.snapshot: list[torch.Tensor] | None = None
        self.flight_version = -1
        self.rebases: list[tuple[int, int]] = []  # (version rebased onto, inner steps carried onto it)
        self.give_up = 0.0  # when the round in flight is dropped if it has not happened
        self._restart()

    def _restart(self) -> None:
        """A new inner loop from the global parameters now in the model (version ``opt.version``)."""
        self.steps, self.samples, self.loss_sum, self.started = 0, 0, 0.0, None
        self.version = self.opt.version

    def inner_step(self, n: int, loss: float | None, weight: float) -> None:
        """One step of the inner optimizer on the ``.grad`` the loop computed: ``.grad * weight`` is
        the sum over the ``n`` samples (``weight = n`` for a plain loop's mean, as the accumulator's)."""
        if weight != n:  # a hooked backward's .grad is sum / unit: the inner step wants the mean
            torch._foreach_mul_([p.grad for _, p in self.opt._named if p.grad is not None], weight / n)
        if self.started is None:
            self.started = time.monotonic()
        if self.first_step_at is None:
            self.first_step_at = self.started
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_([p for _, p in self.opt._named], self.clip)
        self.optimizer.step()
        self.steps += 1
        self.samples += n
        self.loss_sum += (loss or 0.0) * n

    def after_step(self) -> None:
        """What ``step()`` does after the inner step: report, and the outer round when the budget is
        spent (blocking, or with overlap started in the background and settled by a later step).
        Its time is what :attr:`busy_fraction` counts as not training."""
        began = time.monotonic()
        try:
            if self.overlap:
                self._overlap_step()
            elif self.budget_spent():
                self.outer_round()
            else:
                self.check_in()
        finally:
            self.waited_s += time.monotonic() - began

    @property
    def busy_fraction(self) -> float | None:
        """Share of the time since the first inner step not spent in ``step()``'s collaboration
        work (reports, outer rounds, waiting for one): the accelerator's busy fraction as far as
        the collaboration is concerned; None before that."""
        if self.first_step_at is None:
            return None
        elapsed = time.monotonic() - self.first_step_at
        return None if elapsed <= 0 else min(1.0, max(0.0, 1.0 - self.waited_s / elapsed))

    def budget_spent(self) -> bool:
        if self.inner_steps and self.steps >= self.inner_steps:
            return True
        return bool(self.inner_seconds and self.started is not None
                    and time.monotonic() - self.started >= self.inner_seconds)

    def working_version(self) -> int:
        """The version this inner loop's pseudo-gradient will be relative to, as reports say it
        while there is nothing to send: with a round in flight, the relay's newest version once it
        moved past the round (the rebase lands there), so :class:`OuterRoundRule
        <relay_server.rounds.local_sgd.OuterRoundRule>` waits for this peer on that version."""
        opt = self.opt
        if self.snapshot is not None:
            return max(opt.version, opt.collab_state.step, 0)
        return max(opt.version, 0)

    # --- without overlap: the outer round blocks step() -------------------------------------------
    def check_in(self) -> None:
        """While the inner loop runs: report when due (liveness, the run finishing), and start over
        from the new global parameters if the relay moved past the version this loop started on."""
        opt = self.opt
        if time.monotonic() - opt.last_report_at < opt.report_interval_s:
            return
        try:
            state = opt.report_progress()
        except CollabError as exc:  # a lost report costs nothing; the next one retries
            opt._note_error(exc)
            return
        if state.finished:
            opt.finished = True
        elif state.step > self.version:
            self._late(state.step)

    def _late(self, step: int) -> None:
        self.late_rounds += 1
        log.info("outer round %d closed without this peer's %d inner steps: dropped; continuing from step %d",
                 self.version, self.steps, step)
        self.opt._load_latest()
        self._restart()

    def outer_round(self) -> None:
        """The budget ended: send the pseudo-gradient, wait for the outer round's result, load it."""
        opt = self.opt
        if self.samples == 0:
            self._restart()
            return
        opt.accumulator.add(self._pseudo_gradient(), self.samples, self.loss_sum / self.samples, self.version,
                            weight=self.samples)
        contributed = opt.contributed_samples
        give_up = time.monotonic() + opt.round_wait_s
        while opt.samples and not opt.finished and time.monotonic() < give_up:
            opt._sync()  # reports; uploads once the round is open (waits for its version); drops if late
            if opt.samples:
                time.sleep(WAIT_POLL_S)
        if opt.samples:  # no round within round_wait_s: the relay is gone or stuck; keep what is global
            opt._discard(f"no outer round for step {self.version} within {opt.round_wait_s:.0f}s; dropped")
        if opt.contributed_samples > contributed:
            self.outer_rounds += 1
        elif not opt.finished:
            self.late_rounds += 1
        if opt.version <= self.version and not opt.finished:
            opt._load_latest()  # the model still holds the local parameters: back to the global ones
            if opt.version <= self.version:  # the relay did not move: reload this version anyway
                opt._load(force=True)
        self._restart()

    def _pseudo_gradient(self) -> list[torch.Tensor]:
        """``global - local``: the public parameters (the version this loop started on) minus the model's."""
        opt = self.opt
        public = torch.from_numpy(opt._public)
        with torch.no_grad():
            return [public[spec.offset:spec.offset + p.numel()].view_as(p).to(p.device) - p.detach().float()
                    for spec, (_, p) in zip(opt.run.layout, opt._named)]

    # --- with overlap: the outer round runs behind the next inner steps ---------------------------
    def _overlap_step(self) -> None:
        opt = self.opt
        self._advance()
        if not opt.finished and self.budget_spent():
            self._wait_for_flight()
            if opt.finished:
                pass
            elif self.snapshot is None:
                self._launch()
            else:  # no usable global copy to measure against (relay gone): these steps stay local
                self.late_rounds += 1
                self._restart()
        if opt.finished:
            self._finish()

    def _launch(self) -> None:
        """The budget ended with no round in flight: put ``global - local`` into the accumulator,
        keep the local parameters as the snapshot, start the next inner loop, and hand the outer
        round to the worker (:meth:`outer_job`)."""
        opt = self.opt
        if self.samples == 0:
            self._restart()
            return
        opt.accumulator.add(self._pseudo_gradient(), self.samples, self.loss_sum / self.samples, opt.version,
                            weight=self.samples)
        self.snapshot = [p.detach().clone() for _, p in opt._named]
        self.flight_version = opt.version
        self.give_up = time.monotonic() + opt.round_wait_s
        self._restart()
        self._advance()

    def outer_job(self, client: RelayClient) -> Outcome | None:
        """In the worker: report until the relay opens the outer round on the snapshot's version,
        then upload and wait for the result (:meth:`_round_job <toolkit.optimizer.rounds.
        RoundParticipation._round_job>`). None when there is nothing to upload any more (the relay
        moved on, the run finished, the peer closes, ``round_wait_s`` ran out): the training
        thread's next :meth:`_advance` sorts that out."""
        opt, version = self.opt, self.flight_version
        while not opt._worker.stopping.is_set() and time.monotonic() < self.give_up:
            try:
                state = opt.report_progress(client)
            except CollabError as exc:  # a blip: report again
                opt._note_error(exc)
            else:
                if state.finished or state.step != version or not opt.samples:
                    return None
                r = state.round
                if r is not None and r.step == version and r.round_id != opt._last_round_id:
                    upload = opt._take_upload(client, r.step, r.round_id)
                    return None if upload is None else opt._round_job(client, upload, r.round_id)
            opt._worker.stopping.wait(max(opt.report_interval_s, WAIT_POLL_S))
        return None

    def _advance(self) -> None:
        """Move the round in flight on without blocking (training thread): settle what the worker
        brought back (a result is loaded as the rebase), report when due, drop the pseudo-gradient
        if the relay moved on (rebasing then too), and put the outer round back in the worker's
        hands while the pseudo-gradient waits for its round (after a lost round, or at launch)."""
        opt = self.opt
        opt._finish_pending()
        if not opt.finished:
            opt._sync()
        if self.snapshot is None or opt.finished or opt._pending is not None or opt._sending is not None:
            return
        if time.monotonic() >= self.give_up and (opt.samples or opt._limbo is not None):
            self._abandon()
        elif opt.samples and opt._limbo is None:
            opt._pending = opt._worker.submit(self.outer_job)
        elif not opt.samples and opt._limbo is None and opt.collab_state.step <= self.flight_version:
            # the round refused our pseudo-gradient and the relay is still on our version: carry
            # the inner steps since the snapshot onto the global parameters held
            opt._load(force=True)

    def _wait_for_flight(self) -> None:
        """The next budget ended before the round in flight did: wait for it (what
        :attr:`busy_fraction` measures), reporting meanwhile; bounded by ``round_wait_s`` from the
        launch plus one worker job (whose upload and wait are bounded themselves)."""
        opt = self.opt
        while self.snapshot is not None and not opt.finished:
            pending = opt._pending
            if pending is not None:
                futures.wait([pending], timeout=max(opt.report_interval_s, WAIT_POLL_S))
            elif time.monotonic() >= self.give_up + opt.round_wait_s:
                return  # not even a global copy to rebase onto (relay gone): the caller keeps going
            else:
                time.sleep(WAIT_POLL_S)
            self._advance()

    def _abandon(self) -> None:
        """No outer round within ``round_wait_s`` (the relay is gone or stuck): drop the
        pseudo-gradient and rebase onto the newest global parameters this peer can get."""
        opt = self.opt
        opt._discard(f"no outer round for step {self.flight_version} within {opt.round_wait_s:.0f}s; dropped")
        opt._limbo = None
        try:
            opt._load_latest()
        except CollabError as exc:
            opt._note_error(exc)
        if self.snapshot is not None:
            opt._load(force=True)  # no-op if the public copy is unusable: the next sync retries

    def rebase_carry(self, params: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Called by the optimizer just before it copies global parameters into the model: with a
        round in flight, ``snapshot - local`` (computed in place in the snapshot, which is then
        released), so that ``theta - carry = theta + (local - snapshot)`` keeps the inner steps
        taken since the snapshot; None otherwise (a plain load)."""
        snapshot, self.snapshot = self.snapshot, None
        if snapshot is None:
            return None
        with torch.no_grad():
            torch._foreach_sub_(snapshot, [p.detach() for p in params])
        return snapshot

    def loaded(self, step: int, *, rebased: bool) -> None:
        """After a load (overlap only; the blocking path keeps its own counts). A rebase resolves
        the round in flight: counted if the relay applied it, else late (dropped). A plain load
        during an inner loop means the relay moved past this loop's version: its steps are
        dropped (late) and the loop starts over on ``step``."""
        if not self.overlap:
            return
        if rebased:
            applied = self.opt.last_applied_round == self.flight_version
            self.outer_rounds += applied
            self.late_rounds += not applied
            self.rebases.append((step, self.steps))
            self.version = step
        elif self.steps or self.samples:
            self.late_rounds += 1
            self._restart()
        else:
            self.version = step

    def _finish(self) -> None:
        """The run finished: settle the last round (its result is published, so the worker's wait
        ends at once) and leave the model on the final global parameters (the inner steps since
        the last snapshot can count nowhere)."""
        opt = self.opt
        pending, opt._pending = opt._pending, None
        if pending is not None:
            try:
                opt._settle(pending.result(timeout=opt.round_wait_s))
            except (TimeoutError, CollabError) as exc:
                log.info("the run finished with an outer round unsettled (%s)", type(exc).__name__)
        quiet = pending is None or pending.done()
        if quiet:
            try:
                opt._download(opt.client)
            except CollabError as exc:
                opt._note_error(exc)
        self.leave(public_whole=quiet)

    def leave(self, *, public_whole: bool) -> None:
        """End of the run or ``close()``: nothing stays to send, and the model holds global
        parameters -- the newest this peer has, unless the worker may still be writing them
        (``public_whole`` False), when the model keeps its own and the log says so."""
        opt = self.opt
        opt.accumulator.discard()
        opt._limbo = None
        self.snapshot = None
        self._restart()
        if public_whole and opt._public_version >= 0:
            opt._load(force=True)
        else:
            log.info("left with a download in flight: the model keeps its local parameters")
