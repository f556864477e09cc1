"""The streaming reduction of gradient uploads for one slice ``[start, end)`` of the flat vector.

Peers upload the SUM of their gradients (so the relay only adds), encoded by the run's codec
(:mod:`toolkit.compression`). The event loop reads chunk ``k + 1`` off the socket while chunk
``k`` is decoded, validated (finite) and added on one dedicated reducer thread -- numpy releases
the GIL, so receiving and reducing use two cores (DESIGN.md s6), and with a single writer the
adds never race. Work that must see every add (the mean, the optimizer step) is submitted to the
same thread with :meth:`Reducer.run`, so it is ordered after them without locks.

Each chunk has its own sample weight (part-wise averaging, as in hivemind): an upload that stops
early -- its peer died, its round closed, a later chunk was refused -- leaves only the chunks it
delivered whole and valid, and every chunk's mean is exact over the peers that delivered it. No
invalid value ever enters the sum. Undoing valid chunks instead would need a staging copy of
every upload in flight (n x P floats), which a relay on a small VM cannot afford.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from relay_server.errors import ApiError
from toolkit.compression import Codec
from toolkit.tensor_container import AsyncContainerReader, Header

CHUNK_ELEMS = 1 << 20  # 4 MiB of float32: reduce one while the next arrives
T = TypeVar("T")


@dataclass
class UploadProgress:
    """How far one upload got: the caller needs to know whether any chunk entered the sum."""

    chunks_added: int = 0


class Reducer:
    """Sums gradient parts into ``buffer`` (float32, the slice's length) chunk by chunk."""

    def __init__(self, buffer: np.ndarray, codec: Codec) -> None:
        self.sum = buffer
        self.codec = codec
        self.weights = np.zeros(-(-buffer.size // CHUNK_ELEMS), dtype=np.float64)  # samples per chunk
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reducer")
        self._scratch = np.empty(min(CHUNK_ELEMS, max(buffer.size, 1)), dtype=np.float32)

    @property
    def numel(self) -> int:
        return self.sum.size

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the reducer thread, after every add submitted before it."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def close(self) -> None:
        self._thread.shutdown(wait=True)

    def reset(self) -> None:
        """Zero the sum for a new round (call through :meth:`run`)."""
        self.sum.fill(0.0)
        self.weights.fill(0.0)

    def check(self, header: Header) -> None:
        """Refuse a container whose layout does not match the codec and slice, before any data."""
        try:
            self.codec.check_layout(header.entries, self.numel)
        except ValueError as exc:
            raise ApiError(422, "bad_tensor", str(exc), "The peer's model or codec does not match the run's "
                           f"({self.numel} parameters, codec {self.codec.name!r}).") from None

    async def reduce(self, reader: AsyncContainerReader, header: Header, samples: int,
                     still_open: Callable[[], bool], progress: UploadProgress) -> None:
        """Stream one upload into the sum. ``still_open`` is checked before each chunk is handed
        to the reducer thread; ``progress`` counts the chunks that were added."""
        *side_entries, payload = header.entries
        side = {e.name: await reader.read_tensor(e) for e in side_entries}
        try:
            self.codec.validate(side, payload.dtype, self.numel)
        except ValueError as exc:
            raise ApiError(422, "bad_tensor", str(exc)) from None
        loop = asyncio.get_running_loop()
        pending: asyncio.Future | None = None
        try:
            async for start, piece in reader.iter_chunks(payload, CHUNK_ELEMS):
                if pending is not None:
                    await pending
                    progress.chunks_added += 1
                    pending = None
                if not still_open():
                    raise _Closed()
                pending = loop.run_in_executor(self._thread, self._add, side, piece, start, samples)
            if pending is not None:
                await pending
                progress.chunks_added += 1
                pending = None
        finally:
            if pending is not None:  # the loop side failed while a chunk was being reduced
                try:
                    await pending
                    progress.chunks_added += 1
                except ApiError:
                    pass

    def _add(self, side: dict[str, np.ndarray], piece: np.ndarray, start: int, samples: int) -> None:
        """Reducer thread: decode, validate, add one chunk and its weight."""
        if self.codec.lossless and piece.dtype == np.float32:
            values = piece  # float32 on the wire: add straight from the received bytes
        else:
            values = self.codec.decode_range(side, piece, start, out=self._scratch[:piece.size])
        if not self.codec.finite_output and not np.isfinite(values).all():
            raise ApiError(422, "non_finite", "gradient contains NaN or Inf",
                           "Lower the learning rate or enable loss scaling; this contribution is dropped.")
        segment = self.sum[start:start + values.size]
        np.add(segment, values, out=segment)
        self.weights[start // CHUNK_ELEMS] += samples

    def finish_mean(self) -> None:
        """Turn the sums into sample-weighted means, chunk by chunk (reducer thread); a chunk
        nobody delivered stays zero."""
        for c, weight in enumerate(self.weights):
            segment = self.sum[c * CHUNK_ELEMS:(c + 1) * CHUNK_ELEMS]
            if weight > 0:
                np.divide(segment, np.float32(weight), out=segment)
            else:
                segment.fill(0.0)


class _Closed(Exception):
    """The round closed while this upload was streaming (turned into an API error by the caller,
    which knows whether any chunk had entered the sum)."""
