"""The peer's half of ``run.mode = "local_sgd"``: the inner loop and the outer round.

:class:`~toolkit.optimizer.CollaborativeOptimizer` hands every ``step()`` to :class:`LocalSgd`
when the run says so, so the loops, ``join()`` and the notebooks need nothing new. Each step
takes one step of the inner optimizer (the run's ``[optimizer]``, :mod:`toolkit.optimizer.inner`:
8-bit moments where ``state_bits = 8`` asks and bitsandbytes runs) on the peer's own copy of
the parameters. When the inner budget ends (``inner_steps`` steps or ``inner_seconds`` of training,
whichever first) the peer puts its pseudo-gradient ``global - local`` times the samples it
processed into the accumulator -- the same sum a sync peer sends, so the upload path (signing,
digests, finite checks, whole-or-nothing, byte caps) and the relay's sample-weighted mean apply
unchanged -- and takes part in the outer round through the sync machinery
(:meth:`CollaborativeOptimizer.sync`, :mod:`toolkit.optimizer.participation`). The relay applies
``params -= outer_lr * mean_pseudo_grad`` (with Nesterov momentum): a pseudo-gradient points
uphill like a gradient, so the outer step lowers the loss. The inner optimizer's state (Adam's
moments) stays on the peer across outer rounds, as DiLoCo keeps it: that is the mode's memory cost.

**Without overlap** (``[local_sgd] overlap = false``, the default) ``step()`` blocks for the outer
round and loads the new global parameters: with H = 1, inner SGD lr 1 and outer SGD lr 1 this is
sync mode exactly.

**With overlap** (``overlap = true``) the round runs behind the next inner steps, and the steps
taken while it is in flight are carried onto the new global parameters: a one-step-delayed outer
update, not Streaming DiLoCo's fragments (:mod:`toolkit.optimizer.overlap` says why).

**A late pseudo-gradient is dropped, never applied late** (``run.max_staleness = 0`` is
required). Until its budget ends the peer reports no samples, so the relay waits for it
(:mod:`relay_server.local_sgd.outer_rounds`); if the relay moved on meanwhile (the others held the target
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
the relay stays on its version (``RoundParticipation.limbo``); a round that never opens is dropped after
``round_wait_s``; the run finishing and ``close()`` leave the model on the newest global
parameters the peer holds (:meth:`LocalSgd.leave`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from toolkit.errors import CollabError
from toolkit.optimizer.inner import inner_optimizer
from toolkit.optimizer.overlap import WAIT_POLL_S, OverlappedRound
from toolkit.wire.schedule import lr_at

if TYPE_CHECKING:
    from toolkit.optimizer.core import CollaborativeOptimizer

log = logging.getLogger("toolkit.optimizer")


class LocalSgd:
    """Inner-loop state of one peer: the inner optimizer, what this inner loop processed and the
    outer rounds' counts; with overlap, the round in flight is its :attr:`flight`
    (:class:`~toolkit.optimizer.overlap.OverlappedRound`). It reaches the optimizer's rounds
    through :attr:`CollaborativeOptimizer.rounds <toolkit.optimizer.participation.RoundParticipation>`;
    the optimizer runs its rounds in the background iff :attr:`overlap`."""

    def __init__(self, opt: CollaborativeOptimizer, settings: dict[str, Any]) -> None:
        self.opt, self.rounds = opt, opt.rounds
        self.named = list(opt.model.named_parameters())  # the optimizer's parameters, in its order
        self.inner = settings["inner"]
        self.inner_steps = int(settings.get("inner_steps", 0))
        self.inner_seconds = float(settings.get("inner_seconds", 0.0))
        self.overlap = bool(settings.get("overlap", False))
        self.optimizer = inner_optimizer(self.named, self.inner)
        self.clip = float(self.inner.get("clip_grad_norm", 0.0))
        self.late_rounds = 0  # outer rounds whose pseudo-gradient did not count (late or lost: dropped)
        self.outer_rounds = 0  # outer rounds this peer's pseudo-gradient counted in
        self.first_step_at: float | None = None  # when this peer's first inner step began
        self.waited_s = 0.0  # seconds step() spent on the collaboration (reports, outer rounds) rather than training
        self.rebases: list[tuple[int, int]] = []  # with overlap: (version rebased onto, inner steps carried)
        self.flight = OverlappedRound(self, opt) if self.overlap else None
        self.restart()

    @property
    def snapshot(self) -> list[torch.Tensor] | None:
        """With overlap, the local parameters whose pseudo-gradient is in its outer round."""
        return self.flight.snapshot if self.flight is not None else None

    @property
    def flight_version(self) -> int:
        """With overlap, the version of the pseudo-gradient last sent to an outer round (-1: none)."""
        return self.flight.flight_version if self.flight is not None else -1

    def working_version(self) -> int:
        """The version reports say this peer computes on while it has nothing to send
        (:meth:`OverlappedRound.working_version <toolkit.optimizer.overlap.OverlappedRound.working_version>`)."""
        if self.flight is not None:
            return self.flight.working_version()
        return max(self.opt.version, 0)

    def rebase_carry(self, params: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """What the rounds subtract from global parameters they load (None: a plain load;
        :meth:`OverlappedRound.rebase_carry <toolkit.optimizer.overlap.OverlappedRound.rebase_carry>`)."""
        return self.flight.rebase_carry(params) if self.flight is not None else None

    def loaded(self, step: int, *, rebased: bool) -> None:
        """After a load (overlap only; the blocking path keeps its own counts). A rebase resolves
        the round in flight: counted if the relay applied it, else late (dropped). A plain load
        during an inner loop means the relay moved past this loop's version: its steps are
        dropped (late) and the loop starts over on ``step``."""
        if self.flight is None:
            return
        if rebased:
            applied = self.opt.last_applied_round == self.flight.flight_version
            self.outer_rounds += applied
            self.late_rounds += not applied
            self.rebases.append((step, self.steps))
            self.version = step
        elif self.steps or self.samples:
            self.late_rounds += 1
            self.restart()
        else:
            self.version = step

    def restart(self) -> None:
        """A new inner loop from the global parameters now in the model (version ``opt.version``)."""
        self.steps, self.samples, self.loss_sum, self.started = 0, 0, 0.0, None
        self.version = self.opt.version

    def inner_step(self, n: int, loss: float | None, weight: float) -> None:
        """One step of the inner optimizer on the ``.grad`` the loop computed: ``.grad * weight`` is
        the sum over the ``n`` samples (``weight = n`` for a plain loop's mean, as the accumulator's)."""
        if weight != n:  # a hooked backward's .grad is sum / unit: the inner step wants the mean
            torch._foreach_mul_([p.grad for _, p in self.named if p.grad is not None], weight / n)
        if self.started is None:
            self.started = time.monotonic()
        if self.first_step_at is None:
            self.first_step_at = self.started
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_([p for _, p in self.named], self.clip)
        lr = self.lr_now()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if lr != self.opt.local_lr:  # the loop's own param groups show the rate this step applies
            self.opt.use_local_lr(lr)
        self.optimizer.step()
        self.steps += 1
        self.samples += n
        self.loss_sum += (loss or 0.0) * n

    def lr_now(self) -> float:
        """The inner rate of the next step: the run's schedule at ``version x inner_steps + the
        steps since`` -- the same position on every peer, whichever round it joined in (the relay
        refuses a schedule without ``inner_steps``)."""
        inner = self.inner
        return lr_at(
            self.version * self.inner_steps + self.steps,
            lr=float(inner["lr"]),
            schedule=inner.get("schedule", "constant"),
            warmup_steps=int(inner.get("warmup_steps", 0)),
            total_steps=int(inner.get("total_steps", 0)),
        )

    def after_step(self) -> None:
        """What ``step()`` does after the inner step: report, and the outer round when the budget is
        spent (blocking, or with overlap started in the background and settled by a later step).
        Its time is what :attr:`busy_fraction` counts as not training."""
        began = time.monotonic()
        try:
            if self.flight is not None:
                self.flight.step()
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
        return bool(
            self.inner_seconds and self.started is not None and time.monotonic() - self.started >= self.inner_seconds
        )

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
            opt.note_error(exc)
            return
        if state.finished:
            opt.finished = True
        elif state.step > self.version:
            self._late(state.step)

    def _late(self, step: int) -> None:
        self.late_rounds += 1
        log.info(
            "outer round %d closed without this peer's %d inner steps: dropped; continuing from step %d",
            self.version,
            self.steps,
            step,
        )
        self.rounds.load_latest()
        self.restart()

    def outer_round(self) -> None:
        """The budget ended: send the pseudo-gradient, wait for the outer round's result, load it."""
        opt, rounds = self.opt, self.rounds
        if self.samples == 0:
            self.restart()
            return
        opt.accumulator.add(
            self.pseudo_gradient(), self.samples, self.loss_sum / self.samples, self.version, weight=self.samples
        )
        contributed = opt.contributed_samples
        give_up = time.monotonic() + opt.round_wait_s
        while opt.samples and not opt.finished and time.monotonic() < give_up:
            opt.sync()  # reports; uploads once the round is open (waits for its version); drops if late
            if opt.samples:
                time.sleep(WAIT_POLL_S)
        if opt.samples:  # no round within round_wait_s: the relay is gone or stuck; keep what is global
            rounds.discard(f"no outer round for step {self.version} within {opt.round_wait_s:.0f}s; dropped")
        if opt.contributed_samples > contributed:
            self.outer_rounds += 1
        elif not opt.finished:
            self.late_rounds += 1
        if opt.version <= self.version and not opt.finished:
            rounds.load_latest()  # the model still holds the local parameters: back to the global ones
            if opt.version <= self.version:  # the relay did not move: reload this version anyway
                rounds.load(force=True)
        self.restart()

    def pseudo_gradient(self) -> list[torch.Tensor]:
        """``global - local``: the public parameters (the version this loop started on) minus the model's."""
        public = torch.from_numpy(self.rounds.public)
        with torch.no_grad():
            return [
                public[spec.offset : spec.offset + p.numel()].view_as(p).to(p.device) - p.detach().float()
                for spec, (_, p) in zip(self.opt.run.layout, self.named)
            ]

    def leave(self, *, public_whole: bool) -> None:
        """End of the run or ``close()``: nothing stays to send, and the model holds global
        parameters -- the newest this peer has, unless the worker may still be writing them
        (``public_whole`` False), when the model keeps its own and the log says so."""
        rounds = self.rounds
        self.opt.accumulator.discard()
        rounds.drop_limbo()
        if self.flight is not None:
            self.flight.drop()
        self.restart()
        if public_whole and rounds.public_version >= 0:
            rounds.load(force=True)
        else:
            log.info("left with a download in flight: the model keeps its local parameters")
