"""Tensors on the wire and on disk: the safetensors format, written and read as a stream.

Layout (the safetensors spec): 8-byte little-endian header length ``N``, ``N`` bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``,
then the raw little-endian tensor bytes. Any file written here loads with
``safetensors.numpy.load``. We write and read it ourselves, in chunks, because the relay reduces
a 100 MB gradient while it is still arriving and the peer sends straight from its buffer: the
library's ``save``/``load`` need the whole payload in memory. Never pickle.

Tensors are laid out in the order given, so small side tensors (quantization scales) can precede
the big payload a reader consumes chunk by chunk.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np

from toolkit.errors import ProtocolError

DTYPES: dict[str, np.dtype[Any]] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "F64": np.dtype("<f8"),
}
_CODES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 64 * 1024
STREAM_CHUNK = 4 * 1024 * 1024  # bytes per write/read: big enough to amortise syscalls


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        """Exact (Python ints): ``np.prod`` in int64 wraps, so [2**32, 2**32] would pass as 0."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    entries: list[TensorEntry]  # in data order
    metadata: dict[str, str]
    header_bytes: int  # 8 + N

    @property
    def data_bytes(self) -> int:
        return self.entries[-1].end if self.entries else 0

    def entry(self, name: str) -> TensorEntry:
        for e in self.entries:
            if e.name == name:
                return e
        raise ProtocolError("bad_tensor", f"tensor {name!r} missing from the container")


def encode_header(tensors: list[tuple[str, np.ndarray]], metadata: dict[str, str] | None = None) -> bytes:
    """The 8 + N header bytes for ``tensors`` laid out in the given order."""
    return encode_header_for([(name, a.dtype, a.shape) for name, a in tensors], metadata)


def encode_header_for(
    specs: list[tuple[str, np.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> bytes:
    """The header for tensors described by (name, dtype, shape), whose bytes come from elsewhere
    (the relay sends a stored byte range behind it)."""
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape in specs:
        dtype = np.dtype(dtype)
        code = _CODES.get(dtype) if dtype.byteorder != ">" else None
        if code is None:
            raise ProtocolError("bad_tensor", f"dtype {dtype} cannot travel on the wire")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the spec pads the header to 8-byte alignment
    return struct.pack("<Q", len(raw)) + raw


def iter_encoded(
    tensors: list[tuple[str, np.ndarray]], metadata: dict[str, str] | None = None, chunk: int = STREAM_CHUNK
) -> Iterator[memoryview | bytes]:
    """Yield the container as header bytes then zero-copy views of each tensor's buffer."""
    yield encode_header(tensors, metadata)
    for _, array in tensors:
        # ``.data`` is memoryview(array), typed: numpy's stubs give ndarray the buffer protocol only from Python 3.12
        flat = np.ascontiguousarray(array).data.cast("B")
        for start in range(0, len(flat), chunk):
            yield flat[start : start + chunk]


def write_file(
    path: str | Path,
    tensors: list[tuple[str, np.ndarray]],
    metadata: dict[str, str] | None = None,
    *,
    digest_of: str | None = None,
    fsync: bool = False,
) -> tuple[Header, str | None]:
    """Write a container to ``path`` atomically (temporary file, then rename), in chunks.

    Returns its header and, if ``digest_of`` names a tensor, the sha256 of that tensor's bytes,
    computed in the same pass as the write (each chunk is hashed while it is still in cache).
    """
    path = Path(path)
    head = encode_header(tensors, metadata)
    digest = hashlib.sha256() if digest_of is not None else None
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(head)
        for name, array in tensors:
            flat = np.ascontiguousarray(array).data.cast("B")
            for start in range(0, len(flat), STREAM_CHUNK):
                piece = flat[start : start + STREAM_CHUNK]
                if digest is not None and name == digest_of:
                    digest.update(piece)
                fh.write(piece)
        if fsync:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)
    header = parse_header(head[:8], head[8:], max_data_bytes=1 << 62)
    return header, (digest.hexdigest() if digest is not None else None)


def read_file_header(path: str | Path) -> Header:
    """The header of a container file (its tensors' byte ranges), without reading the data."""
    with open(path, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) < 8:
            raise ProtocolError("truncated_body", f"{path} is not a tensor container")
        return parse_header(prefix, fh.read(_header_length(prefix)), max_data_bytes=1 << 62)


def encoded_size(tensors: list[tuple[str, np.ndarray]], metadata: dict[str, str] | None = None) -> int:
    return len(encode_header(tensors, metadata)) + sum(a.nbytes for _, a in tensors)


def parse_header(prefix: bytes, raw: bytes, max_data_bytes: int) -> Header:
    """Validate a header: known dtypes, shapes matching byte ranges, contiguous offsets."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError("bad_tensor", "tensor header is not valid JSON") from None
    if not isinstance(obj, dict):
        raise ProtocolError("bad_tensor", "tensor header must be a JSON object")
    metadata = obj.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ProtocolError("bad_tensor", "tensor metadata must map strings to strings")
    entries = []
    for name, spec in obj.items():
        try:
            dtype = DTYPES[spec["dtype"]]
            shape = tuple(int(s) for s in spec["shape"])
            begin, end = (int(x) for x in spec["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ProtocolError("bad_tensor", f"tensor {name!r}: bad or unsupported dtype/shape/offsets") from None
        if any(s < 0 for s in shape):
            raise ProtocolError("bad_tensor", f"tensor {name!r}: negative dimension")
        entry = TensorEntry(name, dtype, shape, begin, end)
        if end - begin != entry.numel * dtype.itemsize:
            raise ProtocolError("bad_tensor", f"tensor {name!r}: byte range does not match its shape")
        entries.append(entry)
    entries.sort(key=lambda e: e.begin)
    position = 0
    for e in entries:
        if e.begin != position:
            raise ProtocolError("bad_tensor", "tensor byte ranges must be contiguous")
        position = e.end
    if position > max_data_bytes:
        raise ProtocolError("body_too_large", f"tensor data of {position} bytes exceeds the limit of {max_data_bytes}")
    return Header(entries, metadata, len(prefix) + len(raw))


def _header_length(prefix: bytes) -> int:
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER:
        raise ProtocolError("bad_tensor", f"tensor header of {n} bytes exceeds {MAX_HEADER}")
    return n


class _AsyncReader(Protocol):
    async def readexactly(self, n: int) -> bytes: ...


@dataclass(frozen=True)
class Pieces:
    """One chunk of a tensor as it arrived: zero-copy views of the network buffers. The event
    loop only collects them; :meth:`gather` (on the relay's reducer thread) makes the array, so
    the thread that receives never copies a whole chunk."""

    dtype: np.dtype
    count: int
    buffers: list[memoryview]

    def gather(self, staging: np.ndarray) -> np.ndarray:
        """The chunk as a 1-D array: a view when it arrived in one buffer, else copied into
        ``staging`` (uint8, at least the chunk's bytes; numpy copies without holding the GIL)."""
        if len(self.buffers) == 1:
            return np.frombuffer(self.buffers[0], dtype=self.dtype, count=self.count)
        out = staging[: self.count * self.dtype.itemsize]
        position = 0
        for buffer in self.buffers:
            out[position : position + len(buffer)] = np.frombuffer(buffer, dtype=np.uint8)
            position += len(buffer)
        return out.view(self.dtype)


class AsyncContainerReader:
    """Reads a container from an aiohttp ``StreamReader`` (the relay's upload path)."""

    def __init__(self, stream: _AsyncReader, max_data_bytes: int, total_bytes: int | None = None) -> None:
        """``total_bytes``: the body's declared length; the header must account for exactly that
        many bytes, so a body that is too long or too short is refused before any data is used."""
        self._stream = stream
        self._max = max_data_bytes
        self._total = total_bytes
        self._leftover: memoryview | None = None  # received past the last chunk's end
        self.header: Header | None = None

    async def read_header(self) -> Header:
        prefix = await self._read(8)
        raw = await self._read(_header_length(prefix))
        self.header = parse_header(prefix, raw, self._max)
        if self._total is not None and self.header.header_bytes + self.header.data_bytes != self._total:
            raise ProtocolError(
                "length_mismatch",
                f"the body is {self._total} bytes but its tensor header "
                f"accounts for {self.header.header_bytes + self.header.data_bytes}",
            )
        return self.header

    async def read_tensor(self, entry: TensorEntry) -> np.ndarray:
        """Read a (small) tensor whole; entries must be read in data order."""
        return np.frombuffer(await self._read(entry.end - entry.begin), dtype=entry.dtype).reshape(entry.shape)

    async def iter_chunks(self, entry: TensorEntry, chunk_elems: int) -> AsyncIterator[tuple[int, np.ndarray]]:
        """Yield ``(start_element, 1-D array)`` pieces of a big tensor, ``chunk_elems`` each."""
        itemsize = entry.dtype.itemsize
        for start in range(0, entry.numel, chunk_elems):
            count = min(chunk_elems, entry.numel - start)
            yield start, np.frombuffer(await self._read(count * itemsize), dtype=entry.dtype)

    async def iter_chunk_pieces(self, entry: TensorEntry, chunk_elems: int) -> AsyncIterator[tuple[int, Pieces]]:
        """Like :meth:`iter_chunks`, without joining the received buffers (see :class:`Pieces`)."""
        itemsize = entry.dtype.itemsize
        for start in range(0, entry.numel, chunk_elems):
            count = min(chunk_elems, entry.numel - start)
            yield start, Pieces(entry.dtype, count, await self._read_pieces(count * itemsize))

    async def _read_pieces(self, n: int) -> list[memoryview]:
        readany = getattr(self._stream, "readany", None)
        if readany is None:  # a stream that checks digests per chunk hands out whole chunks
            return [memoryview(await self._read(n))]
        pieces: list[memoryview] = []
        while n:
            if self._leftover is not None:
                view, self._leftover = self._leftover, None
            else:
                data = await readany()
                if not data:
                    raise ProtocolError("truncated_body", "the request body ended before the tensor data did")
                view = memoryview(data)
            if len(view) > n:
                view, self._leftover = view[:n], view[n:]
            pieces.append(view)
            n -= len(view)
        return pieces

    async def _read(self, n: int) -> bytes:
        import asyncio

        try:
            return await self._stream.readexactly(n)
        except asyncio.IncompleteReadError:
            raise ProtocolError("truncated_body", "the request body ended before the tensor data did") from None


def peek_header(stream: BinaryIO, max_data_bytes: int) -> Header:
    """Read just the header off a blocking stream (the data follows; see :func:`read_container`)."""
    prefix = _read_exactly(stream, 8)
    return parse_header(prefix, _read_exactly(stream, _header_length(prefix)), max_data_bytes)


def read_container(
    stream: BinaryIO,
    max_data_bytes: int,
    out: dict[str, np.ndarray] | None = None,
    header: Header | None = None,
    on_data: Callable[[memoryview], None] | None = None,
) -> tuple[Header, dict[str, np.ndarray]]:
    """Read a whole container from a blocking file-like object (the peer's download path);
    pass ``header`` if :func:`peek_header` already consumed it.

    Tensors named in ``out`` are read straight into those preallocated arrays (no extra copy of
    a 100 MB parameter vector); the others are allocated. ``on_data`` is handed each range of
    tensor bytes as it lands, in order (a hash computed while the rest still arrives).
    """
    header = header or peek_header(stream, max_data_bytes)
    result: dict[str, np.ndarray] = {}
    for entry in header.entries:
        target = (out or {}).get(entry.name)
        if target is None:
            target = np.empty(entry.shape, dtype=entry.dtype)
        elif target.dtype != entry.dtype or target.size != entry.numel or not target.flags.c_contiguous:
            raise ProtocolError("bad_tensor", f"tensor {entry.name!r} does not match the expected buffer")
        view = target.reshape(-1).data.cast("B")
        position = 0
        while position < len(view):
            # every stream passed here (a response's raw body, a file opened "rb") has readinto;
            # typing.BinaryIO does not declare it
            got = stream.readinto(view[position : position + STREAM_CHUNK])  # type: ignore[attr-defined]
            if not got:
                raise ProtocolError("truncated_body", "the tensor stream ended early")
            if on_data is not None:
                on_data(view[position : position + got])
            position += got
        result[entry.name] = target.reshape(entry.shape)
    return header, result


def _read_exactly(stream: BinaryIO, n: int) -> bytes:
    data = b""
    while len(data) < n:
        piece = stream.read(n - len(data))
        if not piece:
            raise ProtocolError("truncated_body", "the tensor stream ended early")
        data += piece
    return data
