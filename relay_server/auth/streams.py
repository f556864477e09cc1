"""Streamed tensor bodies on signed runs: the container header's hash is what the request
signature covers, and the header's metadata lists a sha256 per data chunk;
:class:`VerifiedBodyStream` checks every chunk before handing any of its bytes to the reducer.
Nothing here grows with what a header merely declares: :func:`container_digests` takes the
route's size limit, and :class:`ChunkDigests` counts chunks arithmetically first."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import struct
from collections.abc import Iterable, Mapping

from aiohttp import StreamReader

from relay_server.auth.rejections import _reject
from toolkit.errors import ProtocolError
from toolkit.wire.auth import CHUNK_BYTES_KEY, CHUNK_SHA256_KEY, segment_lengths, unb64u
from toolkit.wire.tensor_container import MAX_HEADER, parse_header


class ChunkDigests:
    """The per-chunk sha256 list a container header announces, checked one chunk at a time.

    The number of chunks is computed from the (already size-checked) tensor sizes and compared
    with the digest string's length BEFORE any per-chunk list is built: nothing here grows with
    what a header merely declares."""

    def __init__(
        self,
        tensor_sizes: Iterable[int],
        metadata: Mapping[str, str],
        *,
        min_chunk_bytes: int = 4096,
        max_chunk_bytes: int = 16 << 20,
    ) -> None:
        raw_size, raw_digests = metadata.get(CHUNK_BYTES_KEY), metadata.get(CHUNK_SHA256_KEY)
        if raw_size is None or raw_digests is None:
            raise _reject(
                401,
                "missing_chunk_digests",
                "a signed upload must list its chunk digests",
                "Upgrade the toolkit: uploads carry collab_chunk_sha256 in their metadata.",
            )
        if not (raw_size.isascii() and raw_size.isdigit()) or not min_chunk_bytes <= int(raw_size) <= max_chunk_bytes:
            raise _reject(401, "bad_chunk_digests", f"chunk size must be {min_chunk_bytes}..{max_chunk_bytes} bytes")
        self.chunk_bytes = int(raw_size)
        sizes = list(tensor_sizes)
        count = sum(-(-size // self.chunk_bytes) for size in sizes)
        if len(raw_digests) != -(-32 * count * 4 // 3):  # b64u without padding: checked before decoding
            raise _reject(401, "bad_chunk_digests", f"expected {count} chunk digests")
        try:
            digests = unb64u(raw_digests, CHUNK_SHA256_KEY)
        except ValueError as exc:
            raise _reject(401, "bad_chunk_digests", str(exc)) from None
        if len(digests) != 32 * count:
            raise _reject(401, "bad_chunk_digests", f"expected {count} chunk digests, got {len(digests) / 32:g}")
        self.lengths = segment_lengths(sizes, self.chunk_bytes)
        self.digests = [digests[i : i + 32] for i in range(0, len(digests), 32)]

    def check(self, index: int, data: bytes) -> None:
        if index >= len(self.lengths) or len(data) != self.lengths[index]:
            raise ProtocolError("bad_tensor", "read past the announced tensor data")
        if not hmac.compare_digest(hashlib.sha256(data).digest(), self.digests[index]):
            raise _reject(
                401,
                "chunk_digest_mismatch",
                f"data chunk {index} does not match its signed digest",
                "The upload was altered in transit; it is dropped (chunks before it were intact).",
            )


class VerifiedBodyStream:
    """Drop-in for the request's ``StreamReader`` (``readexactly``): serves the container head
    already read by the middleware, then the data in digest segments, each read whole and checked
    before any byte of it is returned. Memory: one segment (4 MiB by default)."""

    def __init__(self, stream: StreamReader, head: bytes, digests: ChunkDigests) -> None:
        self._stream, self.digests = stream, digests
        self._pending = memoryview(head)  # verified bytes not yet handed out
        self._index = 0  # next segment to read from the wire

    async def readexactly(self, n: int) -> bytes:
        if not self._pending and self._index < len(self.digests.lengths) and n == self.digests.lengths[self._index]:
            return await self._next_segment()  # reads aligned with segments (the usual case): no copy
        parts = []
        while n > 0:
            if not self._pending:
                self._pending = memoryview(await self._next_segment())
            take = self._pending[:n]
            self._pending = self._pending[len(take) :]
            parts.append(take)
            n -= len(take)
        return b"".join(parts)

    async def _next_segment(self) -> bytes:
        if self._index >= len(self.digests.lengths):
            raise ProtocolError("bad_tensor", "read past the announced tensor data")
        data = await self._stream.readexactly(self.digests.lengths[self._index])
        self.digests.check(self._index, data)
        self._index += 1
        return data


async def read_container_head(stream: StreamReader) -> bytes:
    """The 8 + N header bytes of a container, N bounded by MAX_HEADER."""
    try:
        prefix = await stream.readexactly(8)
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER:
            raise ProtocolError("bad_tensor", f"tensor header of {n} bytes exceeds {MAX_HEADER}")
        return prefix + await stream.readexactly(n)
    except asyncio.IncompleteReadError:
        raise ProtocolError("truncated_body", "the request body ended inside the tensor header") from None


def container_digests(head: bytes, max_data_bytes: int = 1 << 62) -> ChunkDigests:
    """The digest checker of a container whose header is ``head``. Routes pass ``max_data_bytes``,
    the most tensor data they take (the run's parameters in its codec), so a header declaring
    more is refused before anything proportional to its size exists; even without it nothing
    here grows with a declared size (360 bytes declaring 2^59 floats built a
    2^35-entry list)."""
    header = parse_header(head[:8], head[8:], max_data_bytes=max_data_bytes)
    return ChunkDigests([e.end - e.begin for e in header.entries], header.metadata)
