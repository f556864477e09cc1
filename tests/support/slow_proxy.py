"""A TCP proxy in front of a relay that slows its stage downloads, so a test can kill the relay
while a worker is in the middle of one.

On 127.0.0.1 a relay writes a stage's parameters (a few hundred KB) into the kernel in one go,
and a worker has them a millisecond later: no kill can land mid-body. Behind this proxy, while
:attr:`SlowProxy.slow` holds, the answer to a stage-slice download (``GET /api/params?...start=``)
trickles to the worker ``piece`` bytes at a time, and :attr:`SlowProxy.mid_download` is set once
such an answer has sent part of its body. :meth:`drop` then does what the relay's death does to
the workers behind a proxy: every open connection is cut (the body mid-way) and new ones are
refused until :meth:`restore`. Everything else passes untouched. It runs its own event loop on a
thread of the test process, as ``tests/support/blip.py``'s proxy does.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class SlowProxy:
    def __init__(self, upstream_port: int, *, piece: int = 4096, pause_s: float = 0.05) -> None:
        self.upstream_port, self.piece, self.pause_s = upstream_port, piece, pause_s
        self.slow = True
        self.dropped = False
        self.mid_download = threading.Event()
        """Set once a stage download's answer sent part of its body (and had more to send)."""
        self.port = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def serve() -> None:
            server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            ready.set()
            async with server:
                with contextlib.suppress(asyncio.CancelledError):  # close() ends it
                    await server.serve_forever()

        self._thread = threading.Thread(
            target=lambda: self._loop.run_until_complete(serve()), daemon=True, name="slow-proxy"
        )
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the slow proxy did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def drop(self) -> None:
        """Cut every connection (bodies mid-way included) and refuse new ones until :meth:`restore`."""

        def cut() -> None:
            self.dropped = True
            for writer in list(self._writers):
                writer.transport.abort()

        self._loop.call_soon_threadsafe(cut)

    def restore(self) -> None:
        self._loop.call_soon_threadsafe(setattr, self, "dropped", False)

    def close(self) -> None:
        self.drop()
        self._loop.call_soon_threadsafe(lambda: [task.cancel() for task in asyncio.all_tasks(self._loop)])
        self._thread.join(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.dropped:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        stage_download = [False]  # whether the connection's latest request is one
        try:
            await asyncio.gather(
                self._requests(reader, up_writer, stage_download), self._answers(up_reader, writer, stage_download)
            )
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    async def _requests(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stage_download: list[bool]
    ) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(1 << 16):
                if data[:8].split(b" ")[0] in (b"GET", b"PUT", b"POST", b"DELETE", b"HEAD"):  # a new request
                    line = data.split(b"\r\n", 1)[0]
                    stage_download[0] = line.startswith(b"GET /api/params?") and b"start=" in line
                writer.write(data)
                await writer.drain()

    async def _answers(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stage_download: list[bool]
    ) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(1 << 16):
                if not (self.slow and stage_download[0]):
                    writer.write(data)
                    await writer.drain()
                    continue
                for offset in range(0, len(data), self.piece):
                    writer.write(data[offset : offset + self.piece])
                    await writer.drain()
                    if offset + self.piece < len(data):
                        self.mid_download.set()
                    await asyncio.sleep(self.pause_s)
