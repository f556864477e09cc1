"""Compression codecs for both directions of the wire (DESIGN.md s6), numpy only.

A run picks one codec by name (``get_codec("int8")``); peers and relay build the same one. A codec
turns a float32 vector (n,) into named tensors **in wire order**: small side tensors first, then
exactly one big ``"payload"`` whose element i encodes value i. That order is what lets the relay
reduce a 100 MB gradient chunk by chunk while it is still arriving: it reads the side tensors
whole, validates them once, then decodes each payload chunk the moment its bytes are in
(``decode_range``), and the peer streams the tensors straight from their buffers.

Wire layouts for n values (``Codec.layout(n)``; dtypes as safetensors codes):

    none     payload F32 (n,)                        4 bytes/value, exact
    float16  payload F16 (n,)                        2 bytes/value, |x| < 65520
    int8     scales  F32 (ceil(n/256),)              1 + 4/256 bytes/value = 0.254 x float32
             payload I8  (n,)   value i = payload[i] * scales[i // 256]

Two helpers carry the quantization error across steps so it never accumulates:
``ErrorFeedback`` (peer -> relay gradient sums) and ``DeltaEncoder`` / ``apply_delta``
(relay -> peer parameters as deltas against the copy every peer holds). The module never imports
torch, so the relay's reduction path and the codec stay light.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar, NamedTuple, NoReturn, Protocol

import numpy as np

from toolkit.errors import ProtocolError

# int8 block size. Each 256-value block carries one float32 absmax scale: 1 + 4/256 = 1.0156
# bytes/value = 0.254 x float32, inside the 0.26 budget. Smaller blocks track outliers more
# closely (an outlier only coarsens its own block's step) but cost more: 128 -> 0.258 x, 64 ->
# 0.266 x (over budget). float16 scales would allow 64-value blocks at 0.258 x, but float16 loses
# precision for scales below 6.1e-5 (blocks with absmax < 7.8e-3, common for gradients) and
# flushes them to zero below 6e-8; float32 scales cover every finite input. 256 also divides the
# relay's CHUNK_ELEMS (1 << 20), so every chunk it streams starts on a block boundary.
BLOCK = 256
# Elements per inner pass: an input slice plus a float32 scratch of this size (512 KiB) stays in
# L2, so the several numpy passes per slice cost cache bandwidth, not memory bandwidth.
_WORK = 1 << 16
_F32_MAX = float(np.finfo(np.float32).max)
_F32_NORMAL_MIN = np.float32(np.finfo(np.float32).tiny)  # 2^-126: 1/s is finite at and above it
# Largest legal int8 scale. FLT_MAX/128 is exact (a power of two), and keeps every decoded value
# finite even for a hostile payload byte of -128: 128 * SCALE_MAX == FLT_MAX. (127 x
# fl(FLT_MAX/127) already overflows to inf.) The price: inputs above 127/128 x FLT_MAX (3.376e38)
# are rejected, not quantized; a gradient there has diverged anyway.
SCALE_MAX = np.float32(_F32_MAX / 128)
_INV127_UP = np.float32(1 / 127 * (1 + 2 ** -20))  # see _quantize_blocks
INT8_INPUT_MAX = float(SCALE_MAX) / float(_INV127_UP)  # ~3.376e38
# float32 values at or above 65520 round to inf in float16 (65504 is float16's largest finite):
# the largest float32 below it is the largest input float16 can take.
_F16_MAX_INPUT = float(np.nextafter(np.float32(65520), np.float32(0)))

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
    """Anything with a name, dtype and shape: ``tensor_container.TensorEntry`` or ``TensorSpec``."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]


def _bad(message: str) -> ProtocolError:
    return ProtocolError("bad_tensor", message,
                         "Peer and relay must use the run's compression codec and the same collabtrain version.")


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

    def layout(self, n: int) -> list[TensorSpec]:
        """Every tensor of an encoded n-vector, in wire order; the payload comes last."""
        return [*self.side_layout(n), TensorSpec("payload", self.payload_dtype, (n,))]

    def wire_bytes(self, n: int) -> int:
        """Tensor bytes of an encoded n-vector (the container adds a header of ~100-200 bytes)."""
        return sum(spec.nbytes for spec in self.layout(n))

    def check_layout(self, entries: Sequence[_EntryLike], n: int) -> None:
        """Check a received container's header (names, order, dtypes, shapes) before reading any
        tensor bytes, so a hostile header cannot make the relay read a huge "side" tensor."""
        got = [(e.name, np.dtype(e.dtype), tuple(e.shape)) for e in entries]
        expected = [tuple(spec) for spec in self.layout(n)]
        if got != expected:
            raise _bad(f"codec {self.name!r} expects tensors {_describe(expected)} for {n} values, "
                       f"got {_describe(got)}")

    def validate(self, side: Mapping[str, np.ndarray], payload_dtype: np.dtype, n: int) -> None:
        """Check received side tensors (names, dtypes, shapes, values) and the payload dtype for an
        n-vector. Call once per container, before ``decode_range``; decoding trusts what passed."""
        expected = self.side_layout(n)
        if set(side) != {spec.name for spec in expected}:
            raise _bad(f"codec {self.name!r} expects side tensors {[s.name for s in expected]}, got {sorted(side)}")
        for spec in expected:
            array = side[spec.name]
            if not isinstance(array, np.ndarray) or array.dtype != spec.dtype or array.shape != spec.shape:
                raise _bad(f"codec {self.name!r}: side tensor {spec.name!r} must be {spec.dtype} of shape "
                           f"{spec.shape} for {n} values, got {_array_label(array)}")
        if np.dtype(payload_dtype) != self.payload_dtype:
            raise _bad(f"codec {self.name!r}: payload must be {self.payload_dtype}, got {np.dtype(payload_dtype)}")
        self._check_side_values(side)

    def _check_side_values(self, side: Mapping[str, np.ndarray]) -> None:
        """Content checks beyond dtype and shape (int8: scales finite, >= 0, <= SCALE_MAX)."""

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
        tensors = self._output(x.size, out)
        buffers = dict(tensors)
        scratch = np.empty(min(_WORK, x.size), dtype=np.float32)
        for start in range(0, x.size, _WORK):  # cache-sized slices
            self._encode_slice(x[start:start + _WORK], buffers, start, scratch)
        return tensors

    def _output(self, n: int, out: Tensors | None) -> Tensors:
        """``out`` checked against ``layout(n)``, or fresh tensors for n values."""
        if out is None:
            return [(spec.name, np.empty(spec.shape, spec.dtype)) for spec in self.layout(n)]
        got = [TensorSpec(name, a.dtype, a.shape) for name, a in out]
        if got != self.layout(n) or not all(a.flags.c_contiguous and a.flags.writeable for _, a in out):
            raise ValueError(f"out must be writable tensors laid out as {_describe(self.layout(n))}, "
                             f"got {_describe(got)}")
        return out

    @abstractmethod
    def _encode_slice(self, x: np.ndarray, out: dict[str, np.ndarray], start: int, scratch: np.ndarray) -> None:
        """Encode x, elements ``[start, start + len(x))`` of the vector, into ``out``'s tensors.

        ``start`` is a multiple of ``_WORK``; ``scratch`` is float32 with at least len(x) values.
        Slices are independent, which lets ErrorFeedback and DeltaEncoder fuse their own passes
        with encoding while a slice is still in cache.
        """

    def decode_range(self, side: Mapping[str, np.ndarray], payload_piece: np.ndarray, start: int,
                     out: np.ndarray | None = None) -> np.ndarray:
        """Decode payload elements ``[start, start + len(payload_piece))`` into float32.

        ``start`` must be a multiple of ``alignment`` (256 for int8: a piece must begin on a
        block boundary; its length is free, so the vector's last, short block decodes too). ``out``
        (same shape as the piece, float32) avoids an allocation; the result is bit-identical
        however the payload is split, so streamed and whole decodes agree exactly. Assumes
        ``validate`` passed for ``side``. Returns ``out`` (or a new array). Unless
        ``finite_output``, a hostile payload can decode to NaN/Inf: the receiver still checks.
        """
        if not isinstance(payload_piece, np.ndarray) or payload_piece.dtype != self.payload_dtype \
                or payload_piece.ndim != 1:
            raise _bad(f"codec {self.name!r}: payload piece must be 1-D {self.payload_dtype}, "
                       f"got {_array_label(payload_piece)}")
        if start < 0 or start % self.alignment:
            raise ValueError(f"codec {self.name!r}: decode_range start {start} is not a multiple of "
                             f"the codec's alignment {self.alignment}")
        if out is None:
            out = np.empty(payload_piece.size, dtype=np.float32)
        elif out.dtype != np.float32 or out.shape != payload_piece.shape:
            raise ValueError(f"out must be float32 of shape {payload_piece.shape}, got {_array_label(out)}")
        self._decode_range(side, payload_piece, start, out)
        return out

    @abstractmethod
    def _decode_range(self, side: Mapping[str, np.ndarray], piece: np.ndarray, start: int,
                      out: np.ndarray) -> None: ...

    def decode(self, tensors: Mapping[str, np.ndarray] | Tensors, out: np.ndarray | None = None) -> np.ndarray:
        """The whole float32 vector (n,) from ``encode``'s output (a list or a dict); validates."""
        tensors = dict(tensors)
        payload = tensors.pop("payload", None)
        if not isinstance(payload, np.ndarray) or payload.ndim != 1:
            raise _bad(f"codec {self.name!r}: a 1-D 'payload' tensor is required")
        self.validate(tensors, payload.dtype, payload.size)
        if out is None:
            out = np.empty(payload.size, dtype=np.float32)
        elif out.dtype != np.float32 or out.shape != payload.shape:
            raise ValueError(f"out must be float32 of shape {payload.shape}, got {_array_label(out)}")
        for start in range(0, payload.size, _WORK):  # cache-sized slices; _WORK % alignment == 0
            self.decode_range(tensors, payload[start:start + _WORK], start, out[start:start + _WORK])
        return out


def _iter_decoded(codec: Codec, side: Mapping[str, np.ndarray],
                  payload: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """Decode ``payload`` slice by slice into one reused cache-sized scratch: yields
    ``(start, float32 view)``, valid until the next iteration. Assumes ``validate`` passed."""
    scratch = np.empty(min(_WORK, payload.size), dtype=np.float32)
    for start in range(0, payload.size, _WORK):  # _WORK is a multiple of every alignment
        piece = payload[start:start + _WORK]
        yield start, codec.decode_range(side, piece, start, scratch[:piece.size])


class NoneCodec(Codec):
    """float32 as is: the reference, and the choice when bandwidth is plentiful."""

    name = "none"
    payload_dtype = np.dtype("<f4")
    lossless = True

    def encode(self, x: np.ndarray, out: Tensors | None = None) -> Tensors:
        """Zero-copy: the payload is ``x`` itself once it is checked finite; ``out`` is ignored."""
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 1:
            raise ValueError(f"codec {self.name!r} encodes a 1-D float32 array, got {_array_label(x)}")
        x = np.ascontiguousarray(x)
        for start in range(0, x.size, _WORK):
            _check_within(x[start:start + _WORK], start, _F32_MAX, self.name)
        return [("payload", x)]

    def _encode_slice(self, x: np.ndarray, out: dict[str, np.ndarray], start: int, scratch: np.ndarray) -> None:
        _check_within(x, start, _F32_MAX, self.name)
        out["payload"][start:start + x.size] = x

    def _decode_range(self, side: Mapping[str, np.ndarray], piece: np.ndarray, start: int,
                      out: np.ndarray) -> None:
        np.copyto(out, piece)


class Float16Codec(Codec):
    """IEEE half precision: 0.5 x float32, relative error <= 2^-11 for |x| >= 6.1e-5 and absolute
    error <= 2^-25 below (subnormals). Rejects |x| >= 65520, which would become inf."""

    name = "float16"
    payload_dtype = np.dtype("<f2")

    def _encode_slice(self, x: np.ndarray, out: dict[str, np.ndarray], start: int, scratch: np.ndarray) -> None:
        _check_within(x, start, _F16_MAX_INPUT, self.name)
        np.copyto(out["payload"][start:start + x.size], x, casting="same_kind")

    def _decode_range(self, side: Mapping[str, np.ndarray], piece: np.ndarray, start: int,
                      out: np.ndarray) -> None:
        np.copyto(out, piece)


class Int8Codec(Codec):
    """Blockwise absmax quantization: per 256-value block, scale s = absmax / 127 (float32) and
    q = rint(x / s) in [-127, 127]. Every value is within s/2 (half a quantization step) of its
    decoded q * s; an all-zero block has s = 0 and decodes to exact zeros."""

    name = "int8"
    payload_dtype = np.dtype("i1")
    alignment = BLOCK
    finite_output = True  # |q| <= 128 and scales <= SCALE_MAX: |value| <= FLT_MAX

    def side_layout(self, n: int) -> list[TensorSpec]:
        return [TensorSpec("scales", np.dtype("<f4"), (-(-n // BLOCK),))]

    def _check_side_values(self, side: Mapping[str, np.ndarray]) -> None:
        scales = side["scales"]
        # One min and one max cover NaN (comparisons with NaN are False), Inf, < 0 and too large.
        if scales.size and not (scales.min() >= 0 and scales.max() <= SCALE_MAX):
            bad = np.flatnonzero(~((scales >= 0) & (scales <= SCALE_MAX)))
            raise _bad(f"codec 'int8': scales must be finite, >= 0 and <= {float(SCALE_MAX):.4g}; "
                       f"{bad.size} are not (first: block {bad[0]} = {scales[bad[0]]!r})")

    def _encode_slice(self, x: np.ndarray, out: dict[str, np.ndarray], start: int, scratch: np.ndarray) -> None:
        size, first = x.size, start // BLOCK
        full = size - size % BLOCK  # only the vector's last slice can end mid-block
        scales, payload = out["scales"][first:], out["payload"][start:start + size]
        if full:
            _quantize_blocks(x[:full].reshape(-1, BLOCK), payload[:full].reshape(-1, BLOCK),
                             scales[:full // BLOCK], scratch[:full].reshape(-1, BLOCK), start)
        if full < size:  # the last, short block: same code with a (1, size - full) view
            tail = full // BLOCK
            _quantize_blocks(x[full:].reshape(1, -1), payload[full:].reshape(1, -1), scales[tail:tail + 1],
                             scratch[:size - full].reshape(1, -1), start + full)

    def _decode_range(self, side: Mapping[str, np.ndarray], piece: np.ndarray, start: int,
                      out: np.ndarray) -> None:
        scales = side["scales"]
        first, size = start // BLOCK, piece.size
        if first + -(-size // BLOCK) > scales.size:
            raise _bad(f"codec 'int8': payload range [{start}, {start + size}) is beyond the "
                       f"{scales.size} blocks the scales cover")
        for lo in range(0, size, _WORK):  # cache-sized slices; only the last can end mid-block
            hi = min(lo + _WORK, size)
            np.copyto(out[lo:hi], piece[lo:hi], casting="unsafe")  # int8 -> float32, exact
            full = hi - (hi - lo) % BLOCK
            view = out[lo:full].reshape(-1, BLOCK)  # (blocks, 256)
            np.multiply(view, scales[first + lo // BLOCK:first + full // BLOCK, None], out=view)
            if full < hi:
                tail = out[full:hi]
                np.multiply(tail, scales[first + full // BLOCK], out=tail)


def _quantize_blocks(x: np.ndarray, q: np.ndarray, scales: np.ndarray, scratch: np.ndarray, offset: int) -> None:
    """Quantize x (blocks, width) into q (blocks, width) int8 and scales (blocks,).

    ``offset`` is x's first element's index in the whole vector, for error messages.
    """
    np.abs(x, out=scratch)
    absmax = scratch.max(axis=1)  # (blocks,); NaN and Inf propagate
    # s = absmax/127 rounded up: the 2^-20 margin beats float rounding (2^-24), so |x| / s <= 127
    # and rint never reaches 128 (no clip pass). The step grows by a negligible 1e-6 relative.
    np.multiply(absmax, _INV127_UP, out=scales)
    if not scales.max() <= SCALE_MAX:  # False for NaN too
        _raise_out_of_range(x.reshape(-1), offset, "int8")
    # Multiply by 1/s rather than divide (twice as fast). 1/s is finite only for normal s, so the
    # divisor is floored at 2^-126: zero blocks get q = 0 and subnormal-scale blocks are redone.
    inverse = np.maximum(scales, _F32_NORMAL_MIN)
    np.divide(np.float32(1), inverse, out=inverse)
    np.multiply(x, inverse[:, None], out=scratch)
    np.rint(scratch, out=scratch)
    np.copyto(q, scratch, casting="unsafe")  # integers in [-127, 127]
    if scales.min() < _F32_NORMAL_MIN:
        tiny = np.flatnonzero((scales < _F32_NORMAL_MIN) & (absmax > 0))
        if tiny.size:  # 0 < absmax < 1.5e-36: subnormal (or zero) scales, rounded absolutely, not relatively
            s, top = scales[tiny], absmax[tiny]
            s = np.where(s * np.float32(127) < top, np.nextafter(s, np.float32(1)), s)
            scales[tiny] = s
            q[tiny] = np.clip(np.rint(x[tiny] / s[:, None]), -127, 127)  # exact division


def _check_within(x: np.ndarray, offset: int, limit: float, codec: str) -> None:
    """Raise ValueError unless every value of x is finite with |value| <= limit. One min and one
    max (cheap, in cache) decide; NaN fails both comparisons."""
    if x.size and not (-limit <= x.min() and x.max() <= limit):
        _raise_out_of_range(x, offset, codec)


_RANGES = {"none": "finite float32", "float16": "|x| < 65520, where float16 overflows; use codec 'int8' or 'none'",
           "int8": f"|x| <= {INT8_INPUT_MAX:.4g} = 127/128 of float32's max"}


def _raise_out_of_range(x: np.ndarray, offset: int, codec: str) -> NoReturn:
    """The error for a slice that failed a range check, naming the first offending value."""
    finite = np.isfinite(x)
    if not finite.all():
        i = int(np.flatnonzero(~finite)[0])
        raise ValueError(f"cannot encode: value {float(x[i]):.9g} at index {offset + i} is not finite "
                         "(lower the learning rate or check the loss scale; drop this gradient)")
    i = int(np.argmax(np.abs(x)))
    raise ValueError(f"cannot encode with codec {codec!r}: value {float(x[i]):.9g} at index {offset + i} "
                     f"is out of range ({_RANGES[codec]})")


CODECS: dict[str, type[Codec]] = {c.name: c for c in (NoneCodec, Float16Codec, Int8Codec)}


def get_codec(name: str) -> Codec:
    """A fresh codec by its run-config name: "none", "float16" or "int8"."""
    try:
        return CODECS[name]()
    except KeyError:
        raise ValueError(f"unknown compression codec {name!r}; choose one of {sorted(CODECS)}") from None


class ErrorFeedback:
    """Peer side of the upload: carries each step's quantization error into the next step.

    ``compress(x)`` encodes ``x + residual`` and keeps ``residual = (x + residual) - decoded``,
    so after T steps the relay has received ``sum(x_t) - residual_T``: the error of the whole
    stream stays within half a quantization step per value instead of growing with T (EF-SGD,
    Karimireddy et al. 2019). ``start`` lets one instance span the whole vector while each
    aggregator's slice ``[start, start + len(x))`` is encoded on its own (block alignment is then
    relative to the slice, so slices need not start on a multiple of 256).
    """

    def __init__(self, codec: Codec, n: int) -> None:
        self.codec = codec
        self.residual = np.zeros(n, dtype=np.float32)  # (n,): what was owed but not yet sent

    def compress(self, x: np.ndarray, start: int = 0, out: Tensors | None = None) -> Tensors:
        """Encode ``x`` (len(x),) plus the residual owed for ``[start, start + len(x))``; ``out``
        as in ``Codec.encode``. Raises ValueError for NaN/Inf and then forgets that range's debt."""
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 1 \
                or not 0 <= start <= self.residual.size - x.size:
            raise ValueError(f"x must be 1-D float32 within the {self.residual.size} values, "
                             f"got {_array_label(x)} at {start}")
        if self.codec.lossless:
            return self.codec.encode(x, out)  # nothing is ever owed
        residual = self.residual[start:start + x.size]
        tensors = self.codec._output(x.size, out)
        buffers = dict(tensors)
        side = {name: array for name, array in tensors[:-1]}
        scratch, decoded = (np.empty(min(_WORK, x.size), dtype=np.float32) for _ in range(2))
        try:
            for lo in range(0, x.size, _WORK):  # all four passes on one cache-sized slice
                owed = residual[lo:lo + _WORK]
                np.add(owed, x[lo:lo + owed.size], out=owed)  # the target x + residual
                self.codec._encode_slice(owed, buffers, lo, scratch)
                self.codec.decode_range(side, buffers["payload"][lo:lo + owed.size], lo, decoded[:owed.size])
                np.subtract(owed, decoded[:owed.size], out=owed)
        except ValueError:
            residual.fill(0.0)  # x + residual is unusable; drop the debt with the bad step
            raise
        return tensors

    def undo(self, tensors: Tensors, x: np.ndarray, start: int = 0) -> None:
        """The upload of ``tensors`` (from ``compress(x, start)``) never reached the relay and x
        goes back into the peer's accumulator: restore the residual to what it was before, so x
        is not owed twice (once in the accumulator, once in the residual)."""
        payload = tensors[-1][1]
        if payload.shape != x.shape or not 0 <= start <= self.residual.size - x.size:
            raise ValueError(f"undo needs the x (and start) that produced tensors of {payload.size} values")
        if self.codec.lossless:
            return
        residual = self.residual[start:start + x.size]
        side = {name: array for name, array in tensors[:-1]}
        for lo, decoded in _iter_decoded(self.codec, side, payload):
            owed = residual[lo:lo + decoded.size]
            np.add(owed, decoded, out=owed)
            np.subtract(owed, x[lo:lo + decoded.size], out=owed)

    def reset(self) -> None:
        """Forget the debt, e.g. after re-downloading parameters from a rolled-back relay."""
        self.residual.fill(0.0)


class DeltaEncoder:
    """Relay side of the download: parameters travel as quantized deltas against ``public``.

    ``public`` (n,) float32 is the copy every up-to-date peer holds, bit for bit. Each step sends
    ``encode(master - public)`` and adds exactly what peers will decode to ``public``, with the
    same ``apply_delta`` peers run. The error is re-measured against the master every step, so
    ``|master - public|`` stays within half a step of the latest delta's block (one step with
    float rounding) and never accumulates; after a big jump (a rollback) it shrinks ~127x per step.
    """

    def __init__(self, codec: Codec, public: np.ndarray) -> None:
        self.codec = codec
        self.public = np.array(public, dtype=np.float32, copy=True)  # (n,), what peers hold

    def encode_step(self, master: np.ndarray) -> Tensors:
        """Tensors of the delta that brings peers from ``public`` towards ``master`` (n,).
        The arrays are fresh each call, so they can be streamed while the next step runs."""
        if not isinstance(master, np.ndarray) or master.shape != self.public.shape:
            raise ValueError(f"master must have shape {self.public.shape}, got {_array_label(master)}")
        n = master.size
        tensors = self.codec._output(n, None)
        buffers = dict(tensors)
        delta, scratch = (np.empty(min(_WORK, n), dtype=np.float32) for _ in range(2))
        for lo in range(0, n, _WORK):  # encode every slice first: a bad value leaves public as is
            piece = delta[:min(_WORK, n - lo)]
            np.subtract(master[lo:lo + piece.size], self.public[lo:lo + piece.size], out=piece)
            self.codec._encode_slice(piece, buffers, lo, scratch)
        apply_delta(self.codec, self.public, tensors)
        return tensors


def apply_delta(codec: Codec, public: np.ndarray, tensors: Mapping[str, np.ndarray] | Tensors) -> None:
    """Add a decoded delta into ``public`` (n,) float32 in place: the peer's (and the relay's) side
    of ``DeltaEncoder``. Validates the tensors first. Streaming alternative with the same bits:
    ``np.add(public[a:b], codec.decode_range(side, piece, a), out=public[a:b])`` per piece."""
    tensors = dict(tensors)
    payload = tensors.pop("payload", None)
    if not isinstance(payload, np.ndarray) or payload.ndim != 1 or payload.size != public.size:
        raise _bad(f"delta payload must be a 1-D tensor of {public.size} values, got {_array_label(payload)}")
    if public.dtype != np.float32 or public.ndim != 1:
        raise ValueError(f"public must be a 1-D float32 array, got {_array_label(public)}")
    codec.validate(tensors, payload.dtype, payload.size)
    for lo, decoded in _iter_decoded(codec, tensors, payload):
        segment = public[lo:lo + decoded.size]
        np.add(segment, decoded, out=segment)


def _describe(specs: Sequence[tuple[str, np.dtype, tuple[int, ...]]]) -> str:
    return "[" + ", ".join(f"{name}:{np.dtype(dtype)}{list(shape)}" for name, dtype, shape in specs) + "]"


def _array_label(a: object) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.dtype} array of shape {a.shape}"
    return type(a).__name__
