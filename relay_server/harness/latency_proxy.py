"""A TCP proxy on 127.0.0.1 that adds latency and counts bytes: the benchmarks' slow internet.

    python -m relay_server.harness.latency_proxy --upstream 8750 --delay-ms 100      # prints its port, then runs

Every chunk read from one side is written to the other ``delay_ms / 2`` later, in order, in each
direction, so a request/answer round trip through it costs ``delay_ms`` more (the delta of
Learning@home's Figure 4) while bandwidth is not limited: chunks in flight overlap, as packets on a
long link do. Connection setup is local (the proxy accepts at once and dials upstream at once), so
a new TCP connection costs no extra round trip; only data does. The proxy counts the bytes it
forwards up (client -> upstream) and down.

Two ways to run it:

* :class:`LatencyProxy` in this process, on its own event-loop thread (``with LatencyProxy(port,
  delay_s) as proxy: ... proxy.bytes_up``): for counting bytes, where timing jitter does not matter;
* this file as a process (:func:`spawn`): for timing, so the proxy's loop never waits for the
  benchmark's threads to release the GIL. It prints ``{"port": N}`` when it listens, takes
  commands on stdin (a new delay in ms, or ``stats``), and prints ``{"bytes_up", "bytes_down",
  "connections"}`` when it gets SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

CHUNK = 1 << 16


class _Counters:
    def __init__(self) -> None:
        self.up = self.down = self.connections = 0


async def _pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    delay_s: Callable[[], float],
    count: Callable[[int], None],
) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``delay_s()`` after it arrived, order kept."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()

    sender = asyncio.ensure_future(deliver())
    try:
        while True:
            data = await reader.read(CHUNK)
            count(len(data))
            queue.put_nowait((loop.time() + delay_s(), data))
            if not data:
                break
        await sender
    except (ConnectionError, OSError):
        sender.cancel()


class LatencyProxy:
    """Listen on 127.0.0.1 (a free port: :attr:`port`), forward to ``127.0.0.1:upstream_port``
    with ``delay_s / 2`` added in each direction (``delay_s`` may be changed while it runs).
    :attr:`bytes_up` / :attr:`bytes_down` count what went client -> upstream and back."""

    def __init__(self, upstream_port: int, delay_s: float = 0.0, host: str = "127.0.0.1") -> None:
        self.upstream_port, self.delay_s, self.host = upstream_port, delay_s, host
        self.port = 0
        self._counters = _Counters()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None

    @property
    def bytes_up(self) -> int:
        return self._counters.up

    @property
    def bytes_down(self) -> int:
        return self._counters.down

    @property
    def connections(self) -> int:
        return self._counters.connections

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop_serving(self) -> None:
        """End :meth:`serve`; call it on the proxy's own loop (a signal handler there)."""
        if self._stopped is not None:
            self._stopped.set()

    async def serve(self, ready: threading.Event | None = None) -> None:
        """Run until :meth:`close` (or the task is cancelled)."""
        self._loop, self._stopped = asyncio.get_running_loop(), asyncio.Event()
        server = await asyncio.start_server(self._handle, self.host, 0)
        self.port = server.sockets[0].getsockname()[1]
        if ready is not None:
            ready.set()
        try:
            await self._stopped.wait()
        finally:
            server.close()  # no wait_closed: since 3.12 it waits for every kept-alive connection

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self._counters.connections += 1
        try:
            up_r, up_w = await asyncio.open_connection(self.host, self.upstream_port)
        except OSError:
            client_w.close()
            return
        counters = self._counters

        def half() -> float:
            """Read per chunk: a new delay applies to bytes that arrive after it."""
            return self.delay_s / 2

        def up(n: int) -> None:
            counters.up += n

        def down(n: int) -> None:
            counters.down += n

        try:
            await asyncio.gather(_pipe(client_r, up_w, half, up), _pipe(up_r, client_w, half, down))
        except asyncio.CancelledError:
            pass  # the proxy is stopping
        for w in (client_w, up_w):
            w.close()

    def __enter__(self) -> LatencyProxy:
        ready = threading.Event()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self.serve(ready)), name="latency-proxy", daemon=True
        )
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the latency proxy did not start listening within 10 s")
        return self

    def close(self) -> None:
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        if self._thread is not None:
            self._thread.join(5)

    def __exit__(self, *exc: object) -> None:
        self.close()


class ProxyProcess:
    """This file run as its own process (:func:`spawn`); :meth:`stop` returns its byte counts."""

    def __init__(self, proc: subprocess.Popen[str], port: int) -> None:
        self.proc, self.port = proc, port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_delay(self, delay_s: float) -> None:
        """The round-trip delay from now on (bytes already queued keep theirs)."""
        self._command(f"{delay_s * 1000}")  # answered once the new delay is in force

    def counts(self) -> dict[str, int]:
        """``{"bytes_up", "bytes_down", "connections"}`` so far."""
        return self._command("stats")

    def _command(self, line: str) -> dict[str, int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> dict[str, int]:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=10)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        return json.loads(lines[-1]) if lines else {}


def spawn(upstream_port: int, delay_s: float) -> ProxyProcess:
    """Start ``python -m relay_server.harness.latency_proxy`` in front of ``upstream_port``."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relay_server.harness.latency_proxy",
            "--upstream",
            str(upstream_port),
            "--delay-ms",
            str(delay_s * 1000),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("{"):
        proc.kill()
        raise RuntimeError(f"the latency proxy did not start (it printed {line!r})")
    return ProxyProcess(proc, int(json.loads(line)["port"]))


def _counts(proxy: LatencyProxy) -> dict[str, int]:
    return {"bytes_up": proxy.bytes_up, "bytes_down": proxy.bytes_down, "connections": proxy.connections}


def _commands(proxy: LatencyProxy) -> None:
    """stdin, one command a line: a number sets the round-trip delay (ms); ``stats`` prints the
    counters. Each is answered with one JSON line."""
    for line in sys.stdin:
        if line.strip() == "stats":
            print(json.dumps(_counts(proxy)), flush=True)
        else:
            proxy.delay_s = float(line) / 1000
            print(json.dumps({"delay_ms": float(line)}), flush=True)


async def _main(upstream: int, delay_s: float) -> None:
    proxy = LatencyProxy(upstream, delay_s)
    ready = threading.Event()
    task = asyncio.ensure_future(proxy.serve(ready))
    while not ready.is_set():
        await asyncio.sleep(0.01)
    print(json.dumps({"port": proxy.port}), flush=True)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, proxy.stop_serving)

    threading.Thread(target=_commands, args=(proxy,), daemon=True).start()
    await task
    print(json.dumps(_counts(proxy)), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", type=int, required=True, help="port on 127.0.0.1 to forward to")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="added round-trip latency (half each way)")
    args = parser.parse_args(argv)
    asyncio.run(_main(args.upstream, args.delay_ms / 1000))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
