"""``relay-server trial --config run.toml``: the same machinery as the demo (:class:`.demo.LocalRun`)
on an organizer's own run: their model, objective and data with local peers before anyone joins.

A data-parallel run gets one local peer and a small target batch (any batch trains the same
model). A pipeline run (``[pipeline] enabled``) cannot: a batch only steps once every stage ran
it, so the trial starts one local stage worker per stage, and keeps the run's batch shape
(``microbatch_size x microbatches_per_batch = run.target_batch``) unless ``--batch-size`` or
``--target-batch`` change it -- then the header says what changed. Before anything starts, the
workers' and the relay's predicted memory (:mod:`toolkit.pipeline.worker_memory`) is held against what
this machine has available: a trial that cannot fit ends in one line saying so.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from relay_server.core.config import ConfigError, RelayConfig, load_config
from relay_server.demo import LocalRun, ending_signals

DEFAULT_TARGET_BATCH, DEFAULT_BATCH_SIZE = 16, 8
"""A data-parallel trial's batch when the command line gives none."""


def run_trial(
    path: str,
    *,
    steps: int | None = None,
    target_batch: int | None = None,
    batch_size: int | None = None,
    port: int = 0,
    threads: int = 1,
) -> int:
    """``relay-server trial``: the organizer's own run (model, objective, data, optimizer) on this
    machine before anyone joins it: open auth on 127.0.0.1, local peers, state in a temporary
    directory, Hub pushes and W&B off. The dashboard stays up until Ctrl-C (or ``steps``
    optimizer steps, then it exits). ``run.total_steps`` is kept: the learning-rate schedule is
    the run's own. ``target_batch`` and ``batch_size`` None: a data-parallel run's trial takes
    16 and 8, a pipeline run keeps its own batch shape."""
    with ending_signals(), tempfile.TemporaryDirectory(prefix="collab-trial-") as tmp:
        directory = Path(tmp)
        local: dict[str, dict[str, Any]] = {
            "server": {"host": "127.0.0.1", "port": port, "data_dir": str(directory / "relay")},
            "auth": {"mode": "open"},
            "hub": {"repo_id": ""},
            "wandb": {"project": ""},
        }
        config = load_config(path, overrides=local)
        if config.pipeline.enabled:
            return _pipeline_trial(path, config, local, directory, steps, target_batch, batch_size, threads)
        own = config.run.target_batch
        target_batch, batch_size = target_batch or DEFAULT_TARGET_BATCH, batch_size or DEFAULT_BATCH_SIZE
        config.run.target_batch = target_batch  # the run's own, said in the header
        header = [
            _where(path),
            _model(config),
            f"peers:     1 CPU process ({threads} thread{'s' * (threads > 1)}), micro-batch {batch_size}, target "
            f"batch {target_batch} (the run's own, {own}, is for the collaboration), {_until(steps)}",
        ]
        run = LocalRun("trial", config, directory, peers=1, batch_size=batch_size, threads=threads, stop_after=steps)
        return run.run(header, keep=False, interrupt_ends=True)


def pipeline_batch(
    microbatch_size: int, microbatches: int, target_batch: int | None, batch_size: int | None
) -> tuple[int, int, str]:
    """The trial's (micro-batch size, micro-batches per batch) for a pipeline run whose own are
    ``microbatch_size`` x ``microbatches``, and the header's line saying what changed. Neither
    option given: the run's own. ``batch_size`` sets the micro-batch, ``target_batch`` the batch
    (default: the run's); the batch must be a whole number of micro-batches, or one line says so."""
    own = microbatch_size * microbatches
    if target_batch is None and batch_size is None:
        return (
            microbatch_size,
            microbatches,
            f"batch:     the run's own: {microbatches} micro-batches of {microbatch_size} = target batch {own} "
            "(unchanged; --batch-size / --target-batch change it)",
        )
    size = batch_size or microbatch_size
    batch = target_batch or own
    if batch % size:
        raise ConfigError(
            f"--target-batch {batch} is not a whole number of micro-batches of {size} (a pipeline batch is "
            f"pipeline.microbatch_size x pipeline.microbatches_per_batch): pick a multiple of {size}"
        )
    flags = " and ".join(
        f"{flag} {value}" for flag, value in (("--batch-size", batch_size), ("--target-batch", target_batch)) if value
    )
    return (
        size,
        batch // size,
        f"batch:     {batch // size} micro-batches of {size} = target batch {batch} (changed by {flags}; the run's "
        f"own, {microbatches} micro-batches of {microbatch_size} = {own}, is for the collaboration)",
    )


def _pipeline_trial(
    path: str,
    config: RelayConfig,
    local: dict[str, dict[str, Any]],
    directory: Path,
    steps: int | None,
    target_batch: int | None,
    batch_size: int | None,
    threads: int,
) -> int:
    """One local stage worker per stage, the run's batch shape unless the options change it."""
    from relay_server.pipeline.model_cut import cut_model
    from relay_server.pipeline.run_memory import predict_memory

    cfg = config.pipeline
    size, count, batch_line = pipeline_batch(cfg.microbatch_size, cfg.microbatches_per_batch, target_batch, batch_size)
    if (size, count) != (cfg.microbatch_size, cfg.microbatches_per_batch):  # loaded again: every check on the change
        changed = {"microbatch_size": size, "microbatches_per_batch": count}
        config = load_config(path, overrides={**local, "run": {"target_batch": size * count}, "pipeline": changed})
    cut = cut_model(config)
    stages = len(cut.layers)
    memory = predict_memory(config, cut)
    need, available = memory.total_bytes(), available_memory()
    if available is not None and need > available:
        raise ConfigError(
            f"the trial cannot run this pipeline here: its {stages} stage workers and the relay need about "
            f"{need / 2**20:.0f} MiB (workers {', '.join(f'{w / 2**20:.0f}' for w in memory.worker_bytes())} MiB, "
            f"relay {memory.relay.total / 2**20:.0f} MiB; GET /api/pipeline names the terms) and this machine has "
            f"{available / 2**20:.0f} MiB available: try it on a machine with more memory, or a smaller "
            "pipeline.microbatch_size (--batch-size)"
        )
    each = max(1, threads // stages)
    header = [
        _where(path),
        _model(config),
        f"pipeline:  {stages} stages (layers {cut.layers}); the trial starts one local stage worker per stage",
        f"workers:   {stages} CPU processes ({each} thread{'s' * (each > 1)} each), {_until(steps)}",
        batch_line,
        f"memory:    predicted {need / 2**20:.0f} MiB in all (workers "
        f"{', '.join(f'{w / 2**20:.0f}' for w in memory.worker_bytes())} MiB, relay {memory.relay.total / 2**20:.0f} "
        f"MiB){f', {available / 2**20:.0f} MiB available' if available is not None else ''}",
    ]
    run = LocalRun("trial", config, directory, peers=stages, batch_size=size, threads=each, stop_after=steps)
    return run.run(header, keep=False, interrupt_ends=True)


def available_memory() -> int | None:
    """Bytes this machine can still give processes (Linux's MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX
        return None


def _where(path: str) -> str:
    return (
        f"trial:     {path} on this machine: auth open on 127.0.0.1, state in a temporary directory, "
        "no Hub pushes or W&B (the run's own data_dir is untouched)"
    )


def _model(config: RelayConfig) -> str:
    return (
        f"model:     {config.model.label()}, optimizer {config.optimizer.name} (lr {config.optimizer.lr:g}, "
        f"{config.optimizer.schedule})"
    )


def _until(steps: int | None) -> str:
    return f"stops after {steps} step{'s' * (steps > 1)}" if steps else "until Ctrl-C"
