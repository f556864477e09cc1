"""Seconds per averaging round through the relay, beside raw TCP moving the same bytes.

    python benchmarks/allreduce.py --peers 4 --mb 100 --rounds 5
    python benchmarks/allreduce.py --peers 4 --mb 20 --rounds 5 --aggregators 2   # sliced rounds

N peer processes each hold a float32 gradient of ``--mb`` MiB. One round = every peer uploads
its gradient sum, the relay reduces it while it streams in, applies SGD to the master
parameters, persists the new version and publishes it, and every peer downloads the new
parameters. Timed from the first upload's start to the last download's end; the median over
rounds is reported.

With ``--aggregators N`` the relay and N ``relay-server aggregator`` processes share the vector
(an equal plan: every link gets the same prior and re-planning is off): each peer asks for a
ticket, uploads every slice to its owner in parallel, says done, and downloads every slice from
its owner. On one machine this measures the sliced path's overhead, not a bandwidth gain.

The baseline moves the same bytes the same way with plain sockets on 127.0.0.1 (N processes
send ``--mb`` MiB each into one receiver, which then sends ``--mb`` MiB back to each), so the
ratio shows what the relay costs over the raw transfer limit of this machine. Last line:
``{"peers", "mb", "round_s", "raw_tcp_s", "ratio", "max_abs_err"}``.

``--floor`` times the raw transfer again doing only the work no relay keeping its guarantees can
skip: the receiver hashes each upload (the chunk digests checked before use), sums them and hashes
the sum (the version's hash) before replying, and each sender hashes what it got back (a peer
verifying its parameters). ``floor_ratio`` (that over raw TCP) is about the lowest ``ratio`` a relay
could reach on this machine with that hash (``--floor-hash``: sha256, the protocol's, or blake3;
a relay could still overlap the version's hash with sending it, about 0.06 s of one core here).

    python benchmarks/allreduce.py --peers 4 --mb 100 --rounds 5 --floor
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from relay_server.harness.process import ServerProcess, start_aggregator, start_relay

REPO = Path(__file__).resolve().parent.parent
SAMPLES = 8  # each peer's gradient is a sum over this many samples


def relay_config(numel: int, peers: int, replan: bool = False) -> str:
    """The benchmark run. ``replan`` False: one plan, solved from equal priors before any transfer
    (measurements never move slices mid-benchmark); True: re-solved from measurements each second."""
    replanning = "replan_change = 0.2\nreplan_interval_s = 1.0" if replan else "replan_change = 1e9"
    return f"""
[run]
name = "allreduce-bench"
target_batch = {peers * SAMPLES}
max_staleness = 0
[model]
factory = "toolkit.models:Vector"
kwargs = {{ numel = {numel} }}
[optimizer]
name = "sgd"
lr = 1.0
[rounds]
heartbeat_interval_s = 5.0
peer_ttl_s = 120.0
deadline_initial_s = 120.0
deadline_floor_s = 60.0
deadline_ceiling_s = 120.0
[server]
keep_checkpoints = 2
[auth]
mode = "open"
[aggregators]
heartbeat_interval_s = 0.5
ttl_s = 30.0
{replanning}
"""


def gradient(index: int, numel: int) -> np.ndarray:
    return np.random.default_rng(index).standard_normal(numel, dtype=np.float32)


# --- one peer process --------------------------------------------------------------------------
def run_peer(
    url: str,
    index: int,
    numel: int,
    rounds: int,
    peers: int,
    slices: int,
    report: Callable[[tuple], None],
    samples_per_s: float = 1.0,
) -> None:
    """Join, wait for ``peers`` peers and a plan of ``slices`` owners, then run ``rounds`` rounds.

    Reports ``(index, step, started, ended, version, owners, uploaded)`` per round (``owners``:
    the round's slice fractions by owner name, empty when the relay owns the whole vector;
    ``uploaded``: when its upload was answered) and, from peer 0, ``("params",
    final_parameters)``. Shared with ``benchmarks/shaped.py``.
    """
    sys.path.insert(0, str(REPO))
    from toolkit.client import RelayClient
    from toolkit.transfer import slice_part
    from toolkit.wire.protocol import (
        PROTOCOL_VERSION,
        DoneRequest,
        GradientMeta,
        Heartbeat,
        JoinRequest,
        TicketRequest,
    )

    client = RelayClient(url, read_timeout_s=300)
    peer_id = client.join(JoinRequest(peer_name=f"bench-{index}", protocol=PROTOCOL_VERSION)).peer_id
    grad, params = gradient(index, numel), np.empty(numel, dtype=np.float32)
    while client.get_status().num_peers < peers:
        time.sleep(0.01)
    while len(client.get_status().plan.slices) < slices:  # computing (samples/s > 0), nothing to send yet
        client.heartbeat(peer_id, Heartbeat(version=0, samples=0, samples_per_s=samples_per_s))
        time.sleep(0.1)
    for step in range(rounds):
        state = client.heartbeat(peer_id, Heartbeat(version=step, samples=SAMPLES, samples_per_s=samples_per_s))
        while state.round is None or state.round.step != step:
            time.sleep(0.005)
            state = client.get_progress()
        started = time.time()
        meta = GradientMeta(peer_id=peer_id, step=step, version=step, samples=SAMPLES, loss_sum=0.0)
        if state.round.slices:
            parts = [
                slice_part(s, [("payload", grad[s.start : s.end])], meta, "none", signed=False)
                for s in state.round.slices
            ]
            ticket = client.request_ticket(
                step,
                peer_id,
                TicketRequest(
                    round_id=state.round.round_id,
                    version=step,
                    samples=SAMPLES,
                    loss_sum=0.0,
                    slices=[p.digest for p in parts],
                ),
            )
            errors = client.params.upload_slices(step, ticket, parts)
            assert not any(errors), errors
            client.report_done(
                step, peer_id, DoneRequest(round_id=state.round.round_id, delivered=[p.plan.start for p in parts])
            )
        else:
            client.upload_gradient([("payload", grad)], meta, "none")
        uploaded = time.time()
        version = client.params.download_params(params, min_step=step + 1, wait_s=300, peer_id=peer_id)
        owners = {s.name: round(s.fraction, 4) for s in state.round.slices}
        report((index, step, started, time.time(), version, owners, uploaded))
    if index == 0:
        report(("params", params))
    client.leave(peer_id)


def peer_main(url: str, index: int, numel: int, rounds: int, peers: int, slices: int, out: mp.Queue) -> None:
    run_peer(url, index, numel, rounds, peers, slices, out.put)


def run_relay_rounds(
    peers: int, numel: int, rounds: int, aggregators: int = 0, breakdown: bool = False
) -> tuple[list[float], np.ndarray, list[dict] | None]:
    """Seconds per round, the final parameters, and with ``breakdown`` each round's phases
    (:func:`phases`)."""
    with tempfile.TemporaryDirectory(prefix="allreduce-bench-") as tmp:
        trace = Path(tmp) / "trace"
        tracer = [sys.executable, str(REPO / "benchmarks" / "round_trace.py")] if breakdown else None
        relay = start_relay(
            Path(tmp), relay_config(numel, peers), command=tracer, env={**os.environ, "ROUND_TRACE": str(trace)}
        )
        helpers: list[ServerProcess] = []
        try:
            url = relay.url
            helpers = [start_aggregator(Path(tmp), relay, f"agg{i}") for i in range(aggregators)]
            ctx = mp.get_context("spawn")
            out: mp.Queue = ctx.Queue()
            procs = [
                ctx.Process(target=peer_main, args=(url, i, numel, rounds, peers, aggregators + 1, out))
                for i in range(peers)
            ]
            for p in procs:
                p.start()
            timings: dict[int, list[tuple[float, float, float]]] = {}
            final = None
            for _ in range(peers * rounds + 1):
                item = out.get(timeout=600)
                if item[0] == "params":
                    final = item[1]
                    continue
                _, step, started, ended, version, _, uploaded = item
                assert version == step + 1, f"peer downloaded version {version} after round {step}"
                timings.setdefault(step, []).append((started, ended, uploaded))
            for p in procs:
                p.join(timeout=60)
        finally:
            for server in [*helpers, relay]:
                server.stop()
        rounds_seen = [t for _, t in sorted(timings.items())]
        table = phases(rounds_seen, trace.read_text().split("\n")) if breakdown else None
    seconds = [max(e for _, e, _ in t) - min(s for s, _, _ in t) for t in rounds_seen]
    return seconds, final, table


def phases(rounds: list[list[tuple[float, float, float]]], trace: list[str]) -> list[dict]:
    """Each round's time, split where it goes: ``upload`` (the first peer's upload start to the
    last upload answered: receiving, validating and staging every chunk, and the commits),
    ``apply`` (from there to the version written: the last adds, mean, optimizer step, write and
    hash), ``download`` (from there to the last peer holding the verified version), and the
    relay's thread time inside them (``stage``, ``commit``, ``mean``, ``step``, ``write``,
    ``hash``; summed over peers where there is one per upload)."""
    events = [(w, float(a), float(b)) for w, a, b in (line.split() for line in trace if line.strip())]
    writes = sorted(b for w, _, b in events if w == "write")
    table = []
    for peers in rounds:
        start = min(s for s, _, _ in peers)
        uploaded, ended = max(u for _, _, u in peers), max(e for _, e, _ in peers)
        written = min((w for w in writes if w >= uploaded - 1e-3), default=ended)
        inside = [(w, a, b) for w, a, b in events if start <= a <= written]
        row = {
            "round_s": ended - start,
            "upload": uploaded - start,
            "apply": written - uploaded,
            "download": ended - written,
        }
        for name in ("stage", "commit", "mean", "step", "write", "hash"):
            row[name] = sum(b - a for w, a, b in inside if w == name)
        table.append(row)
    return table


# --- the raw TCP baseline ----------------------------------------------------------------------
def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("peer closed")
        got += n


def hasher(name: str) -> Callable[[bytes | bytearray], bytes]:
    """``sha256`` (the protocol's hash) or ``blake3`` (not a dependency: ``pip install blake3``, one
    thread), for the checked floor; both release the GIL on large buffers."""
    if name == "blake3":
        try:
            from blake3 import blake3
        except ImportError:
            raise SystemExit("--floor-hash blake3 needs the blake3 package: pip install blake3") from None
        return lambda data: blake3(data).digest()
    return lambda data: hashlib.sha256(data).digest()


def raw_receiver(port_queue: mp.Queue, peers: int, nbytes: int, rounds: int, checked: str = "") -> None:
    """One round: every sender's bytes in, then the same number of bytes back to each. With
    ``checked`` (a hash's name), also the work no relay keeping the issue's guarantees can skip:
    each upload's hash once it is in (its chunk digests), the sum of the uploads and the hash of
    what is sent back (the version's), the sum and that hash once per round before any reply."""
    digest = hasher(checked) if checked else None
    server = socket.create_server(("127.0.0.1", 0))
    port_queue.put(server.getsockname()[1])
    conns = [server.accept()[0] for _ in range(peers)]
    buffers = [bytearray(nbytes) for _ in range(peers)]
    reply = bytearray(nbytes)
    total = np.frombuffer(reply, dtype=np.float32)

    def reduce_and_hash() -> None:
        np.copyto(total, np.frombuffer(buffers[0], dtype=np.float32))
        for buffer in buffers[1:]:
            np.add(total, np.frombuffer(buffer, dtype=np.float32), out=total)
        digest(reply)

    for _ in range(rounds):
        received = threading.Barrier(peers, action=reduce_and_hash if checked else None)

        def serve(i: int) -> None:
            _recv_exactly(conns[i], memoryview(buffers[i]))
            if checked:
                digest(buffers[i])
            received.wait()  # everyone's upload is in before anyone gets the result, as in a round
            conns[i].sendall(reply)

        for conn in conns:
            conn.sendall(b"g")
        threads = [threading.Thread(target=serve, args=(i,)) for i in range(peers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def raw_sender(port: int, index: int, nbytes: int, rounds: int, out: mp.Queue, checked: str = "") -> None:
    """Sends its gradient and receives the reply; with ``checked``, hashes the reply (a peer
    verifying the parameters it downloaded)."""
    digest = hasher(checked) if checked else None
    sock = socket.create_connection(("127.0.0.1", port))
    data = gradient(index, nbytes // 4).tobytes()
    back = bytearray(nbytes)
    for step in range(rounds):
        _recv_exactly(sock, memoryview(bytearray(1)))
        started = time.time()
        sock.sendall(data)
        _recv_exactly(sock, memoryview(back))
        if checked:
            digest(back)
        out.put((step, started, time.time()))


def run_raw_tcp(peers: int, nbytes: int, rounds: int, checked: str = "") -> list[float]:
    ctx = mp.get_context("spawn")
    ports: mp.Queue = ctx.Queue()
    out: mp.Queue = ctx.Queue()
    receiver = ctx.Process(target=raw_receiver, args=(ports, peers, nbytes, rounds, checked))
    receiver.start()
    port = ports.get(timeout=60)
    senders = [ctx.Process(target=raw_sender, args=(port, i, nbytes, rounds, out, checked)) for i in range(peers)]
    for p in senders:
        p.start()
    timings: dict[int, list[tuple[float, float]]] = {}
    for _ in range(peers * rounds):
        step, started, ended = out.get(timeout=600)
        timings.setdefault(step, []).append((started, ended))
    for p in [*senders, receiver]:
        p.join(timeout=60)
    return [max(e for _, e in t) - min(s for s, _ in t) for _, t in sorted(timings.items())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--mb", type=float, default=100.0, help="gradient size per peer in MiB (float32)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--aggregators", type=int, default=0, help="extra aggregator processes (sliced rounds)")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="time the round's phases on the relay (benchmarks/round_trace.py) and print where each round's time goes",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also time raw TCP doing the checks no relay may skip "
        "(each upload's hash, the sum, the reply's hash, each peer hashing what it got): "
        "checked_tcp_s, and floor_ratio = checked_tcp_s / raw_tcp_s",
    )
    parser.add_argument(
        "--floor-hash",
        default="sha256",
        choices=("sha256", "blake3"),
        help="the hash of --floor (sha256: the protocol's)",
    )
    args = parser.parse_args()
    numel = int(args.mb * 2**20) // 4

    raw = run_raw_tcp(args.peers, numel * 4, args.rounds)
    checked = run_raw_tcp(args.peers, numel * 4, args.rounds, checked=args.floor_hash) if args.floor else None
    relay, final, table = run_relay_rounds(args.peers, numel, args.rounds, args.aggregators, args.breakdown)
    mean = sum(gradient(i, numel).astype(np.float64) for i in range(args.peers)) / (args.peers * SAMPLES)
    max_abs_err = float(np.max(np.abs(final - (-args.rounds * mean))))

    round_s, raw_s = statistics.median(relay), statistics.median(raw)
    print(f"relay rounds (s):   {' '.join(f'{s:.3f}' for s in relay)}")
    print(f"raw TCP rounds (s): {' '.join(f'{s:.3f}' for s in raw)}")
    print(
        f"{args.peers} peers x {args.mb:g} MiB: relay {round_s:.3f} s/round, raw TCP {raw_s:.3f} s, "
        f"ratio {round_s / raw_s:.2f}; max |error| vs float64 reference {max_abs_err:.2e}"
    )
    result = {
        "peers": args.peers,
        "mb": args.mb,
        "aggregators": args.aggregators,
        "round_s": round(round_s, 4),
        "raw_tcp_s": round(raw_s, 4),
        "ratio": round(round_s / raw_s, 3),
        "max_abs_err": max_abs_err,
    }
    if checked:
        checked_s = statistics.median(checked)
        print(
            f"raw TCP with the checks (s): {' '.join(f'{s:.3f}' for s in checked)}; "
            f"floor ratio {checked_s / raw_s:.2f}"
        )
        result |= {
            "floor_hash": args.floor_hash,
            "checked_tcp_s": round(checked_s, 4),
            "floor_ratio": round(checked_s / raw_s, 3),
        }
    if table:
        names = list(table[0])
        print("phase medians (s): " + ", ".join(f"{n} {statistics.median(r[n] for r in table):.3f}" for n in names))
        result["breakdown_s"] = {n: round(statistics.median(r[n] for r in table), 4) for n in names}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
