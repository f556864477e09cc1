"""How every benchmark starts the relay-server processes it measures.

One way, so that each benchmark's setup is the production CLI and nothing beside it:
``relay-server serve`` (or ``aggregator``) binds port 0 and writes its URL to ``--ready-file``,
which is read back, so two runs on one machine never race for a port; the process logs into its
folder, and the log's tail is in the error when the server exits or does not listen in time (a
relay refusing its configuration says why in its last line, which ``low_bandwidth.py`` reports).

The tests have their own harness (``tests/conftest.py``); benchmarks import no test module, and
this module imports no other benchmark, so both ``from servers import ...`` (a benchmark run as a
script) and ``from benchmarks.servers import ...`` work.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RELAY_CLI = [sys.executable, "-m", "relay_server.cli"]


class ServerFailed(RuntimeError):
    """A server exited or did not listen in time; ``returncode`` is None when it still ran."""

    def __init__(self, message: str, returncode: int | None) -> None:
        super().__init__(message)
        self.returncode = returncode


def toml_text(sections: dict[str, dict[str, Any]]) -> str:
    """A run configuration as TOML, one ``[section]`` per key (inline tables for nested dicts)."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(v)

    return "".join(
        f"[{name}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in values.items()) for name, values in sections.items()
    )


def stop_process(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM (a server's clean shutdown), SIGKILL if it has not exited after ``timeout_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)


def wait_ready(proc: subprocess.Popen, ready: Path, log: Path, what: str, timeout_s: float = 120) -> str:
    """The URL a server wrote to its ``--ready-file``; :class:`ServerFailed` with its log's tail
    if it exited first or has not listened within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not ready.exists() or not ready.read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text()[-3000:] if log.exists() else ""
            state = (
                f"exited with {proc.returncode}" if proc.poll() is not None else f"did not listen in {timeout_s:.0f} s"
            )
            raise ServerFailed(f"{what} {state}:\n{tail}", proc.poll())
        time.sleep(0.05)
    return ready.read_text().strip()


@dataclass
class ServerRun:
    """A running server process: its URL (with the port it bound), its log and data folder."""

    proc: subprocess.Popen
    url: str
    log: Path
    data_dir: Path

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def get(self, route: str, timeout_s: float = 30, *, admin: bool = False) -> Any:
        """``GET route`` as JSON (``/api/status``, ...); ``admin``: with the admin token from the
        data folder, for the organizer's routes (``/api/admin/params/egress``, ...)."""
        import requests

        headers = {"Authorization": f"Bearer {(self.data_dir / 'admin_token').read_text().strip()}"} if admin else {}
        answer = requests.get(self.url + route, timeout=timeout_s, headers=headers)
        answer.raise_for_status()
        return answer.json()

    def stop(self) -> None:
        stop_process(self.proc)


def start_server(
    folder: Path,
    name: str,
    args: list[str],
    data_dir: Path,
    *,
    command: list[str] | None = None,
    wrap: Callable[[list[str]], list[str]] | None = None,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
    timeout_s: float = 120,
) -> ServerRun:
    """``command args --port 0 --ready-file folder/name.ready`` (``command``: the relay CLI unless
    a benchmark wraps it in a tracer), logging to ``folder/name.log``; ``wrap`` turns the argv into
    another (``ip netns exec ...``). Returns once it listens."""
    folder.mkdir(parents=True, exist_ok=True)
    ready, log = folder / f"{name}.ready", folder / f"{name}.log"
    ready.unlink(missing_ok=True)
    argv = [*(command or RELAY_CLI), *args, "--port", "0", "--ready-file", str(ready)]
    with open(log, "a") as out:
        proc = subprocess.Popen(
            wrap(argv) if wrap else argv,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=preexec_fn,
        )
    try:
        url = wait_ready(proc, ready, log, name, timeout_s)
    except ServerFailed:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        raise
    return ServerRun(proc, url, log, data_dir)


def start_relay(
    folder: Path, config: dict[str, dict[str, Any]] | str, *, name: str = "relay", **kwargs: Any
) -> ServerRun:
    """``relay-server serve`` of ``config`` (sections, or TOML text) written to
    ``folder/name.toml``, its state in ``folder/name-data``; keywords as :func:`start_server`'s."""
    folder.mkdir(parents=True, exist_ok=True)
    path, data = folder / f"{name}.toml", folder / f"{name}-data"
    path.write_text(config if isinstance(config, str) else toml_text(config))
    return start_server(folder, name, ["serve", "--config", str(path), "--data-dir", str(data)], data, **kwargs)


def start_aggregator(folder: Path, relay: ServerRun, name: str, **kwargs: Any) -> ServerRun:
    """``relay-server aggregator`` for ``relay``, with the admin token the relay wrote to its data
    folder; keywords as :func:`start_server`'s."""
    data = folder / f"{name}-data"
    return start_server(
        folder,
        name,
        [
            "aggregator",
            "--coordinator",
            relay.url,
            "--data-dir",
            str(data),
            "--admin-token-file",
            str(relay.data_dir / "admin_token"),
            "--name",
            name,
        ],
        data,
        **kwargs,
    )
