"""The codec contract every codec implements: the wire layout (side tensors, then one payload),
validation of received tensors, and chunked encode / ``decode_range`` on cache-sized slices.

``Codec`` is stateless; subclasses supply ``encode_slice`` (public: :mod:`.feedback` fuses its own passes
with it, slice by slice, into ``output_tensors``) and ``_decode_range`` (see
:mod:`.codecs`). Helpers shared with :mod:`.feedback` (``_WORK``, ``_iter_decoded``, ``_bad``,
``_array_label``) are private to this package.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar, NamedTuple, Protocol

import numpy as np

from toolkit.errors import ProtocolError

# Elements per inner pass: an input slice plus a float32 scratch of this size (512 KiB) stays in
# L2, so the several numpy passes per slice cost cache bandwidth, not memory bandwidth.
_WORK = 1 << 16

Tensors = list[tuple[str, np.ndarray]]


class TensorSpec(NamedTuple):
    """One tensor of a codec's wire layout: what the container header must announce."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class _EntryLike(Protocol):
    """Anything with a name, dtype and shape: ``tensor_container.TensorEntry`` or ``TensorSpec``
    (read only: a frozen dataclass's fields are)."""

    @property
    def name(self) -> str: ...

    @property
    def dtype(self) -> np.dtype: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


def _bad(message: str) -> ProtocolError:
    return ProtocolError(
        "bad_tensor", message, "Peer and relay must use the run's compression codec and the same collabtrain version."
    )


class Codec(ABC):
    """Encodes a float32 vector (n,) into wire tensors and decodes them back, in ranges.

    Stateless and thread-safe: every call allocates its own small scratch. ``encode`` takes local,
    trusted data and raises plain ``ValueError`` for NaN/Inf or out-of-range input. Everything
    that reads received tensors raises ``ProtocolError`` (a ``ValueError``) with code
    ``bad_tensor``, which the relay's error middleware already turns into a 400 answer.
    """

    name: ClassVar[str]
    payload_dtype: ClassVar[np.dtype]
    alignment: ClassVar[int] = 1  # decode_range's ``start`` must be a multiple of this
    lossless: ClassVar[bool] = False  # decode(encode(x)) == x bit for bit
    # Whether a container that passed ``validate`` always decodes to finite values, whatever its
    # payload bytes: then the relay can skip its per-chunk NaN/Inf scan of the decoded values.
    finite_output: ClassVar[bool] = False

    # --- layout ---------------------------------------------------------------------------------
    def side_layout(self, n: int) -> list[TensorSpec]:
        """The side tensors that precede the payload, in wire order."""
        return []

    def payload_size(self, n: int) -> int:
        """Elements of the payload of an n-vector: n for the dense codecs (element i encodes value
        i). Any codec's sizes add up at its alignment: ``payload_size(a + b) == payload_size(a) +
        payload_size(b)`` when ``a`` is a multiple of ``alignment``, so the values ``[start, start
        + count)`` (``start`` aligned) are payload elements ``payload_range(start, count)`` and a
        receiver can cut the payload into pieces of whole value ranges without reading it."""
        return n

    def payload_range(self, start: int, count: int) -> tuple[int, int]:
        """The payload elements ``[a, b)`` that encode values ``[start, start + count)``; ``start``
        a multiple of ``alignment``, ``count`` too unless the range ends the vector."""
        a = self.payload_size(start)
        return a, a + self.payload_size(count)

    @property
    def dense(self) -> bool:
        """Whether payload element i encodes value i (``payload_size(n) == n``): the only codecs
        that can carry row matrices (pipeline boundaries, DMoE activations)."""
        return type(self).payload_size is Codec.payload_size

    def layout(self, n: int) -> list[TensorSpec]:
        """Every tensor of an encoded n-vector, in wire order; the payload comes last."""
        return [*self.side_layout(n), TensorSpec("payload", self.payload_dtype, (self.payload_size(n),))]

    def wire_bytes(self, n: int) -> int:
        """Tensor bytes of an encoded n-vector (the container adds a header of ~100-200 bytes)."""
        return sum(spec.nbytes for spec in self.layout(n))

    def check_layout(self, entries: Sequence[_EntryLike], n: int) -> None:
        """Check a received container's header (names, order, dtypes, shapes) before reading any
        tensor bytes, so a hostile header cannot make the relay read a huge "side" tensor."""
        got = [(e.name, np.dtype(e.dtype), tuple(e.shape)) for e in entries]
        expected = [(spec.name, spec.dtype, spec.shape) for spec in self.layout(n)]
        if got != expected:
            raise _bad(
                f"codec {self.name!r} expects tensors {_describe(expected)} for {n} values, got {_describe(got)}"
            )

    def validate(self, side: Mapping[str, np.ndarray], payload_dtype: np.dtype, n: int) -> None:
        """Check received side tensors (names, dtypes, shapes, values) and the payload dtype for an
        n-vector. Call once per container, before ``decode_range``; decoding trusts what passed."""
        expected = self.side_layout(n)
        if set(side) != {spec.name for spec in expected}:
            raise _bad(f"codec {self.name!r} expects side tensors {[s.name for s in expected]}, got {sorted(side)}")
        for spec in expected:
            array = side[spec.name]
            if not isinstance(array, np.ndarray) or array.dtype != spec.dtype or array.shape != spec.shape:
                raise _bad(
                    f"codec {self.name!r}: side tensor {spec.name!r} must be {spec.dtype} of shape "
                    f"{spec.shape} for {n} values, got {_array_label(array)}"
                )
        if np.dtype(payload_dtype) != self.payload_dtype:
            raise _bad(f"codec {self.name!r}: payload must be {self.payload_dtype}, got {np.dtype(payload_dtype)}")
        self._check_side_values(side)

    def _check_side_values(self, side: Mapping[str, np.ndarray]) -> None:
        """Content checks beyond dtype and shape (int8: scales finite, >= 0, <= SCALE_MAX)."""

    def check_payload(self, side: Mapping[str, np.ndarray], payload: np.ndarray, n: int) -> None:
        """Check a whole received payload's content (n values, ``validate`` passed) without
        decoding it, for a receiver that must refuse before changing anything (``apply_delta``).
        ``decode_range`` checks each piece anyway; dense codecs accept any payload bytes."""

    # --- encode / decode ------------------------------------------------------------------------
    def encode(self, x: np.ndarray, out: Tensors | None = None) -> Tensors:
        """``[(name, array), ...]`` in wire order for a float32 vector ``x`` (n,).

        ``out``: the tensors of an earlier encode of the same length, overwritten in place. A peer
        encoding every step saves the kernel's page faults on fresh 100 MB buffers, but may only
        pass them once the earlier tensors are no longer being sent. "none" ignores
        ``out``: its payload is ``x`` itself (no copy), so do not modify ``x`` while it is sent.
        Raises ``ValueError`` if ``x`` holds NaN/Inf or values the codec cannot represent.
        """
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 1:
            raise ValueError(f"codec {self.name!r} encodes a 1-D float32 array, got {_array_label(x)}")
        tensors = self.output_tensors(x.size, out)
        buffers = dict(tensors)
        scratch = np.empty(min(_WORK, x.size), dtype=np.float32)
        for start in range(0, x.size, _WORK):  # cache-sized slices
            self.encode_slice(x[start : start + _WORK], buffers, start, scratch)
        return tensors

    def output_tensors(self, n: int, out: Tensors | None) -> Tensors:
        """``out`` checked against ``layout(n)``, or fresh tensors for n values."""
        if out is None:
            return [(spec.name, np.empty(spec.shape, spec.dtype)) for spec in self.layout(n)]
        got = [TensorSpec(name, a.dtype, a.shape) for name, a in out]
        if got != self.layout(n) or not all(a.flags.c_contiguous and a.flags.writeable for _, a in out):
            raise ValueError(
                f"out must be writable tensors laid out as {_describe(self.layout(n))}, got {_describe(got)}"
            )
        return out

    @abstractmethod
    def encode_slice(self, x: np.ndarray, out: dict[str, np.ndarray], start: int, scratch: np.ndarray) -> None:
        """Encode x, values ``[start, start + len(x))`` of the vector, into ``out``'s tensors (the
        payload's elements ``payload_range(start, len(x))``).

        ``start`` is a multiple of ``_WORK``; ``scratch`` is float32 with at least len(x) values.
        Slices are independent, which lets ErrorFeedback and DeltaEncoder fuse their own passes
        with encoding while a slice is still in cache.
        """

    def decode_range(
        self,
        side: Mapping[str, np.ndarray],
        payload_piece: np.ndarray,
        start: int,
        out: np.ndarray | None = None,
        count: int | None = None,
    ) -> np.ndarray:
        """Decode the values ``[start, start + count)`` from the payload elements that encode
        them (``payload_piece``, exactly ``payload_range(start, count)`` of the payload) into float32.

        ``start`` is a VALUE index, a multiple of ``alignment`` (256 for int8: a piece begins on a
        block boundary; 4096 for topk2). ``count`` is the number of values the piece covers:
        ``out.size`` when ``out`` is given, else ``count``, else (dense codecs only) the piece's
        length; it must be a multiple of ``alignment`` unless the range ends the vector. ``out``
        (float32, ``count`` values) avoids an allocation; the result is bit-identical however the
        payload is split, so streamed and whole decodes agree exactly. Assumes ``validate`` passed
        for ``side``; the payload bytes themselves are untrusted and checked here (``ProtocolError``
        ``bad_tensor``). Returns ``out`` (or a new array). Unless ``finite_output``, a hostile
        payload can decode to NaN/Inf: the receiver still checks.
        """
        if (
            not isinstance(payload_piece, np.ndarray)
            or payload_piece.dtype != self.payload_dtype
            or payload_piece.ndim != 1
        ):
            raise _bad(
                f"codec {self.name!r}: payload piece must be 1-D {self.payload_dtype}, "
                f"got {_array_label(payload_piece)}"
            )
        if start < 0 or start % self.alignment:
            raise ValueError(
                f"codec {self.name!r}: decode_range start {start} is not a multiple of "
                f"the codec's alignment {self.alignment}"
            )
        count = self._values(out, count, payload_piece, "decode_range needs out or count (values the piece covers)")
        if payload_piece.size != self.payload_size(count):  # the caller cut the payload wrong
            raise ValueError(
                f"out must be float32 of the values the piece covers: codec {self.name!r} "
                f"encodes {count} values in {self.payload_size(count)} payload elements, "
                f"the piece has {payload_piece.size} (cut it with payload_range)"
            )
        if out is None:
            out = np.empty(count, dtype=np.float32)
        self._decode_range(side, payload_piece, start, out)
        return out

    def _values(self, out: np.ndarray | None, count: int | None, payload: np.ndarray, needs: str) -> int:
        """How many values a decode writes: ``out``'s size (checked against ``count``), else
        ``count``, else -- dense codecs only -- one per payload element."""
        if out is not None:
            if out.dtype != np.float32 or out.ndim != 1 or (count is not None and out.size != count):
                raise ValueError(f"out must be 1-D float32 of {count} values, got {_array_label(out)}")
            return out.size
        if count is not None:
            return count
        if not self.dense:
            raise ValueError(f"codec {self.name!r}: {needs}")
        return payload.size

    @abstractmethod
    def _decode_range(self, side: Mapping[str, np.ndarray], piece: np.ndarray, start: int, out: np.ndarray) -> None:
        """Decode values ``[start, start + out.size)`` from ``piece`` (checked: its length is
        ``payload_size(out.size)`` and ``start`` is aligned) into ``out``."""

    def decode(
        self, tensors: Mapping[str, np.ndarray] | Tensors, out: np.ndarray | None = None, n: int | None = None
    ) -> np.ndarray:
        """The whole float32 vector (n,) from ``encode``'s output (a list or a dict); validates.
        ``n``: the vector's length, ``out.size`` when ``out`` is given (dense codecs: the payload's)."""
        tensors = dict(tensors)
        payload = tensors.pop("payload", None)
        if not isinstance(payload, np.ndarray) or payload.ndim != 1:
            raise _bad(f"codec {self.name!r}: a 1-D 'payload' tensor is required")
        n = self._values(out, n, payload, "decode needs out or n (the vector's length)")
        if payload.size != self.payload_size(n):
            raise _bad(
                f"codec {self.name!r}: {n} values take {self.payload_size(n)} payload elements, got {payload.size}"
            )
        self.validate(tensors, payload.dtype, n)
        if out is None:
            out = np.empty(n, dtype=np.float32)
        for _ in _iter_decoded(self, tensors, payload, n, out):
            pass
        return out


def _iter_decoded(
    codec: Codec, side: Mapping[str, np.ndarray], payload: np.ndarray, n: int, out: np.ndarray | None = None
) -> Iterator[tuple[int, np.ndarray]]:
    """Decode the n values of ``payload`` slice by slice: yields ``(start, float32 values)``, into
    ``out`` (n,) when given, else into one reused cache-sized scratch (valid until the next
    iteration). Assumes ``validate`` passed and ``payload.size == codec.payload_size(n)``."""
    into = out if out is not None else np.empty(min(_WORK, n), dtype=np.float32)
    for start in range(0, n, _WORK):  # _WORK is a multiple of every alignment
        count = min(_WORK, n - start)
        a, b = codec.payload_range(start, count)
        target = into[start : start + count] if out is not None else into[:count]
        yield start, codec.decode_range(side, payload[a:b], start, target)


def _describe(specs: Sequence[tuple[str, np.dtype, tuple[int, ...]]]) -> str:
    return "[" + ", ".join(f"{name}:{np.dtype(dtype)}{list(shape)}" for name, dtype, shape in specs) + "]"


def _array_label(a: object) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.dtype} array of shape {a.shape}"
    return type(a).__name__
