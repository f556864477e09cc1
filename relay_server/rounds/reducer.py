"""The streaming reduction of gradient uploads for one slice ``[start, end)`` of the flat vector.

Peers upload the SUM of their gradients (so the relay only adds), encoded by the run's codec
(:mod:`toolkit.wire.compression`). The event loop reads chunk ``k + 1`` off the socket while chunk
``k`` is decoded and validated (finite and bounded: :func:`check_chunk`) on one dedicated reducer
thread -- numpy releases the GIL, so receiving and checking use two cores (DESIGN.md s6), and with
a single writer the adds never race. Work that must see every add (the mean, the optimizer step)
is submitted to the same thread with :meth:`Reducer.run`, so it is ordered after them without locks.

**A contribution counts whole or not at all.** Each validated chunk goes to a per-upload spool (an
unlinked temporary file: the wire bytes, so memory stays at one chunk whatever the model's size);
only when the LAST chunk verified -- every digest, every chunk within :func:`check_chunk`'s bound,
the round still open, the peer not removed -- is the upload committed: ``UploadProgress.on_commit``
runs on the event loop (the caller credits the samples there, so the round's record and the sum can
never disagree) and one job on the reducer thread adds the spool into the sum, before any later
finalize. An upload refused at chunk ``k`` (NaN, a digest mismatch, a dead connection, the round
closing) leaves the sum exactly as before it began. Earlier versions reduced each chunk as it
arrived, so a refused upload's first chunks stayed in the sum while its peer was told it was dropped.
Uploads in flight wait in memory, as the buffers they arrived in, while the process's
budget allows (``[server] upload_memory_mb``), beyond it in files on the data disk: one spool per
upload in flight, at most the run's codec size each (``wire_bytes``).

Robust mode (``rounds.aggregation = "centered_clip"``) stores each chunk per peer anyway
(:class:`~relay_server.rounds.robust.RobustAccumulator`, n_peers x P float32 while a round is
open); there a refused upload's stored chunks are discarded, and :meth:`Reducer.finish_mean`
writes the per-chunk CenteredClip center instead of the mean. A peer removed after its upload
committed (a ban) is taken out entirely in robust mode; with the mean its committed sum stays,
and the moderation answer and round record say so.

Each chunk keeps its own sample weight: in a sliced round an owner only ever sees its slice,
so a peer that delivered some slices and not others counts part-wise across owners (each
owner's slice is still whole or nothing).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import numpy as np

from relay_server.core.config import RoundsSection
from relay_server.core.errors import ApiError
from relay_server.rounds.membership import RoundClosedMidUpload
from relay_server.rounds.robust import CenteredClipConfig, RobustAccumulator
from toolkit.wire.compression import Codec
from toolkit.wire.tensor_container import AsyncContainerReader, Header, Pieces

CHUNK_ELEMS = 1 << 20  # 4 MiB of float32: reduce one while the next arrives
T = TypeVar("T")
log = logging.getLogger(__name__)


def robust_config(rounds: RoundsSection) -> CenteredClipConfig | None:
    """The CenteredClip settings of ``rounds.aggregation = "centered_clip"``; None for the mean."""
    if rounds.aggregation != "centered_clip":
        return None
    return CenteredClipConfig(
        iterations=rounds.clip_iterations,
        tau=rounds.clip_tau,
        tau_scale=rounds.clip_tau_scale,
        max_weight_ratio=rounds.clip_max_weight_ratio,
    )


@dataclass
class UploadProgress:
    """How far one upload got. ``chunks_added`` counts the chunks that entered the sum: 0 until
    the upload commits, then all of them. ``on_commit`` runs on the event loop at the commit
    point, before the add is queued: credit the contribution there (and only there)."""

    chunks_added: int = 0
    chunks_staged: int = 0  # validated and waiting for the commit
    committed: bool = False
    on_commit: Callable[[], None] | None = None


class MemoryBudget:
    """Bytes of uploads in flight the process keeps in memory, shared by every reducer (one per
    slice owner; owners come and go as slices move): memory is the process's, not a slice's."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` if they fit; False: the caller spools to disk instead."""
        with self._lock:
            if self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes


UPLOAD_MEMORY = MemoryBudget(1 << 30)
"""The process's budget for uploads waiting for their last chunk (``[server] upload_memory_mb``
sets it at start: :func:`set_upload_memory`)."""


def set_upload_memory(nbytes: int) -> None:
    UPLOAD_MEMORY.limit = nbytes


class _Spool:
    """One upload's validated chunks, as received, until it commits.

    In memory while the process's :data:`UPLOAD_MEMORY` allows: the spool keeps the received
    network buffers themselves (:class:`Pieces` views of the bytes the event loop read), so
    waiting costs no copy at all. Past the budget, every chunk so far and all later ones go to an
    unlinked temp file in ``directory`` (the data disk). Writing every upload through a file
    cost a round two extra passes over the bytes (write, read back) and most of the reducer
    thread's time: 4 peers x 100 MiB measured 0.28-1.97 s of staging per round, against
    0.02-0.05 s of memory copies (benchmarks/allreduce.py; the README's round breakdown). The file is
    made on the reducer thread, never on the event loop (a 1,000-peer relay lost 10-17% of its loop
    to creating one per upload)."""

    def __init__(self, directory: str | None, budget: MemoryBudget) -> None:
        self.directory, self.budget = directory, budget
        self.held: list[Pieces] = []  # in memory, in arrival order
        self.reserved = 0  # bytes of ``held``, taken from the budget
        self.file: IO[bytes] | None = None
        self._next = 0

    def write(self, piece: Pieces, raw: np.ndarray) -> None:
        """Keep one validated chunk: ``piece`` as received, ``raw`` the same bytes gathered."""
        nbytes = raw.nbytes
        if self.file is None and self.budget.take(nbytes):
            self.held.append(piece)
            self.reserved += nbytes
            return
        if self.file is None:  # over the budget: this upload waits on disk from now on
            self.file = tempfile.TemporaryFile(prefix="collab-upload-", dir=self.directory)
            scratch = np.empty(max((p.count * p.dtype.itemsize for p in self.held), default=0), dtype=np.uint8)
            for held in self.held:
                self.file.write(np.ascontiguousarray(held.gather(scratch)).data.cast("B"))
            self._release()
        self.file.write(np.ascontiguousarray(raw).data.cast("B"))

    def rewind(self) -> None:
        self._next = 0
        if self.file is not None:
            self.file.seek(0)

    def read(self, staging: np.ndarray, nbytes: int, dtype: np.dtype) -> np.ndarray:
        """The next chunk, in the order written (a view of ``staging`` or of the received buffer)."""
        if self.file is None:
            piece = self.held[self._next]
            self._next += 1
            return piece.gather(staging)
        view = staging[:nbytes]
        # TemporaryFile is typed IO[bytes], which has no readinto (its BufferedRandom has)
        if self.file.readinto(view.data) != nbytes:  # type: ignore[attr-defined]
            raise OSError("an upload spool was shorter than what was written to it")
        return view.view(dtype)

    def _release(self) -> None:
        self.held = []
        self.budget.give(self.reserved)
        self.reserved = 0

    def close(self) -> None:
        self._release()
        if self.file is not None:
            self.file.close()


class Reducer:
    """Sums gradient parts into ``buffer`` (float32, the slice's length) chunk by chunk; with
    ``robust`` set, stores them per peer and writes the CenteredClip center instead."""

    def __init__(
        self, buffer: np.ndarray, codec: Codec, robust: CenteredClipConfig | None = None, spool_dir: str | None = None
    ) -> None:
        self.sum = buffer
        self.spool_dir = spool_dir  # where uploads in flight wait for their last chunk (None: the temp dir)
        self.codec = codec
        self.weights = np.zeros(-(-buffer.size // CHUNK_ELEMS), dtype=np.float64)  # samples per chunk
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reducer")
        self._scratch = np.empty(min(CHUNK_ELEMS, max(buffer.size, 1)), dtype=np.float32)
        # One chunk's payload: payload_size(CHUNK_ELEMS) elements encode CHUNK_ELEMS values (all
        # codecs' alignments divide CHUNK_ELEMS, so chunks are whole value ranges of any codec).
        self._chunk_payload = codec.payload_size(CHUNK_ELEMS)
        self._staging = np.empty(
            max(CHUNK_ELEMS * 4, self._chunk_payload * codec.payload_dtype.itemsize), dtype=np.uint8
        )  # a chunk that arrived in pieces
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
            raise ApiError(
                422,
                "bad_tensor",
                str(exc),
                "The peer's model or codec does not match the run's "
                f"({self.numel} parameters, codec {self.codec.name!r}).",
            ) from None

    async def reduce(
        self,
        reader: AsyncContainerReader,
        header: Header,
        samples: int,
        still_open: Callable[[], bool],
        progress: UploadProgress,
        peer_id: str = "",
        verify: Callable[[np.ndarray], Awaitable[None]] | None = None,
    ) -> None:
        """Stream one upload in, whole or not at all. ``still_open`` is checked before each
        chunk and at the commit point; ``progress`` says whether it committed. Robust mode keys
        the stored chunks by ``peer_id`` (required there). ``verify`` (an audit of the work
        behind the upload, :mod:`relay_server.trust.gradient_audit`) is given the whole decoded
        upload once every chunk passed, before the commit point: raising there refuses it, and
        the sum stays as it was. Only a chosen upload pays for the whole vector in memory."""
        if self._robust is not None and not peer_id:
            raise ValueError("robust aggregation needs the uploading peer's id")
        *side_entries, payload = header.entries
        side = {e.name: await reader.read_tensor(e) for e in side_entries}
        try:
            self.codec.validate(side, payload.dtype, self.numel)
        except ValueError as exc:
            raise ApiError(422, "bad_tensor", str(exc), _REFUSED_HINT) from None
        loop = asyncio.get_running_loop()
        spool = _Spool(self.spool_dir, UPLOAD_MEMORY) if self._robust is None else None
        chunks: list[tuple[int, int]] = []  # (first value, payload elements) of every validated chunk
        whole = np.empty(self.numel, dtype=np.float32) if verify is not None else None
        pending: asyncio.Future[None] | None = None
        try:
            async for offset, piece in reader.iter_chunk_pieces(payload, self._chunk_payload):
                if pending is not None:
                    await pending
                    pending, progress.chunks_staged = None, progress.chunks_staged + 1
                if not still_open():
                    raise _Closed()
                start = offset // self._chunk_payload * CHUNK_ELEMS  # the chunk's first value
                pending = loop.run_in_executor(
                    self._thread, self._stage, side, piece, start, samples, peer_id, spool, whole
                )
                chunks.append((start, piece.count))
            if pending is not None:
                await pending
                pending, progress.chunks_staged = None, progress.chunks_staged + 1
            if verify is not None and whole is not None:
                await verify(whole)
            if not still_open():
                raise _Closed()
            if peer_id in self._excluded:  # set on this thread by exclude(), which ran before any later job
                raise _removed()
            progress.committed, progress.chunks_added = True, len(chunks)
            if progress.on_commit is not None:
                progress.on_commit()
            job = self._thread.submit(self._commit, side, payload.dtype, spool, chunks, samples)
            spool = None  # the commit job owns (and closes) it
            await asyncio.shield(asyncio.wrap_future(job))  # credited: the add must happen even if we are cancelled
        except BaseException:
            if pending is not None:  # the loop side failed while a chunk was being checked
                try:
                    await pending
                    progress.chunks_staged += 1
                except Exception:
                    pass
            if not progress.committed and self._robust is not None:
                self._thread.submit(self._robust.discard, peer_id)  # ordered before any finish
            raise
        finally:
            if spool is not None:
                spool.close()

    def _decoded(self, side: dict[str, np.ndarray], raw: np.ndarray, start: int) -> np.ndarray:
        """The values ``[start, start + CHUNK_ELEMS)`` (fewer at the end) of one chunk's payload."""
        if self.codec.lossless and raw.dtype == np.float32:
            return raw  # float32 on the wire: use the received bytes as they are
        count = min(CHUNK_ELEMS, self.numel - start)
        return self.codec.decode_range(side, raw, start, out=self._scratch[:count])

    def _stage(
        self,
        side: dict[str, np.ndarray],
        piece: Pieces,
        start: int,
        samples: int,
        peer_id: str,
        spool: _Spool | None,
        whole: np.ndarray | None = None,
    ) -> None:
        """Reducer thread: gather, decode and validate one chunk; spool it (mean) or store it
        per peer (robust), and copy it into ``whole`` (an audited upload). Nothing enters the sum here."""
        raw = piece.gather(self._staging)
        if peer_id in self._excluded:
            raise _removed()
        try:
            values = self._decoded(side, raw, start)  # sparse codecs check their records here
        except ValueError as exc:
            raise ApiError(422, "bad_tensor", str(exc), _REFUSED_HINT) from None
        check_chunk(values)
        if whole is not None:
            whole[start : start + values.size] = values
        if self._robust is not None:
            self._robust.add_chunk(peer_id, start, values, samples)  # copies: values may be scratch
        elif spool is not None:
            spool.write(piece, raw)

    def _commit(
        self,
        side: dict[str, np.ndarray],
        dtype: np.dtype,
        spool: _Spool | None,
        chunks: list[tuple[int, int]],
        samples: int,
    ) -> None:
        """Reducer thread: add a verified upload's spooled chunks into the sum, with their weights."""
        try:
            if spool is not None:
                spool.rewind()
                for start, count in chunks:
                    values = self._decoded(side, spool.read(self._staging, count * dtype.itemsize, dtype), start)
                    segment = self.sum[start : start + values.size]
                    np.add(segment, values, out=segment)
            for start, _ in chunks:
                self.weights[start // CHUNK_ELEMS] += samples
        finally:
            if spool is not None:
                spool.close()

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
            segment = self.sum[c * CHUNK_ELEMS : (c + 1) * CHUNK_ELEMS]
            if weight > 0:
                np.divide(segment, np.float32(weight), out=segment)
            else:
                segment.fill(0.0)


_REFUSED_HINT = "Nothing of this upload was counted: the round's sum is as it was before it began."

CHUNK_NORM_MAX = float(np.sqrt(np.finfo(np.float32).max))  # 1.8e19: beyond, a chunk's float32 v.v overflows


def check_chunk(values: np.ndarray) -> None:
    """Refuse a chunk holding NaN or Inf, or whose L2 norm exceeds :data:`CHUNK_NORM_MAX`.

    One float32 dot product (BLAS, no temporary) decides both: ``v . v`` is non-finite iff some
    value is NaN/Inf or the squares add past float32's largest value, i.e. the norm passes
    ~1.8e19. Checking finiteness alone let two finite uploads of 3e38 per value add up to inf in
    the float32 sum (and codecs whose decoded values are finite by construction -- int8 up to
    FLT_MAX, topk2 up to 1.9e30 -- skipped the check altogether). With the bound every accepted
    value has ``|v| < 1.8e19``: a sum of any realistic number of uploads stays finite, and so do
    the mean, its square (Adam's second moment) and the float64 norms of the step. No real
    gradient comes near: a summed gradient of 1.8e19 is a run that already diverged.
    ``np.isfinite`` runs only on the refusal path, to name what was wrong."""
    with np.errstate(over="ignore", invalid="ignore"):  # the overflow is the answer, not a warning
        square = np.dot(values, values)
    if np.isfinite(square):
        return
    if not np.isfinite(values).all():
        raise ApiError(
            422,
            "non_finite",
            "gradient contains NaN or Inf",
            "Lower the learning rate or enable loss scaling. " + _REFUSED_HINT,
        )
    raise ApiError(
        422,
        "gradient_too_large",
        f"a {CHUNK_ELEMS}-value chunk of the gradient has an L2 norm above "
        f"{CHUNK_NORM_MAX:.3g}, beyond what the relay can sum in float32",
        "The run has diverged on this peer: lower the learning rate, or clip gradients. " + _REFUSED_HINT,
    )


def _removed() -> ApiError:
    return ApiError(
        403,
        "peer_removed",
        "this peer was removed from the round by the organizer",
        "Contact the organizer if you think this is a mistake.",
    )


class _Closed(RoundClosedMidUpload):
    """The round closed while this upload was streaming (turned into an API error by the caller,
    which knows whether any chunk had entered the sum)."""
