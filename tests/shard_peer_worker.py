"""A real peer process for the shard-lease tests: joins the relay, heartbeats from a background
thread (as CollaborativeOptimizer's worker does), streams the run's dataset through
:class:`RelayShardSource`, and writes JSON-line events (joined, leased, done). Only loopback
connections are allowed; any other attempt fails the process."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def loopback_only() -> list:
    """Refuse (and record) every connection that is not to 127.0.0.1 / ::1 / a UNIX socket."""
    attempts: list = []
    real_connect = socket.socket.connect

    def connect(self, address, *args):
        if self.family == socket.AF_UNIX or (isinstance(address, tuple) and address[0] in ("127.0.0.1", "::1")):
            return real_connect(self, address, *args)
        attempts.append(repr(address))
        raise OSError(f"network access outside loopback: {address}")

    socket.socket.connect = connect
    return attempts


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--relay", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--rows", type=int, required=True, help="texts to consume before closing the stream")
    parser.add_argument("--sleep-per-row", type=float, default=0.0)
    parser.add_argument("--wait-peers", type=int, default=0, help="start streaming once this many peers joined")
    args = parser.parse_args()
    attempts = loopback_only()

    from toolkit.client import RelayClient
    from toolkit.data import RelayShardSource, StreamConfig, stream_texts
    from toolkit.wire.protocol import PROTOCOL_VERSION, Heartbeat, JoinRequest

    events = open(args.events, "a", buffering=1)

    def emit(**event) -> None:
        events.write(json.dumps({"t": time.time(), **event}) + "\n")

    client = RelayClient(args.relay, retries=3, backoff_s=0.2)
    joined = client.join(JoinRequest(peer_name=args.name, protocol=PROTOCOL_VERSION))
    peer_id, run = joined.peer_id, joined.run
    emit(event="joined", peer_id=peer_id)
    stopping = threading.Event()

    def heartbeat() -> None:
        hb_client = RelayClient(args.relay, retries=1, backoff_s=0.1)
        while not stopping.wait(run.heartbeat_interval_s):
            hb_client.heartbeat(peer_id, Heartbeat(version=0, samples=0, samples_per_s=0.0))
        hb_client.close()

    beating = threading.Thread(target=heartbeat, daemon=True)
    beating.start()
    while args.wait_peers and client.get_status().num_peers < args.wait_peers:
        time.sleep(0.05)

    class Logged(RelayShardSource):
        def next_shard(self) -> str:
            shard = super().next_shard()
            emit(event="leased", source=self.source, shard=shard, holders=self.last_lease.holders)
            return shard

    sources: list[Logged] = []

    def factory(spec):
        sources.append(Logged(client, peer_id, spec.name, report_interval_s=0.2))
        return sources[-1]

    consumed = 0
    texts = stream_texts(StreamConfig.from_dict(run.dataset), seed=args.name, shard_source=factory)
    for _ in texts:
        consumed += 1
        if consumed >= args.rows:
            break
        time.sleep(args.sleep_per_row)
    texts.close()  # reports what was trained on and releases every shard still held
    stopping.set()
    beating.join()
    client.leave(peer_id)
    emit(
        event="done",
        consumed=consumed,
        samples={s: n for src in sources for s, n in src.samples.items()},
        network_attempts=attempts,
    )
    return 1 if attempts else 0


if __name__ == "__main__":
    # What it wrote is closed or flushed below: skip the interpreter's teardown of torch (~0.6 s of
    # CPU a process, and the suite starts hundreds of them).
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
