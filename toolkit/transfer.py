"""What the relay client streams, apart from the HTTP calls themselves: upload bodies of known
length, one gradient slice wrapped for a ticketed upload, and parameter bodies (whole, or a lossy
codec's delta) read straight into the peer's flat buffer.

Pure functions of tensors and container headers; :mod:`toolkit.client` sends and receives them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from toolkit.errors import ProtocolError
from toolkit.wire.auth import container_body_sha256, digest_metadata
from toolkit.wire.compression import Codec, apply_delta
from toolkit.wire.protocol import GradientMeta, PlanSlice, SliceDigest
from toolkit.wire.tensor_container import encoded_size, iter_encoded, read_container


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
