"""Shard leases across a network: a REAL relay process (``relay-server serve``); peers streaming
local shard files through RelayShardSource with HF_DATASETS_OFFLINE=1 and only loopback connections allowed -- two in
threads of this process, streaming at once, and one in a process of its own, to SIGKILL -- and
the relay's own lease log (``shard_events`` in relay.sqlite) replayed to check what happened, in
the order it happened."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import requests

from relay_server.harness import zygote
from relay_server.harness.process import RelayProcess, wait_until
from tests.support.processes import REPO, merged, write_config
from tests.support.training import write_shards
from toolkit.client import RelayClient
from toolkit.data import RelayShardSource, ShardLeaseClient, StreamConfig, stream_texts
from toolkit.wire.protocol import PROTOCOL_VERSION, Heartbeat, JoinRequest

pytestmark = pytest.mark.integration  # starts relay, peer or tool processes

WORKER = Path(__file__).resolve().parent / "shard_peer_worker.py"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
TTL_S = 2.0  # conftest's BASE_CONFIG: heartbeats every 0.3 s, silent for 2 s = gone


class ShardRelay(RelayProcess):
    """conftest's RelayProcess, with the lease views an organizer has."""

    def coverage(self) -> dict:
        return requests.get(self.url + "/api/shards", timeout=10).json()

    def db_rows(self, sql: str) -> list[tuple]:
        """Read the relay's SQLite file directly (read-only), as an organizer would."""
        db = sqlite3.connect(f"file:{self.data_dir / 'relay.sqlite'}?mode=ro", uri=True, timeout=10)
        try:
            return db.execute(sql).fetchall()
        except sqlite3.OperationalError:  # the relay has not created the table yet
            return []
        finally:
            db.close()


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch):
    """HF offline mode in this process (``datasets`` read the variable when first imported, so
    its config value is set too), and no connection other than to loopback."""
    import datasets

    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    attempts: list = []
    real_connect = socket.socket.connect

    def connect(self, address, *args):
        if self.family == socket.AF_UNIX or (isinstance(address, tuple) and address[0] in ("127.0.0.1", "::1")):
            return real_connect(self, address, *args)
        attempts.append(address)
        raise OSError(f"network access outside loopback in a test: {address}")

    monkeypatch.setattr(socket.socket, "connect", connect)
    yield
    assert attempts == [], attempts


@pytest.fixture
def shard_relay(tmp_path):
    relays: list[ShardRelay] = []

    def start(dataset: dict) -> ShardRelay:
        config = write_config(tmp_path / "relay.toml", merged({}))
        with open(config, "a") as f:  # the [dataset] section with its array of tables
            f.write(
                "\n[dataset]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in dataset.items() if k != "sources")
            )
            for source in dataset["sources"]:
                f.write("\n[[dataset.sources]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in source.items()))
        relay = ShardRelay(config, tmp_path / "relay-data", tmp_path / "relay.log", env=dict(OFFLINE))
        relays.append(relay)
        return relay.start()

    yield start
    for relay in relays:
        relay.kill()  # its data dir is thrown away; a graceful stop costs seconds


@pytest.fixture
def peers(tmp_path):
    procs: list[subprocess.Popen] = []

    def launch(relay: ShardRelay, name: str, *args: str) -> tuple[subprocess.Popen, Path]:
        events = tmp_path / f"{name}.events.jsonl"
        env = {**os.environ, **OFFLINE, "HF_HOME": str(tmp_path / "hf-home")}
        proc = zygote.Popen(
            [sys.executable, str(WORKER), "--relay", relay.url, "--name", name, "--events", str(events), *args],
            stdout=open(tmp_path / f"{name}.log", "w"),
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )
        procs.append(proc)
        return proc, events

    yield launch
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


class LivePeer:
    """A peer driven from the test: joined, heartbeating from a thread, leasing by hand."""

    def __init__(self, url: str, name: str) -> None:
        self.client = RelayClient(url, retries=2, backoff_s=0.2)
        self.peer_id = self.client.join(JoinRequest(peer_name=name, protocol=PROTOCOL_VERSION)).peer_id
        self.leases = ShardLeaseClient(self.client, self.peer_id)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(RelayClient(url, retries=1),), daemon=True)
        self._thread.start()

    def _beat(self, client: RelayClient) -> None:
        while not self._stop.wait(0.3):
            try:
                client.heartbeat(self.peer_id, Heartbeat(version=0, samples=0, samples_per_s=0.0))
            except Exception:  # the relay may be restarting
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def replay(events: list[tuple], shards: list[str]) -> list[tuple[str, str, Counter]]:
    """Replay the lease log; return, for every grant, (peer, shard, leases per shard just before)."""
    held: Counter = Counter()
    grants = []
    for _seq, _at, _source, shard, peer, event, leases in events:
        if event == "start":
            held = Counter()
            continue
        if event == "grant":
            grants.append((peer, shard, Counter({s: held[s] for s in shards})))
        held[shard] += 1 if event in ("grant", "reclaim") else -1
        assert held[shard] == leases, (event, shard, held[shard], leases)  # the log agrees with itself
    return grants


# --- the tests ------------------------------------------------------------------------------------
def stream_in_thread(url: str, name: str, dataset: dict, rows: int, out: dict) -> threading.Thread:
    """A peer in a thread of this process: joined and heartbeating (LivePeer), streaming the run's
    data through RelayShardSource with its own client, ``rows`` texts, then closing the stream."""

    def run() -> None:
        peer = LivePeer(url, name)
        try:
            sources: list[RelayShardSource] = []

            def factory(spec):
                sources.append(RelayShardSource(peer.client, peer.peer_id, spec.name, report_interval_s=0.2))
                return sources[-1]

            texts = stream_texts(StreamConfig.from_dict(dataset), seed=name, shard_source=factory)
            consumed = 0
            for _ in texts:
                consumed += 1
                if consumed >= rows:
                    break
                time.sleep(0.002)  # a little training time per row: the two streams interleave
            texts.close()
            out[name] = {
                "peer_id": peer.peer_id,
                "consumed": consumed,
                "samples": Counter({s: n for src in sources for s, n in src.samples.items()}),
            }
        except BaseException as exc:  # handed to the test
            out[name] = exc
        finally:
            peer.close()

    thread = threading.Thread(target=run, name=name)
    thread.start()
    return thread


def test_two_peers_streaming_at_once_never_hold_the_same_shard(tmp_path, shard_relay, offline):
    """Also: every consumed row is counted on its shard, the counts survive a relay kill, and a
    newcomer then gets the least-processed shards first (one relay life cycle for all of it)."""
    shards = write_shards(tmp_path / "data", count=8, rows=150)
    dataset = {
        "kind": "stream",
        "shuffle_buffer": 20,
        "report_every": 10,
        "cache_dir": str(tmp_path / "cache"),
        "sources": [{"name": "web", "data_files": shards}],
    }
    relay = shard_relay(dataset)
    out: dict = {}
    threads = [stream_in_thread(relay.url, name, dataset, 400, out) for name in ("peer-a", "peer-b")]
    for thread in threads:
        thread.join(timeout=120)
    assert all(isinstance(out.get(n), dict) for n in ("peer-a", "peer-b")), out

    def every_lease_ended() -> bool:  # on disk: the pool flushes its log once a second
        events = Counter(e for (e,) in relay.db_rows("SELECT event FROM shard_events"))
        return events["grant"] > 0 and events["release"] + events["finish"] == events["grant"]

    wait_until(every_lease_ended, 10, "every lease's end in the log")

    grants = replay(relay.db_rows("SELECT * FROM shard_events ORDER BY seq"), shards)
    names = {out[n]["peer_id"]: n for n in out}
    assert {names[peer] for peer, _, _ in grants} == {"peer-a", "peer-b"}
    for peer, shard, before in grants:
        assert before[shard] == 0, f"{shard} granted to {names[peer]} while held, with unleased shards {before}"
    # They really streamed at once: at some point both held a lease.
    holding, overlapped = Counter(), False
    for peer, event in relay.db_rows("SELECT peer_id, event FROM shard_events WHERE event != 'start' ORDER BY seq"):
        holding[peer] += 1 if event in ("grant", "reclaim") else -1
        overlapped |= sum(1 for n in holding.values() if n > 0) == 2
    assert overlapped
    # Every row a peer consumed was counted on its shard, and nothing else was.
    expected = out["peer-a"]["samples"] + out["peer-b"]["samples"]
    assert sum(expected.values()) == out["peer-a"]["consumed"] + out["peer-b"]["consumed"] == 800
    wait_until(
        lambda: sum(n for (n,) in relay.db_rows("SELECT samples FROM shard_coverage")) == 800,
        10,
        "the last counts on disk",
    )
    assert {s: n for s, n in relay.db_rows("SELECT shard, samples FROM shard_coverage") if n} == dict(expected)

    # The counts survive a relay killed without a goodbye (they were flushed within a second)...
    before = {c["shard"]: (c["samples"], c["passes"], c["rows"]) for c in relay.coverage()["shards"]}
    assert any(p for _, p, _ in before.values()) and any(n and not p for n, p, _ in before.values())  # some of each
    relay.kill()
    relay.start()
    after = relay.coverage()
    assert {c["shard"]: (c["samples"], c["passes"], c["rows"]) for c in after["shards"]} == before
    assert all(c["holders"] == 0 for c in after["shards"])  # leases do not survive: their peers re-attach
    # ...and a newcomer is handed the least-processed shards first: fewest passes, then fewest rows.
    newcomer = LivePeer(relay.url, "newcomer")
    try:
        order = [newcomer.leases.lease("web").shard for _ in shards]
    finally:
        newcomer.close()
    assert sorted(order) == sorted(shards)
    keys = [(before[s][1], before[s][0]) for s in order]
    assert keys == sorted(keys), keys


def test_a_sigkilled_peers_shard_returns_to_the_pool_after_its_heartbeat_ttl(tmp_path, shard_relay, peers):
    shards = write_shards(tmp_path / "data", count=2, rows=400)
    relay = shard_relay(
        {
            "kind": "stream",
            "shuffle_buffer": 4,
            "report_every": 5,
            "cache_dir": str(tmp_path / "cache"),
            "sources": [{"name": "web", "data_files": shards}],
        }
    )
    victim, events = peers(relay, "victim", "--rows", "100000", "--sleep-per-row", "0.05")
    leased = wait_until(lambda: [e for e in read_events(events) if e["event"] == "leased"], 90, "the victim's lease")
    victim_shard, victim_id = leased[0]["shard"], read_events(events)[0]["peer_id"]
    wait_until(
        lambda: any(c["shard"] == victim_shard and c["samples"] > 0 for c in relay.coverage()["shards"]),
        30,
        "the victim's first progress report",
    )
    survivor = LivePeer(relay.url, "survivor")
    try:
        other = survivor.leases.lease("web")
        assert other.shard != victim_shard and other.holders == 1  # held shards are not handed out

        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        wait_until(
            lambda: all(c["holders"] == 0 for c in relay.coverage()["shards"] if c["shard"] == victim_shard),
            60,
            "the victim's lease to expire",
        )  # by heartbeat TTL: the 'expire' event below says so

        back = survivor.leases.lease("web")
        assert back.shard == victim_shard and back.holders == 1 and back.samples > 0  # its rows still count
    finally:
        survivor.close()
    expired = wait_until(
        lambda: relay.db_rows(f"SELECT shard FROM shard_events WHERE event = 'expire' AND peer_id = '{victim_id}'"),
        5,
        "the expiry in the log",
    )
    assert expired == [(victim_shard,)]  # in the lease log, which is flushed once a second
