"""Weights & Biases logging from the relay: one W&B run per collaboration, one row per step.

Why the relay logs: it is the only place that sees every round -- the averaged loss, who
contributed, the deadline that closed the round, the plan -- whatever peers come and go. (Each
peer may log its own run as well; that is the toolkit's business.)

The W&B run is named ``run.name`` and its id is kept in ``<data_dir>/wandb-run-id``, so a relay
restart continues the same run. Rows carry an explicit ``step`` metric that every chart uses as
its x axis, rather than W&B's own monotonic ``_step``: a rollback makes steps go backwards, and
W&B would drop those rows.

Every row carries the training bytes per applied sample both ways (``bytes_per_sample/up`` and
``/down``, since the relay started: :mod:`relay_server.rounds.traffic`); a ``run.mode =
"local_sgd"`` run adds the peers' mean busy fraction and the mean inner steps behind the outer
round (``local_sgd/busy_fraction``, ``local_sgd/inner_steps``).

``wandb.init`` (seconds: it starts W&B's service process) runs on a helper thread at startup, so a
misconfigured project or a missing API key shows up in the relay log right away, without holding
up the relay. Any W&B failure turns logging off with one error line; rounds never wait on it.

With ``[evaluation]``, each evaluated version adds a row ``eval/loss``, ``eval/perplexity``,
``eval/accuracy`` at its step and an ``eval/samples`` table (step, prompt, kind, output): the
evaluator's thread calls :meth:`WandbObserver.on_evaluation`, so the backlog takes a lock.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from pathlib import Path
from typing import Any

from relay_server.core.config import ConfigError, RelayConfig
from relay_server.observers.events import StepEvent
from relay_server.rounds.master import lr_at
from relay_server.rounds.throughput import RATE_WINDOW
from relay_server.rounds.throughput import measured_samples_per_s as measured
from toolkit.wire.protocol import EvalRecord, RoundRecord

log = logging.getLogger(__name__)

INIT_TIMEOUT_S = 60.0  # close() waits this long for a wandb.init still starting
MAX_BACKLOG = 10_000  # rows kept while wandb.init is still starting (the observer thread never waits)
RUN_ID_FILE = "wandb-run-id"


def measured_samples_per_s(rounds: list[RoundRecord], window: int = RATE_WINDOW) -> float | None:
    """Samples/s over the last ``window`` rounds, from their finalization times (None: < 2 rounds).

    Unlike the peers' self-reported rates this counts only samples that made it into a step."""
    return measured([(r.finalized_at, r.samples) for r in rounds], window)[0]


def step_metrics(event: StepEvent, config: RelayConfig) -> dict[str, Any]:
    """The row logged for one step (also what the tests expect to find in the run files)."""
    status, record = event.status, event.record
    row: dict[str, Any] = {
        "step": event.step,
        "samples": record.samples,
        "samples_total": sum(entry.samples for entry in status.leaderboard),
        "contributors": record.contributors,
        "samples_per_s": status.samples_per_s,
        "peers_online": status.num_peers,
        "step_duration_s": record.duration_s,
        "deadline_s": record.deadline_s,
        "finalized_by": record.finalized_by,
        # the update that produced version `step` used the schedule's value at `step - 1`
        "lr": lr_at(event.step - 1, config.master_optimizer(), config.run.total_steps),
    }
    if record.loss is not None:
        row["loss"] = record.loss
    measured = measured_samples_per_s(status.recent_rounds)
    if measured is not None:
        row["samples_per_s_measured"] = measured
    if status.plan is not None:
        row["plan/aggregators"] = len(status.plan.slices)
        row["plan/version"] = status.plan.version
        if status.plan.steps_per_s is not None:
            row["plan/steps_per_s"] = status.plan.steps_per_s
    traffic = status.traffic
    if traffic is not None and traffic.samples:  # since the relay started: what the low-bandwidth benchmark compares
        row["bytes_per_sample/up"] = traffic.up_bytes_per_sample
        row["bytes_per_sample/down"] = traffic.down_bytes_per_sample
    local = status.local_sgd
    if local is not None:
        if local.busy_fraction is not None:
            row["local_sgd/busy_fraction"] = local.busy_fraction
        if local.inner_steps_last_round is not None:
            row["local_sgd/inner_steps"] = local.inner_steps_last_round
    return row


class WandbObserver:
    """Observer that logs :func:`step_metrics` to a W&B run (``wandb.project`` is set)."""

    def __init__(self, config: RelayConfig) -> None:
        try:
            import wandb  # noqa: F401  (fail here, with the fix, rather than on the helper thread)
        except ImportError:
            raise ConfigError(
                "wandb.project is set but the wandb package is missing: pip install wandb, or clear wandb.project"
            ) from None
        self.config = config
        self.data_dir = Path(config.server.data_dir)
        self.run: Any = None  # wandb.Run once started
        self._summary_sent = False
        self._backlog: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (run summary, row)
        self._lock = threading.Lock()  # the observers' thread and the evaluator's both log
        self._ready = threading.Event()
        threading.Thread(target=self._start, name="wandb-init", daemon=True).start()

    def _run_id(self) -> str:
        """The id this data dir logs to: created once, reused after a restart."""
        path = self.data_dir / RUN_ID_FILE
        if path.exists():
            return path.read_text().strip()
        run_id = secrets.token_hex(4)  # W&B ids: lower-case letters and digits
        self.data_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(run_id)
        return run_id

    def _start(self) -> None:
        import wandb

        section = self.config.wandb
        try:
            run = wandb.init(
                project=section.project,
                entity=section.entity or None,
                mode=section.mode or None,  # type: ignore[arg-type]  # one of wandb's: the config checked
                name=self.config.run.name,
                id=self._run_id(),
                resume="allow",
                job_type="relay",
                # W&B's files go with the rest of the run's state unless WANDB_DIR says otherwise
                dir=None if os.environ.get("WANDB_DIR") else str(self.data_dir),
                config={
                    "run_name": self.config.run.name,
                    "total_steps": self.config.run.total_steps,
                    "model_kwargs": dict(self.config.model.kwargs),
                },
                settings=wandb.Settings(console="off", reinit="create_new"),
            )
            run.define_metric("step")
            run.define_metric("*", step_metric="step")
            self.run = run
            log.info("W&B run %s (%s) logging to project %s", run.name, run.id, section.project)
        except Exception as exc:
            log.error(
                "W&B logging is off: %s: %s. Check wandb.project/wandb.entity, and WANDB_API_KEY in the "
                'relay\'s environment (or set wandb.mode = "offline")',
                type(exc).__name__,
                exc,
            )
        finally:
            self._ready.set()

    def on_step(self, event: StepEvent) -> None:
        summary = event.status.config.to_json() if event.status.config is not None else {}
        self._add(summary, step_metrics(event, self.config))

    def on_evaluation(self, record: EvalRecord) -> None:
        """A version's validation metrics and samples (``[evaluation]``), at its step."""
        row: dict[str, Any] = {"step": record.step, "eval/loss": record.loss}
        for name in ("perplexity", "accuracy"):
            if getattr(record, name) is not None:
                row[f"eval/{name}"] = getattr(record, name)
        if record.samples:
            import wandb

            row["eval/samples"] = wandb.Table(
                columns=["step", "prompt", "kind", "output"],
                data=[[record.step, s.prompt, s.kind, s.output] for s in record.samples],
            )
        self._add({}, row)

    def _add(self, summary: dict[str, Any], row: dict[str, Any]) -> None:
        with self._lock:
            self._backlog.append((summary, row))
            del self._backlog[:-MAX_BACKLOG]
            if self._ready.is_set():
                self._flush()

    def _flush(self) -> None:
        backlog, self._backlog = self._backlog, []
        if self.run is None:
            return  # wandb.init failed (logged once): drop the rows
        for summary, row in backlog:
            if not self._summary_sent and summary:
                # the run summary needs the parameter count, known once the relay built the model
                self.run.config.update(summary, allow_val_change=True)
                self._summary_sent = True
            self.run.log(row)

    def close(self) -> None:
        if not self._ready.wait(INIT_TIMEOUT_S):
            log.warning(
                "wandb.init did not finish within %.0fs; %d step(s) not logged", INIT_TIMEOUT_S, len(self._backlog)
            )
            return
        with self._lock:
            self._flush()
        if self.run is not None:
            self.run.finish()
            self.run = None
