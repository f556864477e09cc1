"""``[local_sgd]``: the low-bandwidth mode (``run.mode = "local_sgd"``).

Each peer runs the run's ``[optimizer]`` locally (the *inner* optimizer) for ``inner_steps``
micro-batches or ``inner_seconds`` of training, then uploads its pseudo-gradient (the global
parameters it started from minus its own) weighted by the samples it processed; the relay averages
them and applies the *outer* optimizer below to the master parameters (:mod:`relay_server.local_sgd.outer_rounds`).
One upload and one download per outer round instead of per step: that is the saving.

What the mode does not compose with yet is refused here, in one line, before anything is created.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from relay_server.core.training_config import Checks, OptimizerSection

if TYPE_CHECKING:
    from relay_server.core.config import RelayConfig


@dataclass(kw_only=True)
class LocalSgdSection:
    """``[local_sgd]``: the inner budget and the outer optimizer (read when ``run.mode = "local_sgd"``)."""

    inner_steps: int = 30
    """Inner optimizer steps (micro-batches) per outer round, H; 0 = only the time budget counts."""
    inner_seconds: float = 0.0
    """Seconds of inner training per outer round (0 = only ``inner_steps`` counts). With both set,
    whichever ends first ends the inner loop: a time budget lets peers of different speeds all
    contribute to every outer round."""
    overlap: bool = False
    """Hide the outer round behind compute: a peer whose budget ended starts the upload and the
    wait in the background and keeps training, then rebases its inner progress onto the new global
    parameters (a one-step-delayed outer update, :mod:`toolkit.optimizer.local_sgd`). Off by
    default: it changes the math (with H = 1 local SGD is no longer sync mode) and costs one more
    copy of the parameters on the peer; turn it on when rounds (upload, slowest peer, download)
    take a sizeable share of the inner budget, as on volunteers' uplinks."""
    straggler_wait_s: float = 120.0
    """Once a peer finished its budget, open the outer round after at most this many seconds even
    if other live peers have not finished (a paused notebook still heartbeats)."""
    outer_lr: float = 0.7
    """The outer SGD's learning rate on the averaged pseudo-gradient (DiLoCo: 0.7)."""
    outer_momentum: float = 0.9
    """The outer SGD's momentum (0 = none)."""
    nesterov: bool = True
    """Nesterov momentum for the outer SGD (needs outer_momentum > 0)."""

    def outer_optimizer(self) -> OptimizerSection:
        """The relay's optimizer in this mode: SGD on the mean pseudo-gradient (global - local), so
        ``params -= outer_lr * pseudo_grad`` like any gradient step (the sign others got wrong)."""
        return OptimizerSection(
            name="sgd",
            lr=self.outer_lr,
            momentum=self.outer_momentum,
            nesterov=self.nesterov and self.outer_momentum > 0,
            weight_decay=0.0,
        )

    def run_info(self, inner: OptimizerSection, total_steps: int) -> dict[str, Any]:
        """What peers need to run the inner loop (``RunInfo.local_sgd``). The inner schedule counts
        inner steps: ``total_steps`` outer rounds are ``total_steps * inner_steps`` of them."""
        return {
            "inner": {
                "name": inner.name,
                "lr": inner.lr,
                "betas": list(inner.betas),
                "eps": inner.eps,
                "weight_decay": inner.weight_decay,
                "momentum": inner.momentum,
                "clip_grad_norm": inner.clip_grad_norm,
                "schedule": inner.schedule,
                "warmup_steps": inner.warmup_steps,
                "total_steps": total_steps * self.inner_steps,
                "state_bits": inner.state_bits,
            },
            "inner_steps": self.inner_steps,
            "inner_seconds": self.inner_seconds,
            "overlap": self.overlap,
        }

    def checks(self) -> Checks:
        """(holds, message) pairs for :meth:`RelayConfig.validate`."""
        return [
            (
                self.inner_steps >= 0 and self.inner_seconds >= 0,
                "local_sgd.inner_steps and local_sgd.inner_seconds must be >= 0",
            ),
            (
                self.inner_steps > 0 or self.inner_seconds > 0,
                "local_sgd: set inner_steps (e.g. 30) or inner_seconds (e.g. 60), or both: the inner loop needs a budget",
            ),
            (self.straggler_wait_s > 0, "local_sgd.straggler_wait_s must be > 0 (seconds)"),
            (self.outer_lr > 0, "local_sgd.outer_lr must be > 0 (DiLoCo uses 0.7)"),
            (0 <= self.outer_momentum < 1, "local_sgd.outer_momentum must be in [0, 1) (DiLoCo uses 0.9)"),
            (
                not self.nesterov or self.outer_momentum > 0,
                "local_sgd.nesterov = true needs local_sgd.outer_momentum > 0 (or set nesterov = false)",
            ),
        ]


def mode_checks(config: RelayConfig) -> Checks:
    """What ``run.mode = "local_sgd"`` does not support yet, each refused with what to do."""
    if config.run.mode != "local_sgd":
        return []
    opt, not_yet = config.optimizer, 'is not supported with run.mode = "local_sgd" yet'
    return [
        *config.local_sgd.checks(),
        (
            config.run.max_staleness == 0,
            'run.mode = "local_sgd" needs run.max_staleness = 0: a late pseudo-gradient is dropped, never applied '
            "late (toolkit.optimizer.local_sgd says why; [local_sgd] overlap hides rounds instead)",
        ),
        (not config.pipeline.enabled, f'[pipeline] {not_yet}: set run.mode = "sync" or disable [pipeline]'),
        (not config.moe.enabled, f'[moe] {not_yet}: set run.mode = "sync" or disable [moe]'),
        (
            opt.name in ("adamw", "adam", "sgd"),
            f"optimizer.name = {opt.name!r} as the inner optimizer {not_yet}: use adamw, adam or sgd",
        ),
        (
            config.local_sgd.inner_steps > 0 or (opt.schedule == "constant" and opt.warmup_steps == 0),
            "an inner learning-rate schedule (optimizer.schedule, optimizer.warmup_steps) needs local_sgd.inner_steps "
            "> 0: it counts outer round x inner_steps + the inner step (with only inner_seconds, set schedule = "
            '"constant" and warmup_steps = 0)',
        ),
    ]
