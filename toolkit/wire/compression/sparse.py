"""``topk2-<K>``: per 4096-value chunk, the K largest |x| as (position, 2-bit code) pairs and one
float32 scale: a sparse low-bit codec for gradients (with ``ErrorFeedback``) and parameter deltas
(with ``DeltaEncoder``), after SparseLoCo's top-k-per-chunk with 2-bit values.

Wire layout for n values, C = 4096, chunks = ceil(n / C):

    scales   F32 (chunks,)     s = absmax of the chunk / 1.5 (0 for an all-zero chunk)
    payload  U8  (payload_size(n),)   one record per chunk, in order

A chunk of L values (L = C except the vector's last, L = n - C * (chunks - 1)) keeps k = min(K, L)
values. Its record is ``2k + ceil(k / 4)`` bytes: k positions within the chunk (uint16, little
endian, strictly increasing, < L), then k 2-bit codes packed four to a byte, entry j in bits
``2 * (j % 4)`` of byte ``j // 4``, the unused high bits of a last, partial byte zero. Entry j
decodes to ``(code_j - 1.5) * s`` at position ``pos_j``; every other value of the chunk is 0.
Records of whole chunks have one size, 9K/4 bytes, so the values ``[start, start + count)``
(``start`` a multiple of C) are a computable byte range of the payload and the relay decodes any
chunk-aligned range while the upload streams. Each received vector has one canonical encoding:
a duplicate, unsorted or out-of-range position, or a set padding bit, is refused, naming the chunk.

Levels: the four codes are ``{-1.5, -0.5, 0.5, 1.5} * s``. The decoder needs nothing more; the
encoder picks s. ``s = absmax / 1.5`` would put every kept value within s/2 (half a step) of its
code, but the kept values are a chunk's largest, bunched in magnitude between the K-th largest
and the largest (for Gaussian data 2.4 and 3.7 sigma at K = 64), so the inner levels +-absmax/3
sit below all of them: 13% relative squared error on the kept values. The encoder starts there
and runs FIT_ROUNDS Lloyd iterations (the least-squares s for the current codes, then the
nearest codes for that s), which never increase the squared error: 2% on the same data. Every
kept value is then within s/2 of its code unless it lies beyond the outer level (|x| > 1.5 s),
where it takes the outer code. Error feedback owes the rest (the dropped values entirely) to the
next step.
Bits per value: (K * 18 + 32) / 4096, 0.289 for K = 64 (float32 is 32).

Finite output, proven: a validated scale is finite, >= 0 and <= TOPK2_SCALE_MAX = 2^100, so
every decoded value is 0 or a level times a scale (one rounding), |value| <= 1.5 * 2^100: finite
whatever the payload bytes, so the relay skips its NaN/Inf scan for this codec; and a relay's
float32 sum of up to 2^26 such uploads stays below FLT_MAX (~2^128), so hostile but valid
scales cannot overflow the round's sum either. The price: |x| above 1.5 * 2^100 (1.9e30) is
refused at encode; a gradient or parameter delta there has diverged anyway.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from toolkit.wire.compression.base import _WORK, Codec, TensorSpec, _bad
from toolkit.wire.compression.codecs import _raise_out_of_range

CHUNK = 4096  # values per chunk: positions fit uint16, and it divides _WORK and the relay's 1 << 20
K_MIN, K_MAX = 4, 2048  # K: a multiple of 4 (whole code bytes); above C / 2 dense int8 is smaller
NAME = re.compile(r"topk2-([0-9]+)")
_LEVELS = np.array([-1.5, -0.5, 0.5, 1.5], dtype=np.float32)
TOPK2_SCALE_MAX = np.float32(2.0**100)  # see the module docstring: decoded sums stay finite
TOPK2_INPUT_MAX = float(TOPK2_SCALE_MAX) * 1.5  # the largest |x| whose scale stays <= TOPK2_SCALE_MAX
_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)
FIT_ROUNDS = 2  # Lloyd iterations of the scale: the kept values' squared error 13% -> 2% (Gaussian, K = 64)
assert _WORK % CHUNK == 0 and (1 << 20) % CHUNK == 0


def topk2_keep(name: str) -> int | None:
    """K of a ``topk2-<K>`` name, None when ``name`` is not of that form; ValueError (one line)
    when it is but K is not a multiple of 4 in [4, 2048]."""
    match = NAME.fullmatch(name)
    if match is None:
        return None
    k = int(match.group(1))
    if not (K_MIN <= k <= K_MAX and k % 4 == 0):
        raise ValueError(
            f"compression codec {name!r}: K (values kept per {CHUNK}) must be a multiple of 4 "
            f"from {K_MIN} to {K_MAX}, e.g. 'topk2-64'"
        )
    return k


class TopK2Codec(Codec):
    """Top-K of each 4096-value chunk with 2-bit values (see the module docstring)."""

    payload_dtype = np.dtype("u1")
    alignment = CHUNK
    finite_output = True  # |level| <= 1.5 and scales <= 2^100: |value| <= 1.5 * 2^100

    def __init__(self, k: int) -> None:
        if not (K_MIN <= k <= K_MAX and k % 4 == 0):
            raise ValueError(f"topk2 keeps a multiple of 4 from {K_MIN} to {K_MAX} values per chunk, got {k}")
        self.k = k
        self.name = f"topk2-{k}"  # type: ignore[misc]  # Codec.name is a ClassVar; topk2 is one class, a name per K

    def _kept(self, length: int) -> int:
        return min(self.k, length)

    def _record(self, length: int) -> int:
        """Bytes of the record of a chunk of ``length`` values (0 for none)."""
        k = self._kept(length)
        return 2 * k + -(-k // 4)

    def payload_size(self, n: int) -> int:
        full, tail = divmod(n, CHUNK)
        return full * self._record(CHUNK) + self._record(tail)

    def side_layout(self, n: int) -> list[TensorSpec]:
        return [TensorSpec("scales", np.dtype("<f4"), (-(-n // CHUNK),))]

    def _check_side_values(self, side: Mapping[str, np.ndarray]) -> None:
        scales = side["scales"]
        if scales.size and not (scales.min() >= 0 and scales.max() <= TOPK2_SCALE_MAX):  # False for NaN
            bad = np.flatnonzero(~((scales >= 0) & (scales <= TOPK2_SCALE_MAX)))
            raise _bad(
                f"codec {self.name!r}: scales must be finite, >= 0 and <= 2^100; "
                f"{bad.size} are not (first: chunk {bad[0]} = {scales[bad[0]]!r})"
            )

    # --- encode ---------------------------------------------------------------------------------
    def encode_slice(self, x: np.ndarray, out: dict[str, np.ndarray], start: int, scratch: np.ndarray) -> None:
        size, first = x.size, start // CHUNK
        full = size - size % CHUNK  # only the vector's last slice can end mid-chunk
        a, b = self.payload_range(start, size)
        payload, scales = out["payload"][a:b], out["scales"][first:]
        whole = self.payload_size(full)
        if full:
            self._encode_chunks(
                x[:full].reshape(-1, CHUNK),
                payload[:whole].reshape(full // CHUNK, -1),
                scales[: full // CHUNK],
                scratch[:full].reshape(-1, CHUNK),
                start,
            )
        if full < size:
            self._encode_chunks(
                x[full:].reshape(1, -1),
                payload[whole:].reshape(1, -1),
                scales[full // CHUNK : full // CHUNK + 1],
                scratch[: size - full].reshape(1, -1),
                start + full,
            )

    def _encode_chunks(
        self, x: np.ndarray, records: np.ndarray, scales: np.ndarray, scratch: np.ndarray, offset: int
    ) -> None:
        """Encode x (chunks, L) into records (chunks, record bytes) and scales (chunks,)."""
        length = x.shape[1]
        k = self._kept(length)
        magnitude = np.abs(x, out=scratch)
        absmax = magnitude.max(axis=1)  # NaN and Inf propagate
        if not absmax.max() <= TOPK2_INPUT_MAX:
            _raise_out_of_range(x.reshape(-1), offset, "topk2")
        if k < length:
            positions = np.argpartition(magnitude, length - k, axis=1)[:, length - k :]
            positions.sort(axis=1)  # canonical: strictly increasing
        else:
            positions = np.broadcast_to(np.arange(length), x.shape)
        values = np.take_along_axis(x, positions, axis=1)  # (chunks, k)
        np.divide(absmax, np.float32(1.5), out=scales)  # the start: every kept value within s/2
        codes = _nearest_codes(values, scales)
        for _ in range(FIT_ROUNDS):  # Lloyd: the least-squares scale for these codes, then the nearest codes
            levels = _LEVELS[codes]  # the sums in float64: no underflow for subnormal values
            fit = np.einsum("ij,ij->i", values, levels, dtype=np.float64)  # >= 0: codes carry x's sign
            fit /= np.einsum("ij,ij->i", levels, levels, dtype=np.float64)
            np.copyto(scales, np.minimum(fit, TOPK2_SCALE_MAX), casting="same_kind")
            codes = _nearest_codes(values, scales)
        records[:, : 2 * k] = positions.astype("<u2").view(np.uint8).reshape(len(x), 2 * k)
        records[:, 2 * k :] = _pack(codes)

    # --- decode ---------------------------------------------------------------------------------
    def _decode_range(self, side: Mapping[str, np.ndarray], piece: np.ndarray, start: int, out: np.ndarray) -> None:
        scales = side["scales"]
        first, count = start // CHUNK, out.size
        chunks = -(-count // CHUNK)
        if first + chunks > scales.size or (count % CHUNK and first + chunks != scales.size):
            raise _bad(
                f"codec {self.name!r}: values [{start}, {start + count}) are not whole chunks of the "
                f"{scales.size} the scales cover"
            )
        full = count - count % CHUNK
        whole = self.payload_size(full)
        if full:
            self._decode_chunks(
                piece[:whole].reshape(full // CHUNK, -1),
                scales[first : first + full // CHUNK],
                out[:full].reshape(-1, CHUNK),
                first,
            )
        if full < count:
            self._decode_chunks(
                piece[whole:].reshape(1, -1),
                scales[first + full // CHUNK :][:1],
                out[full:].reshape(1, -1),
                first + full // CHUNK,
            )

    def check_payload(self, side: Mapping[str, np.ndarray], payload: np.ndarray, n: int) -> None:
        full = n - n % CHUNK
        whole = self.payload_size(full)
        if full:
            self._check_records(payload[:whole].reshape(full // CHUNK, -1), CHUNK, 0)
        if full < n:
            self._check_records(payload[whole:].reshape(1, -1), n - full, full // CHUNK)

    def _decode_chunks(self, records: np.ndarray, scales: np.ndarray, out: np.ndarray, first: int) -> None:
        """Check and decode records (chunks, record bytes) into out (chunks, L); ``first`` is the
        index of the first chunk in the vector, for error messages."""
        positions = self._check_records(records, out.shape[1], first)
        k = positions.shape[1]
        codes = ((records[:, 2 * k :, None] >> _SHIFTS) & np.uint8(3)).reshape(len(records), -1)[:, :k]
        out.fill(0.0)
        np.put_along_axis(out, positions.astype(np.intp), _LEVELS[codes] * scales[:, None], axis=1)

    def _check_records(self, records: np.ndarray, length: int, first: int) -> np.ndarray:
        """The positions (chunks, k) of untrusted records (chunks, bytes) of chunks of ``length`` values,
        refused (``bad_tensor``, naming the chunk) unless positions are strictly increasing and
        < length and no padding bit is set."""
        k = self._kept(length)
        positions = np.ascontiguousarray(records[:, : 2 * k]).view("<u2")  # (chunks, k)
        ordered = (positions[:, 1:] > positions[:, :-1]).all(axis=1) if k > 1 else np.ones(len(records), bool)
        ok = ordered & (positions[:, -1] < length)
        packed = records[:, 2 * k :]
        if k % 4:
            ok &= (packed[:, -1] >> np.uint8(2 * (k % 4))) == 0
        if not ok.all():
            c = int(np.flatnonzero(~ok)[0])
            raise _bad(
                f"codec {self.name!r}: chunk {first + c} is not canonical: its {k} positions must be "
                f"strictly increasing and < {length}, unused code bits zero (got positions "
                f"{positions[c, :8].tolist()}{'...' if k > 8 else ''})"
            )
        return positions


def _nearest_codes(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The code (0..3) of the level ``(code - 1.5) * s`` nearest each value (chunks, k); a
    chunk with s = 0 (all zero) gets code 2, which decodes to 0."""
    q = np.zeros_like(values)
    np.divide(values, scales[:, None], out=q, where=scales[:, None] > 0)
    q += np.float32(1.5)
    np.rint(q, out=q)
    return np.clip(q, 0, 3).astype(np.uint8)


def _pack(codes: np.ndarray) -> np.ndarray:
    """(chunks, k) 2-bit codes -> (chunks, ceil(k / 4)) bytes, entry j in bits 2 * (j % 4)."""
    rows, k = codes.shape
    padded = np.zeros((rows, -(-k // 4) * 4), dtype=np.uint8)
    padded[:, :k] = codes
    quads = padded.reshape(rows, -1, 4)
    return quads[:, :, 0] | (quads[:, :, 1] << 2) | (quads[:, :, 2] << 4) | (quads[:, :, 3] << 6)
