"""The streaming reduction of gradient uploads for one slice ``[start, end)`` of the flat vector.

Peers upload the SUM of their gradients (so the relay only adds), encoded by the run's codec
(:mod:`toolkit.wire.compression`). The event loop reads chunk ``k + 1`` off the socket while chunk
``k`` is decoded, validated (finite) and added on one dedicated reducer thread -- numpy releases
the GIL, so receiving and reducing use two cores (DESIGN.md s6), and with a single writer the
adds never race. Work that must see every add (the mean, the optimizer step) is submitted to the
same thread with :meth:`Reducer.run`, so it is ordered after them without locks.

Each chunk has its own sample weight (part-wise averaging, as in hivemind): an upload that stops
early -- its peer died, its round closed, a later chunk was refused -- leaves only the chunks it
delivered whole and valid, and every chunk's mean is exact over the peers that delivered it. No
invalid value ever enters the sum. Undoing valid chunks instead would need a staging copy of
every upload in flight (n x P floats), which a relay on a small VM cannot afford.

Robust mode (``rounds.aggregation = "centered_clip"``) pays exactly that price on purpose: each
chunk is stored per peer (:class:`~relay_server.rounds.robust.RobustAccumulator`, n_peers x P float32
while a round is open) and :meth:`Reducer.finish_mean` writes the per-chunk CenteredClip center
instead of the mean. Part-wise semantics are unchanged, and a peer removed mid-round (a ban) can
then be taken out entirely; with the mean its already-added chunks stay.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from relay_server.core.config import RoundsSection
from relay_server.core.errors import ApiError
from relay_server.rounds.robust import CenteredClipConfig, RobustAccumulator
from relay_server.rounds.membership import RoundClosedMidUpload
from toolkit.wire.compression import Codec
from toolkit.wire.tensor_container import AsyncContainerReader, Header, Pieces

CHUNK_ELEMS = 1 << 20  # 4 MiB of float32: reduce one while the next arrives
T = TypeVar("T")
log = logging.getLogger(__name__)


def robust_config(rounds: RoundsSection) -> CenteredClipConfig | None:
    """The CenteredClip settings of ``rounds.aggregation = "centered_clip"``; None for the mean."""
    if rounds.aggregation != "centered_clip":
        return None
    return CenteredClipConfig(iterations=rounds.clip_iterations, tau=rounds.clip_tau,
                              tau_scale=rounds.clip_tau_scale, max_weight_ratio=rounds.clip_max_weight_ratio)


@dataclass
class UploadProgress:
    """How far one upload got: the caller needs to know whether any chunk entered the sum."""

    chunks_added: int = 0


class Reducer:
    """Sums gradient parts into ``buffer`` (float32, the slice's length) chunk by chunk; with
    ``robust`` set, stores them per peer and writes the CenteredClip center instead."""

    def __init__(self, buffer: np.ndarray, codec: Codec, robust: CenteredClipConfig | None = None) -> None:
        self.sum = buffer
        self.codec = codec
        self.weights = np.zeros(-(-buffer.size // CHUNK_ELEMS), dtype=np.float64)  # samples per chunk
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reducer")
        self._scratch = np.empty(min(CHUNK_ELEMS, max(buffer.size, 1)), dtype=np.float32)
        self._staging = np.empty(CHUNK_ELEMS * 4, dtype=np.uint8)  # a chunk that arrived in pieces
        self.robust_config = robust
        self._robust = self._new_accumulator()
        self._excluded: set[str] = set()  # peers removed this round: their further chunks are refused
        self.clipped_rounds: dict[str, int] = {}  # peer_id -> rounds in which CenteredClip clipped it

    def _new_accumulator(self) -> RobustAccumulator | None:
        if self.robust_config is None:
            return None
        return RobustAccumulator(self.sum.size, CHUNK_ELEMS, self.robust_config)

    @property
    def numel(self) -> int:
        return self.sum.size

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the reducer thread, after every add submitted before it."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def submit(self, fn: Callable[..., T], *args: Any) -> "Future[T]":
        """Queue ``fn`` on the reducer thread without waiting (it still runs before any later add)."""
        return self._thread.submit(fn, *args)

    def close(self) -> None:
        self._thread.shutdown(wait=True)

    def reset(self) -> None:
        """Zero the sum for a new round (call through :meth:`run`)."""
        self.sum.fill(0.0)
        self.weights.fill(0.0)
        self._robust = self._new_accumulator()
        self._excluded.clear()

    def exclude(self, peer_id: str) -> None:
        """Take a peer out of the open round (call through :meth:`run`): its further chunks are
        refused, and in robust mode its stored chunks are forgotten too."""
        self._excluded.add(peer_id)
        if self._robust is not None:
            self._robust.discard(peer_id)

    def check(self, header: Header) -> None:
        """Refuse a container whose layout does not match the codec and slice, before any data."""
        try:
            self.codec.check_layout(header.entries, self.numel)
        except ValueError as exc:
            raise ApiError(422, "bad_tensor", str(exc), "The peer's model or codec does not match the run's "
                           f"({self.numel} parameters, codec {self.codec.name!r}).") from None

    async def reduce(self, reader: AsyncContainerReader, header: Header, samples: int,
                     still_open: Callable[[], bool], progress: UploadProgress, peer_id: str = "") -> None:
        """Stream one upload into the sum. ``still_open`` is checked before each chunk is handed
        to the reducer thread; ``progress`` counts the chunks that were added. Robust mode keys
        the stored chunks by ``peer_id`` (required there)."""
        if self._robust is not None and not peer_id:
            raise ValueError("robust aggregation needs the uploading peer's id")
        *side_entries, payload = header.entries
        side = {e.name: await reader.read_tensor(e) for e in side_entries}
        try:
            self.codec.validate(side, payload.dtype, self.numel)
        except ValueError as exc:
            raise ApiError(422, "bad_tensor", str(exc)) from None
        loop = asyncio.get_running_loop()
        pending: asyncio.Future | None = None
        try:
            async for start, piece in reader.iter_chunk_pieces(payload, CHUNK_ELEMS):
                if pending is not None:
                    await pending
                    progress.chunks_added += 1
                    pending = None
                if not still_open():
                    raise _Closed()
                pending = loop.run_in_executor(self._thread, self._add, side, piece, start, samples, peer_id)
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

    def _add(self, side: dict[str, np.ndarray], piece: Pieces, start: int, samples: int,
             peer_id: str = "") -> None:
        """Reducer thread: gather, decode, validate, add (or in robust mode store) one chunk and
        its weight."""
        piece = piece.gather(self._staging)
        if peer_id in self._excluded:
            raise ApiError(403, "peer_removed", "this peer was removed from the round by the organizer",
                           "Contact the organizer if you think this is a mistake.")
        if self.codec.lossless and piece.dtype == np.float32:
            values = piece  # float32 on the wire: add straight from the received bytes
        else:
            values = self.codec.decode_range(side, piece, start, out=self._scratch[:piece.size])
        if not self.codec.finite_output and not np.isfinite(values).all():
            raise ApiError(422, "non_finite", "gradient contains NaN or Inf",
                           "Lower the learning rate or enable loss scaling; this contribution is dropped.")
        if self._robust is not None:
            self._robust.add_chunk(peer_id, start, values, samples)  # copies: values may be scratch
        else:
            segment = self.sum[start:start + values.size]
            np.add(segment, values, out=segment)
        self.weights[start // CHUNK_ELEMS] += samples

    def finish_mean(self) -> None:
        """Turn the sums into sample-weighted means, chunk by chunk (reducer thread); a chunk
        nobody delivered stays zero. Robust mode writes each chunk's CenteredClip center."""
        if self._robust is not None:
            clipped = self._robust.finish_into(self.sum)
            for peer_id, chunks in clipped.items():
                self.clipped_rounds[peer_id] = self.clipped_rounds.get(peer_id, 0) + 1
                log.info("CenteredClip clipped peer %s in %d chunk(s)", peer_id[:8], chunks)
            return
        for c, weight in enumerate(self.weights):
            segment = self.sum[c * CHUNK_ELEMS:(c + 1) * CHUNK_ELEMS]
            if weight > 0:
                np.divide(segment, np.float32(weight), out=segment)
            else:
                segment.fill(0.0)


class _Closed(RoundClosedMidUpload):
    """The round closed while this upload was streaming (turned into an API error by the caller,
    which knows whether any chunk had entered the sum)."""
