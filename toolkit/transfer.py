"""What the relay client streams, apart from the HTTP calls themselves: upload bodies of known
length, one gradient slice wrapped for a ticketed upload, and parameter bodies (whole, or a lossy
codec's delta) read straight into the peer's flat buffer.

Pure functions of tensors and container headers; :mod:`toolkit.client` sends and receives them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import urllib3

from toolkit.errors import ProtocolError
from toolkit.wire.auth import container_body_sha256, digest_metadata
from toolkit.wire.compression import Codec, apply_delta
from toolkit.wire.protocol import GradientMeta, PlanSlice, SliceDigest
from toolkit.wire.tensor_container import encoded_size, iter_encoded, peek_header, read_container

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


def slice_part(plan: PlanSlice, tensors: list[tuple[str, np.ndarray]], meta: GradientMeta, codec: str,
               *, signed: bool) -> SlicePart:
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

    def __iter__(self):
        return iter_encoded(self.tensors, self.metadata)


def read_params(stream, header, out: np.ndarray, have: int | None, codec: Codec | None) -> None:
    """Read a parameters body (whole, or a lossy codec's delta against version ``have``) into ``out``."""
    if header.metadata.get("kind") == "delta":
        if codec is None or header.metadata.get("base") != str(have):
            raise ProtocolError("bad_delta", f"the server sent a delta against version {header.metadata.get('base')}, "
                                f"this peer holds {have}")
        _, tensors = read_container(stream, out.nbytes, header=header)
        apply_delta(codec, out, tensors)
    else:
        read_container(stream, out.nbytes, out={"params": out}, header=header)


def read_checked_params(stream, headers: Mapping[str, str], out: np.ndarray, have: int | None,
                        codec: Codec | None) -> int:
    """Read a parameters answer into ``out`` and check it: its length against Content-Length and
    the result against the published ``X-Collab-Sha256``. A connection cut mid-body, or anything
    spliced into it, fails here (ProtocolError) instead of in training; ``out`` may then be
    half-written, so the caller downloads the whole version again. Returns the version's step."""
    header = peek_header(stream, out.nbytes)
    read_params(stream, header, out, have, codec)
    declared = headers.get("Content-Length")
    if declared is not None and stream.tell() != int(declared):
        raise ProtocolError("params_length_mismatch", f"the parameters body ended after {stream.tell()} of "
                            f"{declared} bytes", "Download again (the toolkit does).")
    if hashlib.sha256(memoryview(out).cast("B")).hexdigest() != headers.get("X-Collab-Sha256", ""):
        raise ProtocolError("params_hash_mismatch", "the downloaded parameters differ from the hash the relay "
                            "published", "Download again; if it repeats, something alters the traffic.")
    return int(header.metadata.get("step", -1))


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """The seconds a 503 or 429 answer asks to wait (``Retry-After``), None when it names none."""
    try:
        return max(0.0, float(headers.get("Retry-After", "")))
    except ValueError:
        return None
