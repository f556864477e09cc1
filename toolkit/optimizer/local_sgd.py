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
(:meth:`CollaborativeOptimizer._sync`), which downloads the new global parameters into the model.
The relay applies ``params -= outer_lr * mean_pseudo_grad`` (with Nesterov momentum): a pseudo-
gradient points uphill like a gradient, so the outer step lowers the loss.

Until its budget ends the peer reports no samples, so the relay waits for it
(:mod:`relay_server.rounds.local_sgd`); if the relay moved on meanwhile (the others held the
target batch), the inner steps are late: dropped, counted in ``late_rounds``, and the peer
restarts from the new global parameters. The inner optimizer's state (Adam's moments) stays on
the peer across outer rounds, as DiLoCo keeps it: that is the mode's memory cost.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from toolkit.errors import CollabError

if TYPE_CHECKING:
    from toolkit.optimizer.core import CollaborativeOptimizer

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
    """Inner-loop state of one peer: the inner optimizer, and what this outer round processed."""

    def __init__(self, opt: CollaborativeOptimizer, settings: dict[str, Any]) -> None:
        self.opt = opt
        self.inner = settings["inner"]
        self.inner_steps = int(settings.get("inner_steps", 0))
        self.inner_seconds = float(settings.get("inner_seconds", 0.0))
        self.optimizer = inner_optimizer(opt._named, self.inner)
        self.clip = float(self.inner.get("clip_grad_norm", 0.0))
        self.late_rounds = 0  # outer rounds whose pseudo-gradient came too late (dropped)
        self.outer_rounds = 0  # outer rounds this peer's pseudo-gradient counted in
        self.first_step_at: float | None = None  # when this peer's first inner step began
        self.waited_s = 0.0  # seconds step() spent in outer rounds rather than training
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
        """What ``step()`` does after the inner step: the outer round when the budget is spent."""
        if self.budget_spent():
            self.outer_round()
        else:
            self.check_in()

    @property
    def busy_fraction(self) -> float | None:
        """Share of the time since the first inner step not spent waiting in outer rounds (the
        accelerator's busy fraction as far as the collaboration is concerned); None before that."""
        if self.first_step_at is None:
            return None
        elapsed = time.monotonic() - self.first_step_at
        return None if elapsed <= 0 else min(1.0, max(0.0, 1.0 - self.waited_s / elapsed))

    def budget_spent(self) -> bool:
        if self.inner_steps and self.steps >= self.inner_steps:
            return True
        return bool(self.inner_seconds and self.started is not None
                    and time.monotonic() - self.started >= self.inner_seconds)

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
        began = time.monotonic()
        try:
            self._outer_round()
        finally:
            self.waited_s += time.monotonic() - began

    def _outer_round(self) -> None:
        opt = self.opt
        public = torch.from_numpy(opt._public)
        with torch.no_grad():
            pseudo = [public[spec.offset:spec.offset + p.numel()].view_as(p).to(p.device) - p.detach().float()
                      for spec, (_, p) in zip(opt.run.layout, opt._named)]
        loss = self.loss_sum / self.samples
        opt.accumulator.add(pseudo, self.samples, loss, self.version, weight=self.samples)
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
                opt._public_version = -1
                opt.version = -1
                opt._load_latest()
        self._restart()
