"""What the relay client streams, apart from the HTTP calls themselves: upload bodies of known
length, one gradient slice wrapped for a ticketed upload, and parameter bodies (whole, or a lossy
codec's delta) read straight into the peer's flat buffer.

Pure functions of tensors and container headers; :mod:`toolkit.client` sends and receives them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import urllib3

from toolkit.errors import ProtocolError
from toolkit.wire.auth import container_body_sha256, digest_metadata
from toolkit.wire.compression import Codec, apply_delta
from toolkit.wire.protocol import GradientMeta, PlanSlice, SliceDigest
from toolkit.wire.tensor_container import Header, encoded_size, iter_encoded, peek_header, read_container

# What reading a body can raise when its connection is cut (requests' exceptions are OSErrors too).
BODY_ERRORS: tuple[type[BaseException], ...] = (urllib3.exceptions.HTTPError, OSError)


@dataclass(frozen=True)
class SlicePart:
    """One slice of a gradient, encoded, ready to upload with a ticket."""

    plan: PlanSlice
    tensors: list[tuple[str, np.ndarray]]
    metadata: dict[str, str]
    header_sha256: str

    @property
    def digest(self) -> SliceDigest:
        return SliceDigest(start=self.plan.start, end=self.plan.end, header_sha256=self.header_sha256)


def slice_part(
    plan: PlanSlice, tensors: list[tuple[str, np.ndarray]], meta: GradientMeta, codec: str, *, signed: bool
) -> SlicePart:
    """Wrap one encoded slice: its container metadata (with chunk digests in signed runs, so the
    header the ticket binds also binds the data) and the sha256 of its header."""
    metadata = {"collab": meta.dumps().decode(), "codec": codec, "slice": f"{plan.start}:{plan.end}"}
    if signed:
        metadata.update(digest_metadata(tensors))
    return SlicePart(plan, tensors, metadata, container_body_sha256(tensors, metadata))


class SizedBody:
    """An iterable body with a known length: requests then sends Content-Length, not chunked
    encoding, so the relay can refuse an oversized upload before reading it."""

    def __init__(self, tensors: list[tuple[str, np.ndarray]], metadata: dict[str, str]) -> None:
        self.tensors, self.metadata = tensors, metadata
        self.size = encoded_size(tensors, metadata)

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[memoryview | bytes]:
        return iter_encoded(self.tensors, self.metadata)


class StreamingHash:
    """sha256 of a body while it arrives: the ranges :func:`read_container` hands over are hashed
    on a thread of their own (hashlib releases the GIL), so checking a 100 MB version costs the
    download no time after its last byte instead of a whole pass over the buffer (0.07 s per
    100 MB at 1.5 GB/s, per peer, on the round's critical path). Ranges are batched to
    :data:`STEP` bytes: one thread hop per 4 MiB, and the order of updates is the order of
    arrival because one thread makes them."""

    STEP = 4 << 20

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="collab-hash")
        self._pending: list[memoryview] = []
        self._pending_bytes = 0
        self._last: Future[None] | None = None

    def __call__(self, view: memoryview) -> None:
        self._pending.append(view)
        self._pending_bytes += len(view)
        if self._pending_bytes >= self.STEP:
            self._flush()

    def _flush(self) -> None:
        views, self._pending, self._pending_bytes = self._pending, [], 0
        if views:
            self._last = self._pool.submit(_update_all, self._sha, views)

    def hexdigest(self) -> str:
        """The digest of everything handed over (waits for the thread; closes it)."""
        self._flush()
        try:
            if self._last is not None:
                self._last.result()
            return self._sha.hexdigest()
        finally:
            self._pool.shutdown(wait=True)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _update_all(sha: hashlib._Hash, views: list[memoryview]) -> None:
    for view in views:
        sha.update(view)


def read_params(
    stream: BinaryIO,
    header: Header,
    out: np.ndarray,
    have: int | None,
    codec: Codec | None,
    on_data: Callable[[memoryview], None] | None = None,
) -> bool:
    """Read a parameters body (whole, or a lossy codec's delta against version ``have``) into
    ``out``; True when it was whole (then ``on_data`` saw every byte of ``out`` as it landed)."""
    if header.metadata.get("kind") == "delta":
        if codec is None or header.metadata.get("base") != str(have):
            raise ProtocolError(
                "bad_delta",
                f"the server sent a delta against version {header.metadata.get('base')}, this peer holds {have}",
            )
        _, tensors = read_container(stream, out.nbytes, header=header)
        apply_delta(codec, out, tensors)
        return False
    read_container(stream, out.nbytes, out={"params": out}, header=header, on_data=on_data)
    return True


def read_hashed(stream: BinaryIO, header: Header, out: np.ndarray, have: int | None, codec: Codec | None) -> str:
    """:func:`read_params`, then the sha256 of ``out`` (the parameters the peer now holds), to be
    compared with the hash the relay signed: computed while a whole body arrives, over the
    result after a delta."""
    streaming = StreamingHash()
    try:
        whole = read_params(stream, header, out, have, codec, on_data=streaming)
    except BaseException:
        streaming.close()
        raise
    return streaming.hexdigest() if whole else hashlib.sha256(out.data.cast("B")).hexdigest()


def read_checked_params(
    stream: BinaryIO, headers: Mapping[str, str], out: np.ndarray, have: int | None, codec: Codec | None
) -> int:
    """Read a parameters answer into ``out`` and check it: its length against Content-Length and
    the result against the published ``X-Collab-Sha256``. A connection cut mid-body, or anything
    spliced into it, fails here (ProtocolError) instead of in training; ``out`` may then be
    half-written, so the caller downloads the whole version again. Returns the version's step."""
    header = peek_header(stream, out.nbytes)
    digest = read_hashed(stream, header, out, have, codec)
    declared = headers.get("Content-Length")
    if declared is not None and stream.tell() != int(declared):
        raise ProtocolError(
            "params_length_mismatch",
            f"the parameters body ended after {stream.tell()} of {declared} bytes",
            "Download again (the toolkit does).",
        )
    if digest != headers.get("X-Collab-Sha256", ""):
        raise ProtocolError(
            "params_hash_mismatch",
            "the downloaded parameters differ from the hash the relay published",
            "Download again; if it repeats, something alters the traffic.",
        )
    return int(header.metadata.get("step", -1))


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """The seconds a 503 or 429 answer asks to wait (``Retry-After``), None when it names none."""
    try:
        return max(0.0, float(headers.get("Retry-After", "")))
    except ValueError:
        return None
