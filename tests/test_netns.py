"""Shaped hosts for ``benchmarks/shaped.py``: real namespaces that talk, and leave nothing behind.

Skipped (with the reason) where namespaces cannot be made: no root / CAP_NET_ADMIN, no iproute2.
Rates are the benchmark's business; the suite asserts no timings.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from relay_server.harness.netns import Star, unavailable
from tests.support.processes import REPO

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"shaped links unavailable: {REASON}")

ECHO_SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], 9000))
print("ready", flush=True)
conn, _ = server.accept()
data = b""
while len(data) < 1_000_000:
    data += conn.recv(65536)
conn.sendall(len(data).to_bytes(8, "big"))
"""

CLIENT = """
import socket, sys
sock = socket.create_connection((sys.argv[1], 9000), timeout=30)
sock.sendall(b"x" * 1_000_000)
print(int.from_bytes(sock.recv(8), "big"))
"""


def _leftovers(tag: str) -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [line for line in (names + links).splitlines() if f"ct{tag}" in line or f"ctbr{tag}" in line]


@pytest.mark.integration
def test_hosts_reach_each_other_only_through_their_links_and_are_removed() -> None:
    star = Star()
    a, b = star.add("a", 50), star.add("b", 20, download_mbit=40)
    with star:
        server = subprocess.Popen(
            a.command([sys.executable, "-c", ECHO_SERVER, a.address]), stdout=subprocess.PIPE, text=True
        )
        try:
            assert server.stdout.readline().strip() == "ready"
            got = subprocess.run(
                b.command([sys.executable, "-c", CLIENT, a.address]), capture_output=True, text=True, timeout=60
            )
            assert got.returncode == 0, got.stderr
            assert int(got.stdout) == 1_000_000
        finally:
            server.kill()
            server.wait()
        qdiscs = subprocess.run(b.command(["tc", "qdisc", "show"]), capture_output=True, text=True).stdout
        assert "tbf" in qdiscs and "20Mbit" in qdiscs  # b's upload is shaped
        assert _leftovers(star.tag)
    assert _leftovers(star.tag) == []


@pytest.mark.integration
@pytest.mark.slow
def test_shaped_benchmark_runs_end_to_end() -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/shaped.py", "--mb", "2", "--rounds", "1", "--warmup", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"plan_s", "single_relay_s", "equal_split_s"} <= set(result)
    assert abs(sum(result["fractions"].values()) - 1) < 1e-3
