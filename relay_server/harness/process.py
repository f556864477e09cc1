"""Relay-server processes started the way an organizer starts them, for tests and benchmarks.

``relay-server serve`` (or ``aggregator``) binds port 0 and writes the URL it got to
``--ready-file``, which :meth:`ServerProcess.start` waits for, so two runs on one machine (two
xdist workers, a benchmark beside the suite) never race for a port; a restart keeps the port the
first start got (peers hold the URL) and the data folder. Each process logs into one file, and
the log's tail is in the error when it exits or does not listen in time (a relay refusing its
configuration says why in its last line, which ``benchmarks/low_bandwidth.py`` reports).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import requests

from relay_server.harness import zygote

if TYPE_CHECKING:
    from typing import Self  # 3.11; annotations only (3.10 runs this too)

RELAY_CLI = [sys.executable, "-m", "relay_server.cli"]
TOKEN_FILE = "admin_token"
"""The organizer's bearer token the relay writes into its data folder (``api.moderation``'s name,
repeated so that this module stays free of the relay's imports: a benchmark's setup is cheap)."""


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


def dump_stacks_and_kill(proc: subprocess.Popen[Any], wait_s: float = 10) -> None:
    """End a process that outlived the signal meant to stop it, saying where it was stuck: SIGABRT,
    on which a Python process started with ``PYTHONFAULTHANDLER=1`` (the test suite starts every
    one so) writes each thread's stack to its stderr before it dies; SIGKILL if it is still there
    after ``wait_s``. A hang at shutdown is rare and a rerun rarely shows it again: the stacks in
    its log are what explains it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGABRT)
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=wait_s)


def wait_exit(proc: subprocess.Popen[Any], timeout_s: float, what: str, log: Path) -> int:
    """``proc``'s exit code; if it is still running after ``timeout_s``, it is ended with its
    threads' stacks written to ``log`` (:func:`dump_stacks_and_kill`) and ``TimeoutError`` names
    ``what`` with the log's tail, those stacks included."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        dump_stacks_and_kill(proc)
        raise TimeoutError(f"{what} still running; log:\n{log_tail(log, 8000)}") from None


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    """SIGTERM (a server's clean shutdown); if it has not exited after ``timeout_s``, its stacks
    into its log and the end (:func:`dump_stacks_and_kill`)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            dump_stacks_and_kill(proc)


def log_tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else ""


def wait_ready(proc: subprocess.Popen[bytes], ready: Path, log: Path, what: str, timeout_s: float = 120) -> str:
    """The URL a server wrote to its ``--ready-file``; :class:`ServerFailed` with its log's tail
    if it exited first or has not listened within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not ready.exists() or not ready.read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            state = (
                f"exited with {proc.returncode}" if proc.poll() is not None else f"did not listen in {timeout_s:.0f} s"
            )
            raise ServerFailed(f"{what} {state}:\n{log_tail(log)}", proc.poll())
        time.sleep(0.05)
    return ready.read_text().strip()


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll ``predicate`` every 50 ms until it returns something truthy (returned), or raise
    ``TimeoutError`` naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


class ServerProcess:
    """One ``relay-server`` process: ``command args --port P --ready-file F``, logging to
    ``log_path`` (appended to across restarts). ``command`` is the relay CLI unless a benchmark
    wraps it in a tracer; ``wrap`` turns the argv into another (``ip netns exec ...``); ``env`` is
    added to this process's environment."""

    def __init__(
        self,
        args: list[str],
        data_dir: Path,
        log_path: Path,
        *,
        what: str = "relay",
        port: int = 0,
        command: list[str] | None = None,
        wrap: Callable[[list[str]], list[str]] | None = None,
        env: dict[str, str] | None = None,
        preexec_fn: Callable[[], None] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.args, self.data_dir, self.log_path, self.what, self.port = (
            args,
            Path(data_dir),
            Path(log_path),
            what,
            port,
        )
        self.ready_path = self.log_path.with_suffix(".ready")
        self.command, self.wrap, self.env, self.preexec_fn, self.cwd = command, wrap, env or {}, preexec_fn, cwd
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120, *, wait: bool = True) -> Self:
        """Start it (on the port the first start bound, if any); with ``wait``, return once it
        listens (:meth:`wait_ready`), else at once."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.ready_path.unlink(missing_ok=True)
        argv = [
            *(self.command or RELAY_CLI),
            *self.args,
            "--port",
            str(self.port),
            "--ready-file",
            str(self.ready_path),
        ]
        with open(self.log_path, "a") as out:
            self.proc = zygote.Popen(  # forked from a zygote where enabled (the tests)
                self.wrap(argv) if self.wrap else argv,
                cwd=self.cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                preexec_fn=self.preexec_fn,
            )
        return self.wait_ready(timeout_s) if wait else self

    def wait_ready(self, timeout_s: float = 120) -> Self:
        """Wait until it listens and read back the port it bound; a server that exited or hangs is
        killed and :class:`ServerFailed` names why, with its log's tail."""
        assert self.proc is not None, "start() first"
        try:
            url = wait_ready(self.proc, self.ready_path, self.log_path, self.what, timeout_s)
        except ServerFailed:
            self.kill()
            raise
        self.port = int(url.rsplit(":", 1)[1])
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, timeout_s: float = 10) -> None:
        """SIGTERM (its clean shutdown), SIGKILL after ``timeout_s``."""
        if self.proc:
            stop_process(self.proc, timeout_s)

    def get(self, route: str, timeout_s: float = 30, *, admin: bool = False) -> Any:
        """``GET route`` as JSON (``/api/status``, ...); ``admin``: with the admin token from the
        data folder, for the organizer's routes (``/api/admin/params/egress``, ...)."""
        token = (self.data_dir / TOKEN_FILE).read_text().strip() if admin else ""
        answer = requests.get(
            self.url + route, timeout=timeout_s, headers={"Authorization": f"Bearer {token}"} if admin else {}
        )
        answer.raise_for_status()
        return answer.json()

    def status(self) -> dict[str, Any]:
        return requests.get(self.url + "/api/status", timeout=10).json()

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], Any], timeout_s: float = 60, what: str = "condition"
    ) -> dict[str, Any]:
        """The first ``/api/status`` that ``predicate`` accepts (a refused connection counts as not
        yet); on timeout the last status and the log's tail say why."""
        deadline, status = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            try:
                status = self.status()
            except requests.ConnectionError:
                status = None
            if status is not None and predicate(status):
                return status
            time.sleep(0.05)
        raise TimeoutError(
            f"timed out waiting for {what}; last status: {status}\n{self.what} log tail:\n{log_tail(self.log_path, 2000)}"
        )


class RelayProcess(ServerProcess):
    """``relay-server serve --config config_path --data-dir data_dir``, and what its database says
    while it is down (what a restart must resume at)."""

    def __init__(self, config_path: Path, data_dir: Path, log_path: Path, **kwargs: Any) -> None:
        super().__init__(
            ["serve", "--config", str(config_path), "--data-dir", str(data_dir)], data_dir, log_path, **kwargs
        )
        self.config_path = Path(config_path)

    def durable_step(self) -> int:
        """The step the relay's database says is durable."""
        with sqlite3.connect(self.data_dir / "relay.sqlite") as db:
            return int(db.execute("SELECT value FROM meta WHERE key = 'step'").fetchone()[0])

    def round_steps(self) -> list[int]:
        """Every step the relay recorded a round for, in order (contiguous from 1 when no step was
        lost or applied twice)."""
        with sqlite3.connect(self.data_dir / "relay.sqlite") as db:
            return [s for (s,) in db.execute("SELECT step FROM rounds ORDER BY step")]


class AggregatorProcess(ServerProcess):
    """``relay-server aggregator`` for ``relay``, with the admin token the relay wrote to its data
    folder; :meth:`wait_registered` waits until the relay took it in."""

    def __init__(
        self,
        relay: ServerProcess,
        name: str,
        data_dir: Path,
        log_path: Path,
        *,
        extra: tuple[str, ...] = (),
        **kwargs: Any,
    ) -> None:
        args = ["aggregator", "--coordinator", relay.url, "--data-dir", str(data_dir), "--name", name]
        args += ["--admin-token-file", str(relay.data_dir / TOKEN_FILE), *extra]
        super().__init__(args, data_dir, log_path, what=f"aggregator {name}", **kwargs)
        self.name = name

    def wait_registered(self, timeout_s: float = 60) -> "AggregatorProcess":
        deadline = time.monotonic() + timeout_s
        self.wait_ready(timeout_s)  # listening, then registered:
        while not self.status().get("aggregator_id"):
            if self.proc.poll() is not None or time.monotonic() > deadline:  # type: ignore[union-attr]  # started
                self.kill()
                raise ServerFailed(
                    f"{self.what} did not register:\n{log_tail(self.log_path)}",
                    self.proc.returncode,  # type: ignore[union-attr]  # wait_ready() asserted it started
                )
            time.sleep(0.05)
        return self


def start_relay(
    folder: Path,
    config: dict[str, dict[str, Any]] | str,
    *,
    name: str = "relay",
    timeout_s: float = 120,
    **kwargs: Any,
) -> RelayProcess:
    """``relay-server serve`` of ``config`` (sections, or TOML text) written to
    ``folder/name.toml``, its state in ``folder/name-data``, its log ``folder/name.log``; keywords
    as :class:`ServerProcess`'s. Returns once it listens."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.toml"
    path.write_text(config if isinstance(config, str) else toml_text(config))
    return RelayProcess(path, folder / f"{name}-data", folder / f"{name}.log", **kwargs).start(timeout_s)


def start_aggregator(folder: Path, relay: ServerProcess, name: str, **kwargs: Any) -> AggregatorProcess:
    """``relay-server aggregator`` for ``relay`` (state ``folder/name-data``), once it listens."""
    return AggregatorProcess(relay, name, folder / f"{name}-data", folder / f"{name}.log", **kwargs).start()
