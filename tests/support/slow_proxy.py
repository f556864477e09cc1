"""A TCP proxy in front of a relay that slows its stage downloads, so a test can kill the relay
while a worker is in the middle of one.

On 127.0.0.1 a relay writes a stage's parameters (a few hundred KB) into the kernel in one go,
and a worker has them a millisecond later: no kill can land mid-body. Behind this proxy, while
:attr:`SlowProxy.slow` holds, the answer to a stage-slice download (``GET /api/params?...start=``)
trickles to the worker ``piece`` bytes at a time, and :attr:`SlowProxy.mid_download` is set once
such an answer has sent part of its body. :meth:`drop` then does what the relay's death does to
the workers behind a proxy: every open connection is cut (the body mid-way) and new ones are
refused until :meth:`restore`. Everything else passes untouched. It runs its own event loop on a
thread of the test process: it is ``tests/support/blip.py``'s proxy with its own forwarding.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from tests.support.blip import BlipProxy


class SlowProxy(BlipProxy):
    def __init__(self, upstream_port: int, *, piece: int = 4096, pause_s: float = 0.05) -> None:
        self.piece, self.pause_s = piece, pause_s
        self.slow = True
        self.mid_download = threading.Event()
        """Set once a stage download's answer sent part of its body (and had more to send)."""
        super().__init__(upstream_port)

    async def forward(
        self,
        reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        stage_download = [False]  # whether the connection's latest request is one
        await asyncio.gather(
            self._requests(reader, up_writer, stage_download), self._answers(up_reader, writer, stage_download)
        )

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
