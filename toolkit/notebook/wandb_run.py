"""The volunteer's own Weights & Biases run, when the run's configuration names a W&B project.

The relay logs the collaboration's metrics to its own run (DESIGN.md s1); each peer may add one
run of its own, named by the volunteer's Hugging Face username (the peer name in open runs) and
grouped under the collaboration's run name, so a volunteer can see what *their* notebook did:
local loss, local samples/s, contributed samples, against the global step.

Off is the normal case and costs nothing: :func:`open_wandb_run` returns a :class:`NullRun`
whose methods do nothing, so the training loop never asks "is W&B on?". It is also off, with one
log line instead of an interactive login prompt, when W&B is not installed, when no W&B API key
is available in online mode (the key comes from the platform's secret store, ``WANDB_API_KEY``
or ``~/.netrc`` -- never from the notebook), or when ``wandb.init`` fails: a W&B problem must
never stop a volunteer from contributing.

One row is logged per global step the peer sees (the mean local loss over the micro-batches
since the previous row), plus a last row at close, so the log rate follows the collaboration's
step rate rather than the local batch rate.
"""

from __future__ import annotations

import logging
import netrc
import os
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlparse

from toolkit.notebook.hints import secret
from toolkit.notebook.panel import PeerProgress

log = logging.getLogger(__name__)

WANDB_API_KEY = "WANDB_API_KEY"


@dataclass(frozen=True, kw_only=True)
class WandbTarget:
    """Where the peer's run goes: ``RunInfo.wandb`` (the relay's ``[wandb]`` project), or
    ``join(wandb_project="entity/project")``."""

    project: str
    """W&B project (empty: no peer runs)."""
    entity: str = ""
    """W&B team or user (empty: the API key's default entity)."""
    mode: str = ""
    """"online", "offline" or "disabled"; empty: ``WANDB_MODE`` or online."""

    @classmethod
    def parse(cls, spec: str | None, mode: str = "") -> "WandbTarget | None":
        """``"project"`` or ``"entity/project"``; None or empty means no W&B."""
        if not spec:
            return None
        entity, _, project = spec.rpartition("/")
        return cls(project=project, entity=entity, mode=mode)


class PeerRun(Protocol):
    """The peer's metrics sink: fed every local step, closed once."""

    def update(self, progress: PeerProgress) -> None: ...

    def close(self) -> None: ...


class NullRun:
    """W&B off: nothing is logged, nothing is imported."""

    def update(self, progress: PeerProgress) -> None:
        pass

    def close(self) -> None:
        pass


class WandbRun:
    """Logs one row per global step to an open ``wandb`` run; finishes it on close."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self._step: int | None = None
        self._loss_sum, self._losses = 0.0, 0
        self._pending: PeerProgress | None = None
        run.define_metric("global_step")
        run.define_metric("*", step_metric="global_step")

    def update(self, progress: PeerProgress) -> None:
        if self._step is not None and progress.global_step != self._step and self._pending is not None:
            self._log(self._pending)
        self._step = progress.global_step
        if progress.loss is not None:
            self._loss_sum, self._losses = self._loss_sum + progress.loss, self._losses + 1
        self._pending = progress

    def close(self) -> None:
        if self.run is None:
            return
        if self._pending is not None:
            self._log(self._pending)
        run, self.run = self.run, None
        run.finish()

    def _log(self, progress: PeerProgress) -> None:
        row: dict[str, float | int] = {
            "global_step": progress.global_step,
            "local_samples_per_s": progress.local_samples_per_s,
            "contributed_samples": progress.contributed_samples,
        }
        if self._losses:
            row["local_loss"] = self._loss_sum / self._losses
        if progress.first_contribution_s is not None:
            row["first_contribution_s"] = progress.first_contribution_s
        self.run.log(row)
        self._loss_sum, self._losses, self._pending = 0.0, 0, None


def open_wandb_run(target: WandbTarget | None, *, name: str, group: str, config: dict[str, Any]) -> PeerRun:
    """The peer's run for ``target`` (a :class:`NullRun` when W&B is off or cannot start)."""
    if target is None or not target.project:
        return NullRun()
    mode = target.mode or os.environ.get("WANDB_MODE", "") or "online"
    if mode == "disabled":
        return NullRun()
    key = secret(WANDB_API_KEY)
    if mode == "online" and not key and not _netrc_has_key():
        log.warning(
            "W&B project %r is configured, but this notebook has no W&B API key: add %s to its "
            "secrets to log your own run (training continues without it)",
            target.project,
            WANDB_API_KEY,
        )
        return NullRun()
    try:
        import wandb
    except ImportError:
        log.warning("W&B project %r is configured, but wandb is not installed (pip install wandb)", target.project)
        return NullRun()
    settings = wandb.Settings(console="off", api_key=key) if key else wandb.Settings(console="off")
    try:
        # wandb reads WANDB_DIR once per process: pass it, so a re-run cell gets the current value.
        run = wandb.init(
            project=target.project,
            entity=target.entity or None,
            name=name,
            group=group,
            job_type="peer",
            config=config,
            mode=mode,
            dir=os.environ.get("WANDB_DIR") or None,
            reinit="create_new",
            settings=settings,
        )
    except Exception as exc:  # network, permissions, a bad entity: W&B never blocks contributing
        log.warning("could not start the W&B run (%s: %s); training continues without it", type(exc).__name__, exc)
        return NullRun()
    log.info("logging this peer's metrics to W&B run %r", name)
    return WandbRun(run)


def _netrc_has_key() -> bool:
    """Whether ``wandb login`` stored a key for the W&B host in ~/.netrc (read without wandb)."""
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        auth = netrc.netrc(os.environ.get("NETRC") or None).authenticators(host)
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
    return bool(auth and auth[2])
