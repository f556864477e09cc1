"""A TCP proxy on 127.0.0.1 that can cut its clients off: a volunteer's network blip, on demand.

``BlipProxy(upstream_port)`` forwards every connection to ``127.0.0.1:upstream_port``. While
:meth:`drop` holds, every open connection is closed and every new one is closed as soon as it is
accepted (the client sees connection errors, as behind a dead Wi-Fi link); :meth:`restore`
forwards again. It runs its own event loop on a thread of the test process.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class BlipProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.dropped = False
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
            target=lambda: self._loop.run_until_complete(serve()), daemon=True, name="blip-proxy"
        )
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the blip proxy did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def drop(self) -> None:
        """Cut every client off until :meth:`restore`."""

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
        if self.dropped:  # drop() ran while this connection was opening upstream: it missed it
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()
            return
        try:
            await self.forward(reader, up_writer, up_reader, writer)
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    async def forward(
        self,
        reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        """Carry one connection both ways until either side closes: untouched here; a proxy that
        shapes what passes (:class:`tests.support.slow_proxy.SlowProxy`) overrides this alone."""
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
