"""Shared fixtures: real relay, aggregator and peer processes on 127.0.0.1, always cleaned up.

Every server a test starts binds port 0 and says which port it got (``--ready-file``), so no two
tests can race for a port. The one fake clock is :class:`Clock`; the one in-process relay is
``tests/support/relays.py``'s ``InProcessRelay``. Helpers test modules share that are not fixtures
live in ``tests/support/``: no test module imports another test module.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

pytest_plugins = ["tests.hf_standin"]  # the `hf_standin` fixture: a local stand-in for the HF Hub API

REPO = Path(__file__).resolve().parent.parent
PEER_WORKER = Path(__file__).resolve().parent / "peer_worker.py"

# A small, fast, deterministic run: the MLP regression model, strict large-batch semantics.
BASE_CONFIG: dict[str, dict[str, Any]] = {
    "run": {"name": "test-run", "target_batch": 48, "total_steps": 0, "max_staleness": 0, "seed": 0},
    "model": {"factory": "toolkit.models:MLP", "kwargs": {"sizes": [8, 16, 1]}},
    "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.01, "betas": [0.9, 0.99],
                  "clip_grad_norm": 0.0, "schedule": "constant"},
    "rounds": {"heartbeat_interval_s": 0.3, "peer_ttl_s": 2.0, "deadline_floor_s": 2.0,
               "deadline_ceiling_s": 60.0, "deadline_initial_s": 30.0},
    "server": {"host": "127.0.0.1", "keep_checkpoints": 1000},
    "auth": {"mode": "open"},
}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)


def write_config(path: Path, sections: dict[str, dict[str, Any]]) -> Path:
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def merged(overrides: dict[str, dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    config = {k: dict(v) for k, v in BASE_CONFIG.items()}
    for section, values in (overrides or {}).items():
        config.setdefault(section, {}).update(values)
    return config


def free_port() -> int:
    """A port nothing listens on right now, for third-party servers that cannot bind port 0 and
    report it (nginx): another process may take it before the server binds it, so start such a
    server through :func:`on_free_port`, which picks again when that happens. Our own servers
    (relay, aggregator, demo) bind port 0 and say which port they got: never pick one for them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def closed_url() -> Iterator[str]:
    """A URL on 127.0.0.1 where nothing listens, for the whole test: its port is bound by a socket
    that never listens, so connections are refused and no other process can take the port."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{held.getsockname()[1]}"


class PortTaken(Exception):
    """Raised by a ``start(port)`` given to :func:`on_free_port` when the port was taken meanwhile."""


def on_free_port(start, attempts: int = 5):
    """``start(port)`` on a free port, again on another one while it raises :class:`PortTaken`: the
    race between picking a port and a third-party server binding it, closed by retrying."""
    for attempt in range(attempts):
        try:
            return start(free_port())
        except PortTaken:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


@dataclass
class NginxProcess:
    """A real nginx (Debian's) in the foreground, all its files in ``directory``; no root needed."""

    proc: subprocess.Popen
    port: int
    directory: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def run_nginx(directory: Path, http_block: Callable[[int], str], port: int = 0) -> NginxProcess:
    """nginx on a free port (:func:`on_free_port`: nginx cannot listen on port 0, so a port is
    picked, and picked again if another process took it first), or on ``port`` (:class:`PortTaken`
    if it is taken). ``http_block(port)`` is the text inside ``http { }``; its server listens on
    127.0.0.1:port."""
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / "error.log"
    temp = "\n".join(f"    {kind}_temp_path {directory / kind};" for kind in
                     ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    user = "user root;\n" if os.geteuid() == 0 else ""  # workers may read what the test wrote

    def start(port: int) -> NginxProcess:
        conf = directory / "nginx.conf"
        conf.write_text(f"{user}worker_processes 1;\nevents {{ worker_connections 1024; }}\nhttp {{\n"
                        f"    access_log off;\n{temp}\n{http_block(port)}}}\n")
        log.unlink(missing_ok=True)
        proc = subprocess.Popen([NGINX, "-p", str(directory), "-c", str(conf), "-g",
                                 f"daemon off; pid {directory / 'nginx.pid'}; error_log {log} info;"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return NginxProcess(proc, port, directory)
            except OSError:
                time.sleep(0.05)
        proc.kill()
        proc.wait(timeout=10)
        text = log.read_text() if log.exists() else ""
        if "Address already in use" in text:
            raise PortTaken(port)
        raise RuntimeError(f"nginx did not start:\n{text[-3000:]}")

    return start(port) if port else on_free_port(start)


@pytest.fixture
def start_nginx(tmp_path: Path) -> Iterator:
    """``start_nginx(http_block)`` -> a running :class:`NginxProcess`, stopped after the test;
    ``http_block(port)`` returns what goes inside ``http { }`` for the port nginx will listen on
    (called again with another port if that one was taken). Skips when nginx is not installed."""
    if NGINX is None:
        pytest.skip("nginx is missing: apt-get install -y nginx (Debian's build: ssl, realip, proxy_cache)")
    started: list[NginxProcess] = []

    def start(http_block: Callable[[int], str]) -> NginxProcess:
        started.append(run_nginx(tmp_path / f"nginx-{len(started)}", http_block))
        return started[-1]

    yield start
    for nginx in started:
        nginx.stop()


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
            [sys.executable, "-m", "relay_server.cli", "serve", "--config", str(self.config_path),
             "--port", str(self.port), "--data-dir", str(self.data_dir), "--ready-file", str(ready)],
            stdout=open(self.log_path, "a"), stderr=subprocess.STDOUT, env={**os.environ, **self.env})
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
        raise TimeoutError(f"timed out waiting for {what}; last status: {status}\n"
                           f"relay log tail:\n{self.log_path.read_text()[-2000:]}")


def spawn_relay(directory: Path, overrides: dict[str, dict[str, Any]] | None = None,
                name: str = "relay") -> RelayProcess:
    """Write the merged config into ``directory`` and start a relay process (on port 0: the port it
    bound is read back)."""
    config = write_config(directory / f"{name}.toml", merged(overrides))
    return RelayProcess(config, directory / f"{name}-data", directory / f"{name}.log").start()


@pytest.fixture
def start_relay(tmp_path: Path) -> Iterator:
    """``start_relay(overrides)`` -> a running RelayProcess, stopped after the test."""
    relays: list[RelayProcess] = []

    def start(overrides: dict[str, dict[str, Any]] | None = None, name: str = "relay") -> RelayProcess:
        relays.append(spawn_relay(tmp_path, overrides, name))
        return relays[-1]

    yield start
    for relay in relays:
        relay.stop()


@pytest.fixture
def serve_relay(tmp_path: Path) -> Iterator:
    """``serve_relay(overrides)`` -> the same run as ``start_relay``'s, served by
    ``tests.support.relays.InProcessRelay`` (the relay's real app and real HTTP on 127.0.0.1, in
    this process: no process start and torch import per relay), its config written to
    ``tmp_path/<name>.toml`` and its data dir ``tmp_path/<name>-data``; stopped after the test.
    For tests that never restart, kill or read the log of the relay."""
    from relay_server.core.config import load_config
    from tests.support.relays import InProcessRelay

    relays: list[Any] = []

    def start(overrides: dict[str, dict[str, Any]] | None = None, name: str = "relay") -> Any:
        config = merged(overrides)
        config["server"] = {**config["server"], "port": 0, "data_dir": str(tmp_path / f"{name}-data")}
        relays.append(InProcessRelay(load_config(write_config(tmp_path / f"{name}.toml", config))))
        return relays[-1]

    yield start
    for relay in relays:
        relay.stop()


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
            [sys.executable, "-m", "relay_server.cli", "aggregator", "--coordinator", self.relay.url,
             "--port", str(self.port), "--data-dir", str(self.data_dir), "--name", self.name,
             "--admin-token-file", str(self.relay.data_dir / "admin_token"), "--ready-file", str(self.ready_path),
             "--keep-versions", "1000"],
            stdout=open(self.log_path, "a"), stderr=subprocess.STDOUT)
        return self

    def wait_registered(self, timeout_s: float = 60) -> "AggregatorProcess":
        deadline = time.monotonic() + timeout_s
        url = read_ready_url(self.ready_path, self.proc, self.log_path, timeout_s, "aggregator")  # listening
        self.port = int(url.rsplit(":", 1)[1])
        while not self.status().get("aggregator_id"):  # then registered
            if self.proc.poll() is not None:
                raise RuntimeError(f"aggregator exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"aggregator did not register:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.05)
        return self

    def status(self) -> dict[str, Any]:
        return requests.get(self.url + "/api/status", timeout=10).json()

    kill, stop = RelayProcess.kill, RelayProcess.stop


@pytest.fixture
def start_aggregators(tmp_path: Path) -> Iterator:
    """``start_aggregators(relay, *names, wait=True)`` -> AggregatorProcesses registered with ``relay``
    (started together: each takes seconds to import torch; ``wait=False`` returns at once, call
    ``wait_registered``), stopped after the test."""
    aggregators: list[AggregatorProcess] = []

    def start(relay: RelayProcess, *names: str, wait: bool = True) -> list[AggregatorProcess]:
        new = [AggregatorProcess(relay, name, tmp_path / f"{name}-data", tmp_path / f"{name}.log").start()
               for name in names]
        aggregators.extend(new)
        return [a.wait_registered() for a in new] if wait else new

    yield start
    for aggregator in aggregators:
        aggregator.stop()


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


@pytest.fixture
def launch_peer(tmp_path: Path) -> Iterator:
    """``launch_peer(relay_url, name, seed=..., batch_size=..., steps=...)`` -> PeerProcess."""
    peers: list[PeerProcess] = []

    def launch(relay_url: str, name: str, *, seed: int, batch_size: int, steps: int,
               extra: tuple[str, ...] = ()) -> PeerProcess:
        log, events = tmp_path / f"{name}.log", tmp_path / f"{name}.events.jsonl"
        proc = subprocess.Popen(
            [sys.executable, str(PEER_WORKER), "--relay", relay_url, "--name", name, "--seed", str(seed),
             "--batch-size", str(batch_size), "--steps", str(steps), "--events", str(events), *extra],
            stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO)
        peer = PeerProcess(name, proc, log, events)
        peers.append(peer)
        return peer

    yield launch
    for peer in peers:
        if peer.proc.poll() is None:
            peer.proc.kill()
            peer.proc.wait(timeout=10)


STAGE_WORKER = Path(__file__).resolve().parent / "stage_worker.py"


@pytest.fixture
def launch_stage_worker(tmp_path: Path) -> Iterator:
    """``launch_stage_worker(relay_url, name, seed=..., until_step=...)`` -> PeerProcess running
    ``tests/stage_worker.py`` (the toolkit's pipeline StageWorker on deterministic data)."""
    workers: list[PeerProcess] = []

    def launch(relay_url: str, name: str, *, seed: int, until_step: int, extra: tuple[str, ...] = ()) -> PeerProcess:
        log, events = tmp_path / f"{name}.log", tmp_path / f"{name}.events.jsonl"
        proc = subprocess.Popen(
            [sys.executable, str(STAGE_WORKER), "--relay", relay_url, "--name", name, "--seed", str(seed),
             "--until-step", str(until_step), "--events", str(events), *extra],
            stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO)
        workers.append(PeerProcess(name, proc, log, events))
        return workers[-1]

    yield launch
    for worker in workers:
        if worker.proc.poll() is None:
            worker.proc.kill()
            worker.proc.wait(timeout=10)


class BytesStream:
    """The ``readexactly`` of aiohttp's StreamReader, over bytes."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    async def readexactly(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise asyncio.IncompleteReadError(self.data[self.pos:], n)
        self.pos += n
        return self.data[self.pos - n:self.pos]


@dataclass
class Clock:
    """A clock a test moves by hand (``clock.now += 5``): pass it where code takes ``clock=``."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def wait_until(predicate, timeout_s: float, what: str):
    """Poll ``predicate`` every 50 ms until it returns something truthy (returned), or raise
    ``TimeoutError`` naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


class WebPage(http.server.BaseHTTPRequestHandler):
    """A web server that is not a relay: /api/run and /api/toolkit are HTML pages, everything else a
    404 page."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        status = 200 if self.path in ("/api/run", "/api/toolkit") else 404
        body = b"<!doctype html><html><body><h1>Welcome to nginx!</h1></body></html>"
        self.send_response(status)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def web_page() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), WebPage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """W&B scoped to this test: offline, files under tmp_path, no key (inherited by relay processes)."""
    directory = tmp_path / "wandb-dir"
    directory.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(directory))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return directory


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The local Hugging Face stand-in with the users of ``tests.support.peers.TOKENS``."""
    from tests.support.peers import standin

    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    server = standin()
    yield server
    server.stop()


@pytest.fixture
def relay_factory(tmp_path: Path, hub: Any) -> Iterator:
    """``relay_factory(**sections)`` -> an in-process hf-mode relay (``tests.support.relays.hf_config``:
    SGD at lr 1, shard leases) whose identity provider is ``hub``, stopped after the test."""
    from tests.support.relays import InProcessRelay, hf_config

    relays: list[InProcessRelay] = []

    def start(**sections: dict) -> InProcessRelay:
        relays.append(InProcessRelay(hf_config(tmp_path / f"r{len(relays)}", hub.url, **sections)))
        return relays[-1]

    yield start
    for relay in relays:
        relay.stop()


DEMO_TOKENIZER_VOCAB = 200


@pytest.fixture(scope="session")
def demo_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``relay-server tokenizer train --vocab-size 200`` on the demo corpus the toolkit ships, run
    once per session: every run with a vocabulary of 200 (evaluation, examples, loop and HF
    exactness, the dashboard) reads this one file, and training it is a process importing torch."""
    where = tmp_path_factory.mktemp("demo-tokenizer")
    config = where / "tok.toml"
    config.write_text('[auth]\nmode = "open"\n\n[dataset]\nkind = "demo_corpus"\n')
    done = subprocess.run([sys.executable, "-m", "relay_server.cli", "tokenizer", "train", "--config", str(config),
                           "--vocab-size", str(DEMO_TOKENIZER_VOCAB), "--out", str(where / "tokenizer.json")],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return where / "tokenizer.json"


@pytest.fixture
def env():
    """A relay verifier and an honest peer 'alice' under one fake clock (``tests/support/auth.py``)."""
    from tests.support.auth import Env

    return Env()
