"""The tests' runs and peer processes, on the package's harness (``relay_server.harness``).

Relay and aggregator processes are :mod:`relay_server.harness.process`'s (the demo's and the
benchmarks' too): every server binds port 0 and says which port it got (``--ready-file``), so no
two tests (nor two xdist workers) can race for a port. The fixtures that start and always stop
them are ``tests/conftest.py``'s; runs are written from :data:`BASE_CONFIG` merged with a test's
overrides (:func:`merged`, :func:`write_config`).
"""

from __future__ import annotations

import json
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relay_server.harness.process import RelayProcess, toml_text, wait_exit

REPO = Path(__file__).resolve().parent.parent.parent

DEMO_TOKENIZER_VOCAB = 200
"""The vocabulary of conftest's session-wide ``demo_tokenizer``: every run that reads that one file
(evaluation, examples, loop and HF exactness, the dashboard) builds its model for this size."""

# A small, fast, deterministic run: the MLP regression model, strict large-batch semantics.
BASE_CONFIG: dict[str, dict[str, Any]] = {
    "run": {"name": "test-run", "target_batch": 48, "total_steps": 0, "max_staleness": 0, "seed": 0},
    "model": {"factory": "toolkit.models:MLP", "kwargs": {"sizes": [8, 16, 1]}},
    "optimizer": {
        "name": "adamw",
        "lr": 0.01,
        "weight_decay": 0.01,
        "betas": [0.9, 0.99],
        "clip_grad_norm": 0.0,
        "schedule": "constant",
    },
    "rounds": {
        "heartbeat_interval_s": 0.3,
        "peer_ttl_s": 2.0,
        "deadline_floor_s": 2.0,
        "deadline_ceiling_s": 60.0,
        "deadline_initial_s": 30.0,
    },
    "server": {"host": "127.0.0.1", "keep_checkpoints": 1000},
    "auth": {"mode": "open"},
}


def write_config(path: Path, sections: dict[str, dict[str, Any]]) -> Path:
    """``sections`` as a TOML run configuration at ``path`` (the harness's writer, the benchmarks' too)."""
    path.write_text(toml_text(sections))
    return path


def merged(overrides: dict[str, dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    config = {k: dict(v) for k, v in BASE_CONFIG.items()}
    for section, values in (overrides or {}).items():
        config.setdefault(section, {}).update(values)
    return config


def spawn_relay(
    directory: Path, overrides: dict[str, dict[str, Any]] | None = None, name: str = "relay"
) -> RelayProcess:
    """Write the merged config into ``directory`` and start a relay process (on port 0: the port it
    bound is read back)."""
    config = write_config(directory / f"{name}.toml", merged(overrides))
    return RelayProcess(config, directory / f"{name}-data", directory / f"{name}.log").start()


@dataclass
class PeerProcess:
    name: str
    proc: subprocess.Popen
    log_path: Path
    events_path: Path

    def events(self) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        return [json.loads(line) for line in self.events_path.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        """Finish the micro-batch in hand (and the round it is in), log it, leave (SIGUSR1)."""
        self.proc.send_signal(signal.SIGUSR1)

    def wait(self, timeout_s: float = 120) -> int:
        """Its exit code; if it is still running after ``timeout_s``, it is ended with its threads'
        stacks written to its log (:func:`dump_stacks_and_kill`), and the error shows them."""
        return wait_exit(self.proc, timeout_s, f"peer {self.name}", self.log_path)
