"""The DMoE benchmarks (issue 14, MODEL_PARALLEL.md s2.5 A8-A10) at reduced settings, asserting
their acceptance thresholds; and the latency proxy they stand on.

* ``benchmarks/moe_broker.py`` (A8): an expert call's round trip through a real relay and a real
  host stays within median 10 ms / p99 50 ms, and the relay moves 4 x payload per forward call
  plus headers (ratio 1.00-1.05);
* ``benchmarks/moe_latency.py`` (A9, Figure 4; issue 24): trainers started by ``toolkit.join()``
  keep J micro-batches in flight, and at 200 ms injected latency keep >= 80% of their 0 ms
  throughput and are >= 3x join with one micro-batch at a time (``moe_in_flight=1``);
* ``benchmarks/moe_failures.py`` (A10, Figure 5): training with 10% failed expert calls costs
  <= 1.5 points of validation accuracy (mean over 3 seeds; see the test for the reading that
  keeps failing at evaluation, which does not meet 1.5).

Each runs the script as a process and reads its last stdout line (one JSON object). Thresholds are
A8-A10's; the numbers measured at full settings are in docs/benchmarks.md. One
default-run test checks a fix the benchmarks led to: the relay caller's connection pool.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading

import pytest
import torch

from relay_server.harness.latency_proxy import LatencyProxy
from tests.support.moe import UIDS, Member, directory, overrides, start_host, stop
from tests.support.processes import REPO


def run_benchmark(script: str, *args: str, timeout_s: float = 600) -> dict:
    done = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    print(done.stdout)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _echo_server() -> tuple[socket.socket, int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(1 << 16):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


@pytest.mark.integration
def test_the_latency_proxy_forwards_every_byte_in_order_and_counts_them() -> None:
    server, port = _echo_server()
    sent = bytes(range(256)) * 1000  # 256,000 bytes, several chunks
    try:
        with LatencyProxy(port, delay_s=0.02) as proxy, socket.create_connection(("127.0.0.1", proxy.port)) as conn:
            conn.sendall(sent)
            got = b""
            while len(got) < len(sent):
                got += conn.recv(1 << 16)
            conn.shutdown(socket.SHUT_WR)
            assert conn.recv(1) == b""  # the end of the stream is forwarded too
            assert got == sent
            assert (proxy.bytes_up, proxy.bytes_down) == (len(sent), len(sent))
    finally:
        server.close()


def test_the_relay_caller_keeps_one_connection_per_worker(start_relay, tmp_path) -> None:
    """16 calls in flight at a time, 20 times, through a real relay and host: the caller reuses
    at most one connection per worker (requests' default pool of 10 made it open and discard a new
    one for most calls beyond the tenth: 85 connections for 320 calls in the benchmark rig)."""
    from relay_server.harness.process import wait_until
    from toolkit.client import RelayClient
    from toolkit.moe.remote import RelayExpertCaller

    relay = start_relay(overrides(0))
    host = start_host(relay.url, "host", 8, tmp_path / "host.log")
    trainer = Member(relay.url, "trainer")
    try:
        wait_until(lambda: len(directory(relay.url)["live"]) == 8, 60, "the host's 8 experts")
        with LatencyProxy(relay.port) as proxy:
            caller = RelayExpertCaller(RelayClient(proxy.url, retries=0), trainer.peer_id, max_workers=16)
            x = torch.randn(3, 8)
            for _ in range(20):
                for future in [caller.forward(uid, x) for uid in UIDS + UIDS]:
                    future.result(timeout=30)
            caller.close()
            assert proxy._counters.connections <= 16, proxy._counters.connections
    finally:
        trainer.close()
        stop([host])


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_broker_round_trip_and_bytes_per_call() -> None:
    out = run_benchmark("moe_broker.py", "--calls", "300")
    for run in (out, out["hf"]):  # an open run, then one with logins and every request signed
        assert run["payload_bytes"] == 64 * 1024
        assert run["rtt_median_ms"] <= 10 and run["rtt_p99_ms"] <= 50, run
        assert 1.0 <= run["bytes_per_call_ratio"] <= 1.05, run


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_join_keeps_its_throughput_under_latency_and_beats_one_at_a_time() -> None:
    out = run_benchmark("moe_latency.py", "--deltas", "0,200", "--seconds", "8")
    assert out["failures"] == 0 and out["j_meets_bound"] and out["in_flight"] > 1, out
    assert out["keep_200ms"] >= 0.8, out
    assert out["vs_one_at_a_time_200ms"] >= 3, out


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hosts_behind_latency_still_serve_many_calls_in_flight() -> None:
    """Hosts behind the delay too: results leave the host on their own threads, so join still
    beats one-at-a-time by 3x at 200 ms (when the runtime thread sent them: 0 micro-batches)."""
    out = run_benchmark("moe_latency.py", "--deltas", "0,200", "--seconds", "8", "--hosts-through-proxy")
    assert out["failures"] == 0, out
    assert out["vs_one_at_a_time_200ms"] >= 3, out


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(900)  # six training runs: about 2.5 minutes idle, twice that on a busy machine
def test_ten_percent_failed_calls_cost_little_accuracy() -> None:
    """A10's threshold (<= 1.5 points) holds for what training under failures produced (``clean``
    evaluation). Evaluated while still failing 10% of its calls, the model loses about 1.5 points
    more at inference (2.37 points at full settings, 3 seeds): that reading does not meet A10's
    1.5 and is bounded here at the calibrated 3.5 so a regression still shows."""
    out = run_benchmark("moe_failures.py", "--steps", "1500", "--seeds", "0,1,2")
    assert all(abs(r["failures"]["failed_fraction"] - 0.1) < 0.02 for r in out["per_seed"]), out
    assert out["accuracy"]["no_failures"] >= 0.85, out  # the task was learnt at all
    assert out["accuracy_drop_points_clean"] <= 1.5, out
    assert out["accuracy_drop_points"] <= 3.5, out
