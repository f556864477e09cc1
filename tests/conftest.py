"""Shared fixtures: real relay, aggregator, peer and nginx processes on 127.0.0.1, always cleaned up
(relays, aggregators and nginx are the package's harness, ``relay_server.harness``: the demo's and
the benchmarks' too; peers are ``tests/support/processes.py``'s).

Every server a test starts binds port 0 and says which port it got (``--ready-file``), so no two
tests can race for a port. The one in-process relay is ``relay_server.harness.thread.RelayThread``;
the one fake clock ``tests/support/clock.py``'s. Helpers test modules share that are not fixtures
live in ``tests/support/``: no test module imports another test module, nor this one, nor a benchmark.
"""

from __future__ import annotations

import fcntl
import http.server
import json
import multiprocessing.process
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from relay_server.harness import zygote
from relay_server.harness.nginx import NGINX, NginxProcess, run_nginx
from relay_server.harness.process import AggregatorProcess, RelayProcess
from tests.support.processes import DEMO_TOKENIZER_VOCAB, REPO, PeerProcess, merged, spawn_relay, write_config

pytest_plugins = ["tests.hf_standin", "tests.hub_standin"]  # `hf_standin`, `hub_standin`: local HF Hub stand-ins

PEER_WORKER = Path(__file__).resolve().parent / "peer_worker.py"

# Fixtures that start a process or a server: a test using one is an integration test.
INTEGRATION_FIXTURES = frozenset(
    {
        "start_nginx",
        "start_relay",
        "serve_relay",
        "shared_relay",
        "start_aggregators",
        "launch_peer",
        "launch_stage_worker",
        "web_page",
        "hub",
        "hf_standin",
        "hub_standin",
        "relay_factory",
        "demo_tokenizer",
        "browser_page",
    }
)


def pytest_configure(config: pytest.Config) -> None:
    """Python processes the harness starts (relays, aggregators, peers, stage workers, expert
    hosts) are forked from a zygote that imported torch once per xdist worker
    (``relay_server.harness.zygote``): real processes, each its own, without a second of imports
    apiece. ``COLLABTRAIN_TEST_ZYGOTE=0`` starts every one fresh instead.

    Every process the tests start runs with ``PYTHONFAULTHANDLER=1`` (the zygote too, so its
    children): one that outlives the signal meant to stop it is ended with SIGABRT, which writes
    its threads' stacks into its log (``harness.process.dump_stacks_and_kill``), and the failure
    shows where it was stuck instead of a bare timeout."""
    os.environ["PYTHONFAULTHANDLER"] = "1"
    if os.environ.get("COLLABTRAIN_TEST_ZYGOTE", "1") != "0":
        zygote.enable()
    config.stash[LAUNCHES] = {}


LAUNCHES = pytest.StashKey[dict[str, int]]()
"""The launches through ``zygote.Popen`` of this run, summed over the xdist workers."""


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workeroutput"):  # an xdist worker: tell the controller
        session.config.workeroutput["zygote_launches"] = dict(zygote.LAUNCHES)
    else:
        add_launches(session.config, zygote.LAUNCHES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """(pytest-xdist's hook, on the controller) add a finished worker's launches."""
    add_launches(node.config, getattr(node, "workeroutput", {}).get("zygote_launches", {}))


def add_launches(config: pytest.Config, launches: dict[str, int]) -> None:
    counts = config.stash[LAUNCHES]
    for kind, n in launches.items():
        counts[kind] = counts.get(kind, 0) + n


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    counts = config.stash.get(LAUNCHES, {})
    if sum(counts.values()):
        terminalreporter.write_line(
            f"zygote: {counts.get('forked', 0)} Python processes forked, {counts.get('fresh', 0)} started fresh"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``integration`` every test that starts a process or a server (by the fixtures above,
    or by a ``browser``/``netns`` mark); modules that start them inline say ``pytestmark =
    pytest.mark.integration``. ``python -m pytest -m "not integration"`` is then the fast tier
    CONTRIBUTING.md names, and :func:`_unit_tests_start_nothing` keeps the marks honest."""
    for item in items:
        if INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())) or any(
            item.get_closest_marker(m) for m in ("browser", "netns")
        ):
            item.add_marker(pytest.mark.integration)
    # Slow tests (benchmarks, long fuzzing) run only when the -m expression names them: so plain
    # `pytest`, `pytest -m "not integration"` and `pytest -m slow` each mean what they say.
    if "slow" not in (config.option.markexpr or ""):
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]


@pytest.fixture(autouse=True)
def _unit_tests_start_nothing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A test not marked ``integration`` that starts a process or listens on a socket fails at
    once, naming the fix: the fast tier stays fast because it cannot start anything."""
    if request.node.get_closest_marker("integration") is None:

        def refuse(*args: object, **kwargs: object) -> None:
            raise RuntimeError(
                f"{request.node.nodeid} starts a process or a server: mark it integration "
                "(pytestmark = pytest.mark.integration, or use a fixture of INTEGRATION_FIXTURES)"
            )

        monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        monkeypatch.setattr(socket.socket, "listen", refuse)
    yield


@pytest.fixture
def closed_url() -> Iterator[str]:
    """A URL on 127.0.0.1 where nothing listens, for the whole test: its port is bound by a socket
    that never listens, so connections are refused and no other process can take the port."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{held.getsockname()[1]}"


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
    ``relay_server.harness.thread.RelayThread`` (the relay's real app and real HTTP on 127.0.0.1,
    in this process: no process start and torch import per relay), its config written to
    ``tmp_path/<name>.toml`` and its data dir ``tmp_path/<name>-data``; stopped after the test.
    For tests that never restart, kill or read the log of the relay."""
    from relay_server.core.config import load_config
    from relay_server.harness.thread import RelayThread

    relays: list[Any] = []

    def start(overrides: dict[str, dict[str, Any]] | None = None, name: str = "relay") -> Any:
        config = merged(overrides)
        config["server"] = {**config["server"], "port": 0, "data_dir": str(tmp_path / f"{name}-data")}
        relays.append(RelayThread(load_config(write_config(tmp_path / f"{name}.toml", config))).start())
        return relays[-1]

    yield start
    for relay in relays:
        relay.stop()


@pytest.fixture(scope="module")
def shared_relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """``shared_relay(overrides)`` -> ``serve_relay``'s relay, started once per module for each
    distinct ``overrides`` and shared by the module's tests that ask for it; stopped at the
    module's end. Only for tests that leave the relay as they found it (they read its run, its
    state or its parameters, or are refused before anything counts): a test that trains, joins
    peers it leaves behind, bans or restarts takes its own (``serve_relay``). Tests sharing one
    carry the same ``xdist_group`` mark, so under ``-n`` one worker runs them all on one relay."""
    from relay_server.core.config import load_config
    from relay_server.harness.thread import RelayThread

    relays: dict[str, Any] = {}

    def start(overrides: dict[str, dict[str, Any]] | None = None) -> Any:
        key = json.dumps(overrides or {}, sort_keys=True)
        if key not in relays:
            directory = tmp_path_factory.mktemp("shared-relay")
            config = merged(overrides)
            config["server"] = {**config["server"], "port": 0, "data_dir": str(directory / "data")}
            relays[key] = RelayThread(load_config(write_config(directory / "relay.toml", config))).start()
        return relays[key]

    yield start
    for relay in relays.values():
        relay.stop()


@pytest.fixture
def start_aggregators(tmp_path: Path) -> Iterator:
    """``start_aggregators(relay, *names, wait=True)`` -> AggregatorProcesses registered with ``relay``
    (started together: each takes seconds to import torch; ``wait=False`` returns at once, call
    ``wait_registered``), stopped after the test."""
    aggregators: list[AggregatorProcess] = []

    def start(relay: RelayProcess, *names: str, wait: bool = True) -> list[AggregatorProcess]:
        new = [
            AggregatorProcess(
                relay, name, tmp_path / f"{name}-data", tmp_path / f"{name}.log", extra=("--keep-versions", "1000")
            ).start(wait=False)
            for name in names
        ]
        aggregators.extend(new)
        return [a.wait_registered() for a in new] if wait else new

    yield start
    for aggregator in aggregators:
        aggregator.stop()


@pytest.fixture
def launch_peer(tmp_path: Path) -> Iterator:
    """``launch_peer(relay_url, name, seed=..., batch_size=..., steps=...)`` -> PeerProcess."""
    peers: list[PeerProcess] = []

    def launch(
        relay_url: str, name: str, *, seed: int, batch_size: int, steps: int, extra: tuple[str, ...] = ()
    ) -> PeerProcess:
        log, events = tmp_path / f"{name}.log", tmp_path / f"{name}.events.jsonl"
        proc = zygote.Popen(
            [
                sys.executable,
                str(PEER_WORKER),
                "--relay",
                relay_url,
                "--name",
                name,
                "--seed",
                str(seed),
                "--batch-size",
                str(batch_size),
                "--steps",
                str(steps),
                "--events",
                str(events),
                *extra,
            ],
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
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
        proc = zygote.Popen(
            [
                sys.executable,
                str(STAGE_WORKER),
                "--relay",
                relay_url,
                "--name",
                name,
                "--seed",
                str(seed),
                "--until-step",
                str(until_step),
                "--events",
                str(events),
                *extra,
            ],
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        workers.append(PeerProcess(name, proc, log, events))
        return workers[-1]

    yield launch
    for worker in workers:
        if worker.proc.poll() is None:
            worker.proc.kill()
            worker.proc.wait(timeout=10)


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
    from relay_server.harness.thread import RelayThread
    from tests.support.relays import hf_config

    relays: list[RelayThread] = []

    def start(**sections: dict) -> RelayThread:
        relays.append(RelayThread(hf_config(tmp_path / f"r{len(relays)}", hub.url, **sections)).start())
        return relays[-1]

    yield start
    for relay in relays:
        relay.stop()


@pytest.fixture(scope="session")
def demo_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``relay-server tokenizer train --vocab-size 200`` on the demo corpus the toolkit ships, run
    once per test run: every run with a vocabulary of 200 (evaluation, examples, loop and HF
    exactness, the dashboard) reads this one file, and training it is a process importing torch.
    Under xdist the workers share it through the run's temporary root: the first to take the lock
    trains it, the others wait and read it."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        where = tmp_path_factory.getbasetemp().parent / "demo-tokenizer"  # this run's, shared by its workers
        where.mkdir(exist_ok=True)
    else:
        where = tmp_path_factory.mktemp("demo-tokenizer")
    with open(where / "train.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (where / "tokenizer.json").exists():
            train_demo_tokenizer(where)
    return where / "tokenizer.json"


def train_demo_tokenizer(where: Path) -> None:
    config = where / "tok.toml"
    config.write_text('[auth]\nmode = "open"\n\n[dataset]\nkind = "demo_corpus"\n')
    done = zygote.run(
        [
            sys.executable,
            "-m",
            "relay_server.cli",
            "tokenizer",
            "train",
            "--config",
            str(config),
            "--vocab-size",
            str(DEMO_TOKENIZER_VOCAB),
            "--out",
            str(where / "tokenizer.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr


@pytest.fixture
def env():
    """A relay verifier and an honest peer 'alice' under one fake clock (``tests/support/auth.py``)."""
    from tests.support.auth import Env

    return Env()
