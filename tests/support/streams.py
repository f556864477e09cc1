"""Bytes read the way the relay reads a request body, for decoders tested without a server."""

from __future__ import annotations

import asyncio


class BytesStream:
    """The ``readexactly`` of aiohttp's StreamReader, over bytes."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    async def readexactly(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise asyncio.IncompleteReadError(self.data[self.pos :], n)
        self.pos += n
        return self.data[self.pos - n : self.pos]
