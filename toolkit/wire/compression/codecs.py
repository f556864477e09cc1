"""The three dense codecs -- "none", "float16" and "int8" (blockwise absmax): payload element i
encodes value i -- and their input ranges."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NoReturn

import numpy as np

from toolkit.wire.compression.base import _WORK, Codec, Tensors, TensorSpec, _array_label, _bad

# int8 block size. Each 256-value block carries one float32 absmax scale: 1 + 4/256 = 1.0156
# bytes/value = 0.254 x float32, inside the 0.26 budget. Smaller blocks track outliers more
# closely (an outlier only coarsens its own block's step) but cost more: 128 -> 0.258 x, 64 ->
# 0.266 x (over budget). float16 scales would allow 64-value blocks at 0.258 x, but float16 loses
# precision for scales below 6.1e-5 (blocks with absmax < 7.8e-3, common for gradients) and
# flushes them to zero below 6e-8; float32 scales cover every finite input. 256 also divides the
# relay's CHUNK_ELEMS (1 << 20), so every chunk it streams starts on a block boundary.
BLOCK = 256
_F32_MAX = float(np.finfo(np.float32).max)
_F32_NORMAL_MIN = np.float32(np.finfo(np.float32).tiny)  # 2^-126: 1/s is finite at and above it
# Largest legal int8 scale. FLT_MAX/128 is exact (a power of two), and keeps every decoded value
# finite even for a hostile payload byte of -128: 128 * SCALE_MAX == FLT_MAX. (127 x
# fl(FLT_MAX/127) already overflows to inf.) The price: inputs above 127/128 x FLT_MAX (3.376e38)
# are rejected, not quantized; a gradient there has diverged anyway.
SCALE_MAX = np.float32(_F32_MAX / 128)
_INV127_UP = np.float32(1 / 127 * (1 + 2**-20))  # see _quantize_blocks
INT8_INPUT_MAX = float(SCALE_MAX) / float(_INV127_UP)  # ~3.376e38
# float32 values at or above 65520 round to inf in float16 (65504 is float16's largest finite):
# the largest float32 below it is the largest input float16 can take.
_F16_MAX_INPUT = float(np.nextafter(np.float32(65520), np.float32(0)))


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
            _check_within(x[start : start + _WORK], start, _F32_MAX, self.name)
        return [("payload", x)]

    def encode_slice(self, x: np.ndarray, out: dict[str, np.ndarray], start: int, scratch: np.ndarray) -> None:
        _check_within(x, start, _F32_MAX, self.name)
        out["payload"][start : start + x.size] = x

    def _decode_range(self, side: Mapping[str, np.ndarray], piece: np.ndarray, start: int, out: np.ndarray) -> None:
        np.copyto(out, piece)


class Float16Codec(Codec):
    """IEEE half precision: 0.5 x float32, relative error <= 2^-11 for |x| >= 6.1e-5 and absolute
    error <= 2^-25 below (subnormals). Rejects |x| >= 65520, which would become inf."""

    name = "float16"
    payload_dtype = np.dtype("<f2")

    def encode_slice(self, x: np.ndarray, out: dict[str, np.ndarray], start: int, scratch: np.ndarray) -> None:
        _check_within(x, start, _F16_MAX_INPUT, self.name)
        np.copyto(out["payload"][start : start + x.size], x, casting="same_kind")

    def _decode_range(self, side: Mapping[str, np.ndarray], piece: np.ndarray, start: int, out: np.ndarray) -> None:
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
            raise _bad(
                f"codec 'int8': scales must be finite, >= 0 and <= {float(SCALE_MAX):.4g}; "
                f"{bad.size} are not (first: block {bad[0]} = {scales[bad[0]]!r})"
            )

    def encode_slice(self, x: np.ndarray, out: dict[str, np.ndarray], start: int, scratch: np.ndarray) -> None:
        size, first = x.size, start // BLOCK
        full = size - size % BLOCK  # only the vector's last slice can end mid-block
        scales, payload = out["scales"][first:], out["payload"][start : start + size]
        if full:
            _quantize_blocks(
                x[:full].reshape(-1, BLOCK),
                payload[:full].reshape(-1, BLOCK),
                scales[: full // BLOCK],
                scratch[:full].reshape(-1, BLOCK),
                start,
            )
        if full < size:  # the last, short block: same code with a (1, size - full) view
            tail = full // BLOCK
            _quantize_blocks(
                x[full:].reshape(1, -1),
                payload[full:].reshape(1, -1),
                scales[tail : tail + 1],
                scratch[: size - full].reshape(1, -1),
                start + full,
            )

    def _decode_range(self, side: Mapping[str, np.ndarray], piece: np.ndarray, start: int, out: np.ndarray) -> None:
        scales = side["scales"]
        first, size = start // BLOCK, piece.size
        if first + -(-size // BLOCK) > scales.size:
            raise _bad(
                f"codec 'int8': payload range [{start}, {start + size}) is beyond the "
                f"{scales.size} blocks the scales cover"
            )
        for lo in range(0, size, _WORK):  # cache-sized slices; only the last can end mid-block
            hi = min(lo + _WORK, size)
            np.copyto(out[lo:hi], piece[lo:hi], casting="unsafe")  # int8 -> float32, exact
            full = hi - (hi - lo) % BLOCK
            view = out[lo:full].reshape(-1, BLOCK)  # (blocks, 256)
            np.multiply(view, scales[first + lo // BLOCK : first + full // BLOCK, None], out=view)
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


_RANGES = {
    "none": "finite float32",
    "float16": "|x| < 65520, where float16 overflows; use codec 'int8' or 'none'",
    "int8": f"|x| <= {INT8_INPUT_MAX:.4g} = 127/128 of float32's max",
    "topk2": "|x| <= 1.5 * 2^100 = 1.9e30, so that sums of decoded uploads stay finite",
}


def _raise_out_of_range(x: np.ndarray, offset: int, codec: str) -> NoReturn:
    """The error for a slice that failed a range check, naming the first offending value."""
    finite = np.isfinite(x)
    if not finite.all():
        i = int(np.flatnonzero(~finite)[0])
        raise ValueError(
            f"cannot encode: value {float(x[i]):.9g} at index {offset + i} is not finite "
            "(lower the learning rate or check the loss scale; drop this gradient)"
        )
    i = int(np.argmax(np.abs(x)))
    raise ValueError(
        f"cannot encode with codec {codec!r}: value {float(x[i]):.9g} at index {offset + i} "
        f"is out of range ({_RANGES[codec]})"
    )


CODECS: dict[str, type[Codec]] = {c.name: c for c in (NoneCodec, Float16Codec, Int8Codec)}
"""The dense codecs by name (``topk2-<K>`` is a family: :func:`~.registry.get_codec` parses it)."""
