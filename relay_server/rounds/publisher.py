"""Published versions of the parameters: written once to disk, served from there.

Every optimizer step produces one state file (``Store.state_path``): the parameters peers
download first, then the master parameters when they differ, then the optimizer state. Peers
download that first tensor's byte range with ``sendfile`` behind a small container header: no
in-memory snapshot, and no user-space copy of the N x P bytes going out. The sha256 peers verify
is computed while the file is written.

With a lossy codec, peers hold a *public* copy of the parameters: the sum of the quantized
deltas they decoded (error feedback keeps it within one quantization step of the master,
:class:`toolkit.wire.compression.DeltaEncoder`). The relay serves that public copy in full to
newcomers, and to a peer one version behind just the delta, whose own small file sits beside
the state file.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from aiohttp import web

from relay_server.auth.verify import sign_response_headers
from relay_server.rounds.master import MasterState, NonFiniteStep, StepReport
from relay_server.rounds.store import Store
from toolkit.wire.compression import Codec, DeltaEncoder
from toolkit.wire.tensor_container import encode_header_for, read_file_header, write_file

log = logging.getLogger(__name__)

SIGNED_HEADERS = ("X-Collab-Step", "X-Collab-Sha256")  # signed runs: the peer checks its bytes against these


@dataclass(frozen=True)
class Version:
    """One published version and where its bytes are."""

    step: int
    path: Path  # the state file
    offset: int  # byte range of the parameters peers download, within ``path``
    nbytes: int
    numel: int
    sha256: str
    delta_path: Path | None  # delta from ``step - 1`` (lossy codecs only)


# Hashes a version while the reducer thread writes it; one per process, shared by every publisher
# (a slice owner, and so its publisher, is rebuilt whenever slices move).
_HASHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hasher")


def sha256_of(array: np.ndarray) -> str:
    """The hash peers check a version (or a slice of one) against."""
    return hashlib.sha256(np.ascontiguousarray(array).data.cast("B")).hexdigest()


def _full_header(step: int, numel: int) -> bytes:
    return encode_header_for([("params", np.dtype("<f4"), (numel,))], {"step": str(step), "kind": "full"})


class Board:
    """The latest published item (anything with a ``step``) and a long-poll on it."""

    def __init__(self) -> None:
        # Any: the relay's board holds Published, a slice owner's publisher its Version (both with a
        # step); None only before the first publish, which startup does
        self.latest: Any = None
        self._published = asyncio.Event()

    def publish(self, item: Any) -> None:
        self.latest = item
        self._published.set()
        self._published = asyncio.Event()

    async def wait(self, min_step: int, timeout_s: float) -> Any:
        """Long-poll: the first published item with ``step >= min_step``, or None."""
        deadline = time.monotonic() + timeout_s
        while self.latest is None or self.latest.step < min_step:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                await asyncio.wait_for(self._published.wait(), remaining)
            except asyncio.TimeoutError:
                return None
        return self.latest


class Publisher(Board):
    """Writes versions (on the reducer thread) and serves them (on the event loop)."""

    latest: Version | None

    def __init__(
        self,
        store: Store,
        codec: Codec,
        master: MasterState,
        public: np.ndarray | None = None,
        *,
        fsync: bool = False,
        feedback: float = 1.0,
    ) -> None:
        super().__init__()
        self.store, self.codec, self.master, self.fsync = store, codec, master, fsync
        self.feedback = feedback  # run.download_feedback: the share of master - public kept per version
        self.deltas = (
            None
            if codec.lossless
            else DeltaEncoder(codec, public if public is not None else master.flat.numpy().copy())
        )

    @property
    def public(self) -> np.ndarray:
        """What peers hold: the master itself when the codec is lossless."""
        return self.master.flat.numpy() if self.deltas is None else self.deltas.public

    def write(self, step: int, meta: dict[str, str], *, delta: bool = True) -> Version:
        """Persist version ``step`` (reducer thread, after the optimizer step). ``delta=False``
        when the public copy did not come from version ``step - 1`` (a rollback): peers then
        download in full."""
        delta_path = None
        if self.deltas is not None and step > 0 and delta:
            encoded = self.deltas.encode_step(self.master.flat.numpy())
            if self.feedback < 1.0:  # master <- public + feedback * (master - public); 0: exactly public
                master = self.master.flat.numpy()
                np.subtract(master, self.public, out=master)
                master *= self.feedback
                np.add(master, self.public, out=master)
            delta_path = self.store.state_path(step).with_suffix(".delta")
            write_file(
                delta_path,
                encoded,
                {"step": str(step), "base": str(step - 1), "kind": "delta", "codec": self.codec.name},
                fsync=self.fsync,
            )
        tensors = [("params", self.public)]
        if self.deltas is not None:
            tensors.append(("master", self.master.flat.numpy()))
        tensors += [(name, t.contiguous().numpy()) for name, t in self.master.optimizer_tensors().items()]
        path = self.store.state_path(step)
        # hashlib releases the GIL: hash on a second core while this thread writes the file
        digest = _HASHER.submit(sha256_of, self.public)
        header, _ = write_file(path, tensors, {"step": str(step), **meta}, fsync=self.fsync)
        sha = digest.result()
        entry = header.entry("params")
        return Version(
            step=step,
            path=path,
            offset=header.header_bytes + entry.begin,
            nbytes=entry.end - entry.begin,
            numel=entry.numel,
            sha256=sha or "",
            delta_path=delta_path,
        )

    def apply_step(self, global_norm: float | None = None) -> StepReport:
        """The master's optimizer step (reducer thread), or :class:`NonFiniteStep` with the master
        exactly as before it. The version the master holds is on disk in full --
        parameters, master copy, optimizer state (:meth:`write`) -- so a step that broke the state
        is undone by reloading that file: no snapshot in memory (one would cost the parameters
        plus the optimizer state, 12 bytes per parameter with Adam, on every round), and a read
        of one state file only on the refusal path, which no honest round takes."""
        try:
            return self.master.apply_gradient(global_norm)
        except NonFiniteStep as exc:
            if exc.touched:
                self.load(self.master.step)  # the step counter did not move: the published version
            raise

    def restore(self, step: int) -> None:
        """Resume at version ``step`` (after a restart): load it and make it the latest."""
        self.load(step)
        self.latest = self.describe(step)

    def load(self, step: int) -> None:
        """Load version ``step``'s state file into the master and the public copy."""
        tensors = self.store.load_state(step)
        master = tensors.pop("master", None)
        public = tensors["params"]
        # "params" last: the file's own "params" is the public copy, not the master (lossy codecs)
        self.master.load_state_tensors({**tensors, "params": public if master is None else master}, step, adopt=True)
        if self.deltas is not None:
            self.deltas = DeltaEncoder(self.codec, public.numpy().copy())

    def describe(self, step: int) -> Version:
        """The Version of an existing state file (after a restart): re-hash what peers download."""
        path = self.store.state_path(step)
        header = read_file_header(path)
        entry = header.entry("params")
        offset, nbytes = header.header_bytes + entry.begin, entry.end - entry.begin
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            fh.seek(offset)
            while piece := fh.read(min(nbytes - fh.tell() + offset, 4 << 20)):
                digest.update(piece)
        delta = path.with_suffix(".delta")
        return Version(
            step=step,
            path=path,
            offset=offset,
            nbytes=nbytes,
            numel=entry.numel,
            sha256=digest.hexdigest(),
            delta_path=delta if delta.exists() else None,
        )

    # --- event loop side ------------------------------------------------------------------------
    async def send(self, request: web.Request, version: Version, have: int | None) -> web.StreamResponse:
        """A peer holding version ``have`` gets the delta when it is one step behind and the codec
        is lossy; everyone else gets the full parameters. Both are written here (``sendfile``), so
        the answer's ``content_length`` is what went out when this returns: the relay's traffic
        counters (:mod:`relay_server.rounds.traffic`) add it."""
        headers = {
            "Content-Type": "application/octet-stream",
            "X-Collab-Step": str(version.step),
            "X-Collab-Sha256": version.sha256,  # of the parameters the peer holds afterwards
            "Cache-Control": "no-store",
        }  # the answer depends on the query: caches use the immutable URLs
        delta_path = version.delta_path if have == version.step - 1 else None
        delta = delta_path is not None
        header = b"" if delta else _full_header(version.step, version.numel)
        # Open the file before any byte goes out: an error here (out of descriptors) is still a
        # clean 503; once the headers are sent, an error can only cut the connection (core.http).
        with open(delta_path if delta_path is not None else version.path, "rb") as fh:  # outlives the store pruning it
            offset, count = (0, fh.seek(0, 2)) if delta else (version.offset, version.nbytes)
            response = web.StreamResponse(headers=headers)
            sign_response_headers(request, response, SIGNED_HEADERS)
            response.content_length = len(header) + count  # what the relay's traffic counters add
            await response.prepare(request)
            if header:
                await response.write(header)
            await _sendfile(request, response, fh, offset, count)
        await response.write_eof()
        return response


async def _sendfile(request: web.Request, response: web.StreamResponse, fh: BinaryIO, offset: int, count: int) -> None:
    """Zero-copy where the transport allows it (plain TCP), chunked reads otherwise (TLS)."""
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the peer went away")
    try:
        await asyncio.get_running_loop().sendfile(transport, fh, offset, count)
        return
    except NotImplementedError:
        # A loop without sendfile on its transports (uvloop): copied below. NotImplementedError
        # is a RuntimeError, so this clause must come before the one that re-raises those.
        pass
    except RuntimeError:  # "Transport is closing": the peer reset the connection in between
        if transport.is_closing():
            raise ConnectionResetError("the peer went away") from None
        raise
    fh.seek(offset)
    while count:
        piece = await asyncio.to_thread(fh.read, min(count, 4 << 20))
        if not piece:
            raise ConnectionResetError("state file ended early")
        await response.write(piece)
        count -= len(piece)
