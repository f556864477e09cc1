"""Real server and peer processes for tests: the relay, aggregators and peers, each started the way
a user starts it (the CLI, or the peer script).

Every server binds port 0 and says which port it got (``--ready-file``), so no two tests (nor two
xdist workers) can race for a port (nginx, which cannot, is ``benchmarks/nginx.py``'s). The
fixtures that start and always stop these are ``tests/conftest.py``'s; runs are written from
:data:`BASE_CONFIG` merged with a test's overrides (:func:`merged`, :func:`write_config`).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from benchmarks.servers import toml_text

REPO = Path(__file__).resolve().parent.parent.parent

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
    """``sections`` as a TOML run configuration at ``path`` (the writer the benchmarks use)."""
    path.write_text(toml_text(sections))
    return path


def merged(overrides: dict[str, dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    config = {k: dict(v) for k, v in BASE_CONFIG.items()}
    for section, values in (overrides or {}).items():
        config.setdefault(section, {}).update(values)
    return config


def read_ready_url(ready: Path, proc: subprocess.Popen, log_path: Path, timeout_s: float, what: str) -> str:
    """Wait for ``--ready-file`` (the URL a server bound, written once it accepts connections)."""
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.05)
    return ready.read_text().strip()


@dataclass
class RelayProcess:
    """A real ``relay-server serve`` process. The first start binds port 0 and reads the port the
    relay got from its ``--ready-file``; ``kill``/``start`` then keep that port (peers hold the
    URL) and the data dir."""

    config_path: Path
    data_dir: Path
    log_path: Path
    port: int = 0
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60) -> "RelayProcess":
        ready = self.data_dir.parent / f"{self.data_dir.name}.ready"
        ready.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "relay_server.cli",
                "serve",
                "--config",
                str(self.config_path),
                "--port",
                str(self.port),
                "--data-dir",
                str(self.data_dir),
                "--ready-file",
                str(ready),
            ],
            stdout=open(self.log_path, "a"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
        )
        url = read_ready_url(ready, self.proc, self.log_path, timeout_s, "relay")
        self.port = int(url.rsplit(":", 1)[1])
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def status(self) -> dict[str, Any]:
        return requests.get(self.url + "/api/status", timeout=10).json()

    def durable_step(self) -> int:
        """The step the relay's database says is durable (read while the relay is down: what a
        restart must resume at)."""
        with sqlite3.connect(self.data_dir / "relay.sqlite") as db:
            return int(db.execute("SELECT value FROM meta WHERE key = 'step'").fetchone()[0])

    def round_steps(self) -> list[int]:
        """Every step the relay recorded a round for, in order (contiguous from 1 when no step was
        lost or applied twice)."""
        with sqlite3.connect(self.data_dir / "relay.sqlite") as db:
            return [s for (s,) in db.execute("SELECT step FROM rounds ORDER BY step")]

    def wait_for(self, predicate, timeout_s: float = 60, what: str = "condition") -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                status = self.status()
            except requests.ConnectionError:
                status = None
            if status is not None and predicate(status):
                return status
            time.sleep(0.05)
        raise TimeoutError(
            f"timed out waiting for {what}; last status: {status}\n"
            f"relay log tail:\n{self.log_path.read_text()[-2000:]}"
        )


def spawn_relay(
    directory: Path, overrides: dict[str, dict[str, Any]] | None = None, name: str = "relay"
) -> RelayProcess:
    """Write the merged config into ``directory`` and start a relay process (on port 0: the port it
    bound is read back)."""
    config = write_config(directory / f"{name}.toml", merged(overrides))
    return RelayProcess(config, directory / f"{name}-data", directory / f"{name}.log").start()


@dataclass
class AggregatorProcess:
    """A real ``relay-server aggregator`` process registered with ``relay``, on port 0 (the port it
    bound is read from its ``--ready-file``)."""

    relay: RelayProcess
    name: str
    data_dir: Path
    log_path: Path
    port: int = 0
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ready_path(self) -> Path:
        return self.data_dir.parent / f"{self.data_dir.name}.ready"

    def start(self) -> "AggregatorProcess":
        self.ready_path.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "relay_server.cli",
                "aggregator",
                "--coordinator",
                self.relay.url,
                "--port",
                str(self.port),
                "--data-dir",
                str(self.data_dir),
                "--name",
                self.name,
                "--admin-token-file",
                str(self.relay.data_dir / "admin_token"),
                "--ready-file",
                str(self.ready_path),
                "--keep-versions",
                "1000",
            ],
            stdout=open(self.log_path, "a"),
            stderr=subprocess.STDOUT,
        )
        return self

    def wait_registered(self, timeout_s: float = 60) -> "AggregatorProcess":
        deadline = time.monotonic() + timeout_s
        url = read_ready_url(self.ready_path, self.proc, self.log_path, timeout_s, "aggregator")  # listening
        self.port = int(url.rsplit(":", 1)[1])
        while not self.status().get("aggregator_id"):  # then registered
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"aggregator exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"aggregator did not register:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.05)
        return self

    def status(self) -> dict[str, Any]:
        return requests.get(self.url + "/api/status", timeout=10).json()

    kill, stop = RelayProcess.kill, RelayProcess.stop


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
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"peer {self.name} still running; log:\n{self.log_path.read_text()[-2000:]}") from None
