"""``relay-server trial --config run.toml``: the same machinery as the demo (:class:`.demo.LocalRun`)
on an organizer's own run: their model, objective and data with one local peer and a small target
batch (:func:`run_trial`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from relay_server.core.config import load_config
from relay_server.demo import LocalRun, ending_signals


def run_trial(
    path: str,
    *,
    steps: int | None = None,
    target_batch: int = 16,
    batch_size: int = 8,
    port: int = 0,
    threads: int = 1,
) -> int:
    """``relay-server trial``: the organizer's own run (model, objective, data, optimizer) on this
    machine before anyone joins it: a small target batch, open auth on 127.0.0.1, one local peer,
    state in a temporary directory, Hub pushes and W&B off. The dashboard stays up until Ctrl-C
    (or ``steps`` optimizer steps, then it exits). ``run.total_steps`` is kept: the learning-rate
    schedule is the run's own."""
    with ending_signals(), tempfile.TemporaryDirectory(prefix="collab-trial-") as tmp:
        directory = Path(tmp)
        config = load_config(
            path,
            overrides={
                "server": {"host": "127.0.0.1", "port": port, "data_dir": str(directory / "relay")},
                "auth": {"mode": "open"},
                "hub": {"repo_id": ""},
                "wandb": {"project": ""},
            },
        )
        own, config.run.target_batch = config.run.target_batch, target_batch  # the run's own, said in the header
        until = f"stops after {steps} step{'s' * (steps > 1)}" if steps else "until Ctrl-C"
        header = [
            f"trial:     {path} on this machine: auth open on 127.0.0.1, state in a temporary directory, "
            "no Hub pushes or W&B (the run's own data_dir is untouched)",
            f"model:     {config.model.label()}, optimizer {config.optimizer.name} (lr {config.optimizer.lr:g}, "
            f"{config.optimizer.schedule})",
            f"peers:     1 CPU process ({threads} thread{'s' * (threads > 1)}), micro-batch {batch_size}, target "
            f"batch {target_batch} (the run's own, {own}, is for the collaboration), {until}",
        ]
        local = LocalRun("trial", config, directory, peers=1, batch_size=batch_size, threads=threads, stop_after=steps)
        return local.run(header, keep=False, interrupt_ends=True)
