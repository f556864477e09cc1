"""One server per data directory: a second relay (or aggregator) on a running one's state refuses in
one line naming the holder, before it reads or writes anything there; a SIGKILLed relay leaves no
stale lock; the read-only commands work beside a running relay."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relay_server.core.data_lock import LOCK_FILE
from relay_server.harness import zygote
from relay_server.harness.process import AggregatorProcess, RelayProcess

REPO = Path(__file__).resolve().parent.parent


def relay_server(*args: str) -> subprocess.CompletedProcess:
    """The CLI as a user runs it; a relay that does not refuse would serve until the timeout."""
    return zygote.run(
        [sys.executable, "-m", "relay_server.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env=dict(os.environ),
    )


def file_hashes(directory: Path) -> dict[str, str]:
    """sha256 of every file under ``directory``, by relative path."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def refusal(relay: RelayProcess | AggregatorProcess, role: str = "relay") -> str:
    return (
        f"relay-server: {relay.data_dir} is in use by {role} pid {relay.proc.pid}, listening on {relay.url}: "
        "stop that process first (its state would be written by two servers at once), or pass another "
        "--data-dir\n"
    )


def test_a_second_relay_on_one_data_dir_refuses_and_touches_nothing(start_relay, tmp_path: Path) -> None:
    relay = start_relay()  # no peers: quiescent, nothing in its data dir changes while it waits
    relay.wait_for(lambda s: s["step"] == 0, what="the first version")
    before = file_hashes(relay.data_dir)
    assert {"relay.sqlite", "admin_token", "state/step-00000000.safetensors"} <= set(before)

    for port in ("0", str(relay.port)):  # another port, then the same one (a bind would fail there anyway)
        done = relay_server(
            "serve", "--config", str(relay.config_path), "--data-dir", str(relay.data_dir), "--port", port
        )
        assert (done.returncode, done.stderr) == (2, refusal(relay)), done.stderr[-2000:]
    assert file_hashes(relay.data_dir) == before  # not the admin token, the relay key, the database, a version
    assert json.loads((relay.data_dir / LOCK_FILE).read_text()) == {
        "pid": relay.proc.pid,
        "role": "relay",
        "address": relay.url,
    }

    # the read-only commands beside it: export reads a snapshot without the lock (Store.reader),
    # admin reads the token and asks the relay
    done = relay_server(
        "export",
        "--config",
        str(relay.config_path),
        "--data-dir",
        str(relay.data_dir),
        "--out",
        str(tmp_path / "export"),
    )
    assert (done.returncode, done.stdout) == (0, f"version 0 written to {tmp_path / 'export'}\n"), done.stderr
    done = relay_server("admin", "--url", relay.url, "--data-dir", str(relay.data_dir), "--json", "checkpoints")
    assert done.returncode == 0, done.stderr
    assert [c["step"] for c in json.loads(done.stdout)["checkpoints"]] == [0]

    # what the relay keeps is unchanged; SQLite's shared-memory index (-shm) is where any reader, the
    # relay's own included, records the snapshot it reads, so a read may touch it
    after = {name: digest for name, digest in file_hashes(relay.data_dir).items() if not name.endswith("-shm")}
    assert after == {name: digest for name, digest in before.items() if not name.endswith("-shm")}
    assert relay.status()["step"] == 0  # the first relay serves on

    relay.kill()  # SIGKILL: no clean exit releases anything; the kernel drops the lock with the process
    relay.start()
    assert relay.status()["step"] == 0
    assert json.loads((relay.data_dir / LOCK_FILE).read_text())["pid"] == relay.proc.pid


@pytest.mark.integration
def test_export_of_a_directory_without_a_relay_writes_nothing_there(tmp_path: Path) -> None:
    """A read-only command pointed at the wrong directory says so and leaves it as it was (it
    used to create a database and a state folder in it)."""
    empty = tmp_path / "not-the-data-dir"
    empty.mkdir()
    done = relay_server("export", "--data-dir", str(empty), "--out", str(tmp_path / "export"))
    assert (done.returncode, done.stderr) == (
        2,
        f"relay-server: configuration error: {empty} holds no version "
        "yet: point --data-dir at the relay's server.data_dir\n",
    )
    assert list(empty.iterdir()) == [] and not (tmp_path / "export").exists()


def test_a_second_aggregator_on_one_data_dir_refuses(start_relay, start_aggregators) -> None:
    relay = start_relay()
    (aggregator,) = start_aggregators(relay, "agg1")
    before = file_hashes(aggregator.data_dir)
    done = relay_server(
        "aggregator",
        "--coordinator",
        relay.url,
        "--port",
        "0",
        "--data-dir",
        str(aggregator.data_dir),
        "--admin-token-file",
        str(relay.data_dir / "admin_token"),
    )
    assert (done.returncode, done.stderr) == (2, refusal(aggregator, "aggregator")), done.stderr[-2000:]
    assert file_hashes(aggregator.data_dir) == before
    assert aggregator.status()["aggregator_id"]
