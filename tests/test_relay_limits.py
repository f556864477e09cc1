"""A relay that stalled or hostile connections cannot wear down (issue 15), on real relay processes.

* descriptors: with a soft and hard RLIMIT_NOFILE of 64 the relay still serves a crowd of 200
  idle connections and honest peers: not one request hangs (refusals are 503 + Retry-After);
* no corrupted response: an error after the headers went out cuts the connection (one status
  line, a short body), and a peer whose download is cut or altered on the way retries and ends
  with the published parameters (a proxy on 127.0.0.1 does the cutting);
* a gradient upload that stalls half-way is cut after ``connections.body_idle_timeout_s`` and its
  peer expires by its TTL;
* 50 slowloris connections (slow headers, slow bodies) do not stop rounds;
* a relay whose own event loop stalls past the peers' TTL does not hold that deafness against
  them: its peers are still members afterwards.

No timing assertions: every wait is a bound on something that must happen.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import resource
import select
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from relay_server.harness import zygote
from relay_server.harness.process import RelayProcess, wait_until
from relay_server.harness.thread import RelayThread
from tests.support.processes import REPO, merged, write_config
from toolkit.client import RelayClient
from toolkit.wire.compression import get_codec
from toolkit.wire.protocol import PROTOCOL_VERSION, ROUTES, GradientMeta, Heartbeat, JoinRequest
from toolkit.wire.tensor_container import iter_encoded


def start_limited(
    tmp_path: Path, overrides: dict, *, soft: int, hard: int | None = None, name: str = "relay"
) -> RelayProcess:
    """A relay process whose RLIMIT_NOFILE is (soft, hard) from its first instruction on."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1] if hard is None else hard
    config = write_config(tmp_path / f"{name}.toml", merged(overrides))
    return RelayProcess(  # only this process: peers keep the test's limits
        config,
        tmp_path / f"{name}-data",
        tmp_path / f"{name}.log",
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)),
    ).start()


@pytest.fixture
def limited_relay(tmp_path: Path):
    relays: list[RelayProcess] = []

    def start(overrides: dict, **kwargs) -> RelayProcess:
        relays.append(start_limited(tmp_path, overrides, **kwargs))
        return relays[-1]

    yield start
    for relay in relays:
        relay.stop()


class Crowd:
    """``n`` hostile or idle connections held from a thread. ``opening`` is what each sends first;
    then one byte of ``trickle`` every ``every_s`` (None: nothing more). With ``reopen`` a
    connection the relay closed or answered is opened again at once (about once a second)."""

    def __init__(
        self,
        port: int,
        n: int,
        opening: bytes = b"",
        trickle: bytes | None = None,
        every_s: float = 0.5,
        reopen: bool = True,
    ) -> None:
        self.port, self.n, self.opening, self.trickle, self.every_s = port, n, opening, trickle, every_s
        self.reopen = reopen
        self.reopened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Crowd":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _open(self) -> socket.socket | None:
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=2)
            sock.sendall(self.opening)
            sock.setblocking(False)
            return sock
        except OSError:
            return None

    def _run(self) -> None:
        socks: list[socket.socket | None] = [self._open() for _ in range(self.n)]
        next_byte = time.monotonic() + self.every_s
        next_open = [0.0] * self.n
        while not self._stop.is_set():
            live = [s for s in socks if s is not None]
            readable, _, _ = select.select(live, [], [], 0.1) if live else ([], [], [])
            for i, sock in enumerate(socks):
                if sock is not None and sock in readable:  # closed or answered by the relay
                    sock.close()
                    socks[i] = None
                    self.reopened += 1
                if socks[i] is None and self.reopen and time.monotonic() >= next_open[i]:
                    socks[i] = self._open()
                    next_open[i] = time.monotonic() + 1.0
            if self.trickle and time.monotonic() >= next_byte:
                next_byte = time.monotonic() + self.every_s
                for sock in socks:
                    try:
                        sock and sock.send(self.trickle[:1])
                    except OSError:
                        pass
        for sock in socks:
            if sock is not None:
                sock.close()


def poll_status(url: str, seconds: float) -> dict[str, int]:
    """GET /api/status for ``seconds``: how many answered, were refused (503) or hung (timeout)."""
    counts = {"ok": 0, "busy": 0, "hung": 0, "other": 0}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            code = requests.get(url + "/api/status", timeout=20).status_code
            counts["ok" if code == 200 else "busy" if code == 503 else "other"] += 1
        except requests.Timeout:
            counts["hung"] += 1
        except requests.ConnectionError:
            counts["busy"] += 1  # refused at the door: a fast answer, not a hang
        time.sleep(0.2)
    return counts


def test_low_descriptor_limit_serves_an_idle_crowd_and_peers(limited_relay, launch_peer) -> None:
    relay = limited_relay({"connections": {"idle_timeout_s": 3.0}}, soft=64, hard=64)
    with Crowd(relay.port, 200, reopen=False) as crowd:
        peers = [launch_peer(relay.url, f"p{i}", seed=i, batch_size=8 + 8 * i, steps=3) for i in range(2)]
        counts = poll_status(relay.url, 5.0)
        assert all(peer.wait(timeout_s=180) == 0 for peer in peers), [p.log_path.read_text()[-2000:] for p in peers]
        counts["hung"] += poll_status(relay.url, 1.0)["hung"]
    log = relay.log_path.read_text()
    assert counts["hung"] == 0 and counts["ok"] > 0, counts
    assert "descriptors: soft limit 64 (hard limit)" in log
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]  # at most one quiet warning a minute
    assert relay.status()["step"] >= 3
    assert crowd.reopened > 100  # refused at the door or closed as idle: they did not just pile up


class CuttingProxy:
    """A TCP proxy on 127.0.0.1 that spoils the first parameters download passing through it:
    ``mode`` "cut" closes it a few bytes into the body, "corrupt" flips one byte of the body."""

    def __init__(self, upstream_port: int, mode: str) -> None:
        self.upstream_port, self.mode, self.spoiled = upstream_port, mode, 0
        self.loop = asyncio.new_event_loop()
        self.port = 0
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        params = asyncio.Event()  # this connection carries a GET /api/params

        async def upstream() -> None:
            while data := await reader.read(65536):
                if b"GET " + ROUTES["params"].encode() in data:
                    params.set()
                up_writer.write(data)
                await up_writer.drain()
            up_writer.close()

        async def downstream() -> None:
            seen = b""
            while data := await up_reader.read(65536):
                if params.is_set() and not self.spoiled and b"application/octet-stream" in seen + data:
                    seen += data
                    if b"\r\n\r\n" in seen and len(seen) > seen.index(b"\r\n\r\n") + 120:
                        body_at = seen.index(b"\r\n\r\n") + 4
                        self.spoiled += 1
                        if self.mode == "cut":
                            writer.write(seen[: body_at + 100])
                            await writer.drain()
                            writer.transport.abort()
                            up_writer.close()
                            return
                        spoiled = bytearray(seen)
                        spoiled[-1] ^= 0xFF
                        data = bytes(spoiled)
                    else:
                        continue
                writer.write(data)
                await writer.drain()
            writer.close()

        await asyncio.gather(upstream(), downstream(), return_exceptions=True)


@pytest.mark.xdist_group("relay_limits_spoiled")  # one relay for both modes (they only download)
@pytest.mark.parametrize("mode", ["cut", "corrupt"])
def test_spoiled_download_is_retried_and_ends_right(shared_relay, mode: str) -> None:
    relay = shared_relay()
    proxy = CuttingProxy(relay.port, mode)
    try:
        client = RelayClient(f"http://127.0.0.1:{proxy.port}", backoff_s=0.05)
        run = client.get_run()
        public = np.zeros(run.num_params, dtype=np.float32)
        assert client.params.download_params(public) == 0
        client.close()
    finally:
        proxy.close()
    assert proxy.spoiled == 1  # the first answer was spoiled; the retry came through whole
    expected = requests.get(relay.url + ROUTES["state"], timeout=10).json()["sha256"]
    assert hashlib.sha256(public.tobytes()).hexdigest() == expected


@pytest.mark.integration
def test_error_after_headers_cuts_the_connection_instead_of_a_second_response() -> None:
    """The middleware's answer to an error mid-body: the connection is cut, never a 500 spliced
    into the body that a peer would read as parameters."""
    from aiohttp import web

    from relay_server.core.http import error_middleware

    async def half(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_length = 1000
        await response.prepare(request)
        await response.write(b"x" * 10)
        raise OSError(24, "Too many open files")  # what opening the version file raised in the field

    app = web.Application(middlewares=[error_middleware])
    app.router.add_get("/half", half)
    with (
        RelayThread(app=app).start() as served,
        socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock,
    ):
        sock.sendall(b"GET /half HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.count(b"HTTP/1.1") == 1 and data.startswith(b"HTTP/1.1 200")
    assert len(data.split(b"\r\n\r\n", 1)[1]) < 1000  # short: the client knows it was cut


def test_stalled_upload_is_cut_and_its_peer_expires(start_relay) -> None:
    relay = start_relay({"connections": {"body_idle_timeout_s": 1.0}})
    client = RelayClient(relay.url)
    run = client.get_run()
    joined = client.join(JoinRequest(peer_name="staller", protocol=PROTOCOL_VERSION, device={"kind": "cpu"}))
    state = client.heartbeat(joined.peer_id, Heartbeat(version=0, samples=48, samples_per_s=10.0))
    assert state.round is not None  # 48 samples = the target batch: round 0 waits for this peer
    meta = GradientMeta(peer_id=joined.peer_id, step=0, version=0, samples=48, loss_sum=1.0)
    tensors = get_codec("none").encode(np.ones(run.num_params, dtype=np.float32))
    body = b"".join(
        bytes(piece) for piece in iter_encoded(tensors, {"collab": meta.dumps().decode(), "codec": "none"})
    )
    path = ROUTES["gradient"].format(step=0) + f"?peer_id={joined.peer_id}"
    with socket.create_connection(("127.0.0.1", relay.port), timeout=30) as sock:
        sock.sendall(
            f"PUT {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body[:-100]
        )  # then nothing
        relay.wait_for(
            lambda s: s["num_peers"] == 0 and s["round"] is None,
            timeout_s=30,
            what="the stalled peer to expire and its round to close",
        )
        sock.settimeout(10)
        try:
            closed = sock.recv(65536) == b""
        except ConnectionResetError:
            closed = True
    client.close()
    log = relay.log_path.read_text()
    assert closed and "no body byte" in log and "peer staller timed out" in log, log[-3000:]


def test_a_stall_of_the_relay_itself_expires_nobody(serve_relay) -> None:
    relay = serve_relay({"rounds": {"heartbeat_interval_s": 0.3, "peer_ttl_s": 2.0}})
    client = RelayClient(relay.url)
    joined = client.join(JoinRequest(peer_name="patient", protocol=PROTOCOL_VERSION, device={"kind": "cpu"}))
    client.heartbeat(joined.peer_id, Heartbeat(version=0, samples=0, samples_per_s=10.0))
    relay.call(functools.partial(time.sleep, 3.0))  # the relay's loop blocked for longer than peer_ttl_s
    assert relay.status()["num_peers"] == 1  # the ticks that ran after the stall kept the peer
    client.close()


def test_slowloris_connections_do_not_stop_rounds(limited_relay, launch_peer) -> None:
    relay = limited_relay({"connections": {"idle_timeout_s": 2.0, "body_idle_timeout_s": 2.0}}, soft=64)
    head = b"GET /api/status HTTP/1.1\r\nHost: x\r\n"
    body = (
        f"POST {ROUTES['join']} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 900\r\n\r\n{{"
    ).encode()  # then a byte every 3 s: cut after 2 s without one
    with (
        Crowd(relay.port, 25, head, trickle=b"X", every_s=0.5) as slow_heads,
        Crowd(relay.port, 25, body, trickle=b" ", every_s=3.0) as slow_bodies,
    ):
        peers = [launch_peer(relay.url, f"p{i}", seed=i, batch_size=8 + 8 * i, steps=3) for i in range(2)]
        assert all(peer.wait(timeout_s=180) == 0 for peer in peers), [p.log_path.read_text()[-2000:] for p in peers]
        deadline = time.monotonic() + 30
        while "no body byte" not in relay.log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)  # the slow bodies are cut (a byte every 3 s, the timeout 2 s)
    log = relay.log_path.read_text()
    assert "descriptors: soft limit raised from 64" in log
    assert slow_heads.reopened > 0 and slow_bodies.reopened > 0  # the relay closed them: they came back
    assert "no body byte" in log and "Traceback" not in log, log[-3000:]


def test_peer_gone_mid_download_or_long_poll_is_one_info_line_and_expires(start_relay) -> None:
    """A peer that vanishes while its parameters stream costs one INFO line (no traceback), and one
    that vanishes while long-polling is not kept alive by the poll: it expires by its TTL."""
    relay = start_relay({"model": {"factory": "toolkit.models:Vector", "kwargs": {"numel": 4_000_000}}})
    client = RelayClient(relay.url)
    joined = client.join(JoinRequest(peer_name="leaver", protocol=PROTOCOL_VERSION, device={"kind": "cpu"}))
    for query in ("min_step=0", f"min_step=1&wait=60&peer_id={joined.peer_id}"):  # 16 MB body; a long-poll
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the relay cannot push 16 MB into buffers
        sock.settimeout(30)
        sock.connect(("127.0.0.1", relay.port))
        sock.sendall(f"GET {ROUTES['params']}?{query} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        if query == "min_step=0":
            sock.recv(4096)  # the response started
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()  # linger 0: a reset, as a closed notebook tab
    relay.wait_for(lambda s: s["num_peers"] == 0, timeout_s=30, what="the long-polling peer to expire")
    client.close()
    log = relay.log_path.read_text()
    # Whether the reset reaches a write depends on socket buffers (sendfile may have handed the kernel
    # everything already): at most one INFO line, never an ERROR.
    assert "peer leaver timed out" in log and log.count("disconnected") <= 1, log[-3000:]
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


def test_per_address_and_upload_byte_caps(start_relay) -> None:
    """Past ``max_per_address`` an address's longest-idle connection makes room (the newcomer is
    served); an upload that would put more than ``max_upload_bytes`` in flight is answered 503 +
    Retry-After before any of its body is read, and one larger than the cap itself (it could never
    fit) 413. The upload in flight is an expert checkpoint a host streams slowly."""
    relay = start_relay(
        {
            "connections": {"exempt_loopback": False, "max_per_address": 3, "max_upload_bytes": 2_000_000},
            "moe": {"enabled": True, "grid": [1, 1], "expert": {"kind": "ffn", "d": 8, "hidden": 16384}},
        }
    )
    idle = [socket.create_connection(("127.0.0.1", relay.port), timeout=10) for _ in range(3)]
    client = RelayClient(relay.url)  # retries a 503 (the idle ones may still be being registered)
    assert client.get_status().run_name == "test-run"
    client.close()
    assert idle[0].recv(1) == b""  # the longest-idle connection was closed to admit the request
    for sock in idle:
        sock.close()
    host = RelayClient(relay.url)
    host_id = host.join(JoinRequest(peer_name="host", protocol=PROTOCOL_VERSION)).peer_id
    lease = ROUTES["moe_lease"].format(peer_id=host_id)
    [uid] = host.transport.request("POST", lease, params={"capacity": 1}).json()["uids"]
    checkpoint = ROUTES["moe_checkpoint"].format(peer_id=host_id, uid=uid)

    def upload(path: str, length: int) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", relay.port), timeout=10)
        sock.sendall(
            f"PUT {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
            f"Content-Length: {length}\r\n\r\n".encode()
            + b"\0" * 8
        )  # a body that stalls
        return sock

    with upload(checkpoint, 1_500_000):  # in flight: 1.5 MB of the 2 MB reserved
        host.heartbeat(host_id, Heartbeat(version=0, samples=0, samples_per_s=0.0))
        wait_until(lambda: relay.status(), 10, "the relay to have read the slow upload's headers")
        with upload(f"{ROUTES['gradient'].format(step=0)}?peer_id={host_id}", 1_100_000) as sock:
            answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 2" in answer, answer[:300]
    with upload(f"{ROUTES['gradient'].format(step=0)}?peer_id={host_id}", 3_000_000) as sock:
        answer = sock.recv(65536)  # 3 MB never fits a 2 MB cap: too large, not busy
    assert answer.startswith(b"HTTP/1.1 413") and b"body_too_large" in answer, answer[:300]
    host.close()


def many_peers(*args: str, timeout_s: float) -> dict:
    """Run benchmarks/many_peers.py; its last line is the JSON summary."""
    done = zygote.run(
        [sys.executable, "benchmarks/many_peers.py", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    print(done.stdout)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("auth, ratio", [("open", 0.5), ("hf", 0.4)])
def test_a_thousand_peers_on_one_relay(auth: str, ratio: float) -> None:
    """The issue's target: 1,000 light peers on a relay started with a soft limit of 1024, no
    error, every update exact, rounds/min at least half of 16 peers' (0.4 with signed requests)."""
    summary = many_peers("--peers", "16,1000", "--auth", auth, "--duration", "40", timeout_s=1500)
    assert summary["errors"] == 0 and summary["exact"], summary
    assert summary["rounds_per_min_ratio"] >= ratio, summary


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_soak_ten_minutes_of_a_thousand_peers() -> None:
    summary = many_peers("--peers", "1000", "--duration", "600", timeout_s=1500)
    assert summary["errors"] == 0 and summary["exact"], summary
