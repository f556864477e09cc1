"""Quantization error carried across steps so it never accumulates: ``ErrorFeedback`` (peer ->
relay gradient sums) and ``DeltaEncoder`` / ``apply_delta`` (relay -> peer parameters as deltas
against the copy every peer holds). Each fuses its own passes with the codec's slice encoding
while a slice is still in cache."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from toolkit.wire.compression.base import _WORK, Codec, Tensors, _array_label, _bad, _iter_decoded


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
        if (
            not isinstance(x, np.ndarray)
            or x.dtype != np.float32
            or x.ndim != 1
            or not 0 <= start <= self.residual.size - x.size
        ):
            raise ValueError(
                f"x must be 1-D float32 within the {self.residual.size} values, got {_array_label(x)} at {start}"
            )
        if self.codec.lossless:
            return self.codec.encode(x, out)  # nothing is ever owed
        residual = self.residual[start : start + x.size]
        tensors = self.codec.output_tensors(x.size, out)
        buffers = dict(tensors)
        side = {name: array for name, array in tensors[:-1]}
        scratch, decoded = (np.empty(min(_WORK, x.size), dtype=np.float32) for _ in range(2))
        try:
            for lo in range(0, x.size, _WORK):  # all four passes on one cache-sized slice
                owed = residual[lo : lo + _WORK]
                np.add(owed, x[lo : lo + owed.size], out=owed)  # the target x + residual
                self.codec.encode_slice(owed, buffers, lo, scratch)
                a, b = self.codec.payload_range(lo, owed.size)
                self.codec.decode_range(side, buffers["payload"][a:b], lo, decoded[: owed.size])
                np.subtract(owed, decoded[: owed.size], out=owed)
        except ValueError:
            residual.fill(0.0)  # x + residual is unusable; drop the debt with the bad step
            raise
        return tensors

    def undo(self, tensors: Tensors, x: np.ndarray, start: int = 0) -> None:
        """The upload of ``tensors`` (from ``compress(x, start)``) never reached the relay and x
        goes back into the peer's accumulator: restore the residual to what it was before, so x
        is not owed twice (once in the accumulator, once in the residual)."""
        payload = tensors[-1][1]
        if payload.shape != (self.codec.payload_size(x.size),) or not 0 <= start <= self.residual.size - x.size:
            raise ValueError(f"undo needs the x (and start) that produced tensors of {payload.size} payload elements")
        if self.codec.lossless:
            return
        residual = self.residual[start : start + x.size]
        side = {name: array for name, array in tensors[:-1]}
        for lo, decoded in _iter_decoded(self.codec, side, payload, x.size):
            owed = residual[lo : lo + decoded.size]
            np.add(owed, decoded, out=owed)
            np.subtract(owed, x[lo : lo + decoded.size], out=owed)

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
    A sparse codec (topk2) sends each chunk's K largest gaps per step: the gaps it leaves are
    carried the same way and go out in later steps, so ``public`` converges to a master that
    stops moving instead of tracking it within one step.
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
        tensors = self.codec.output_tensors(n, None)
        buffers = dict(tensors)
        delta, scratch = (np.empty(min(_WORK, n), dtype=np.float32) for _ in range(2))
        for lo in range(0, n, _WORK):  # encode every slice first: a bad value leaves public as is
            piece = delta[: min(_WORK, n - lo)]
            np.subtract(master[lo : lo + piece.size], self.public[lo : lo + piece.size], out=piece)
            self.codec.encode_slice(piece, buffers, lo, scratch)
        apply_delta(self.codec, self.public, tensors)
        return tensors


def apply_delta(codec: Codec, public: np.ndarray, tensors: Mapping[str, np.ndarray] | Tensors) -> None:
    """Add a decoded delta into ``public`` (n,) float32 in place: the peer's (and the relay's) side
    of ``DeltaEncoder``. Validates the tensors (the payload's content too) before changing ``public``.
    Streaming alternative with the same bits, per aligned value range ``[lo, hi)``:
    ``np.add(public[lo:hi], codec.decode_range(side, payload[a:b], lo, count=hi - lo), out=public[lo:hi])``
    with ``a, b = codec.payload_range(lo, hi - lo)``."""
    tensors = dict(tensors)
    payload = tensors.pop("payload", None)
    if public.dtype != np.float32 or public.ndim != 1:
        raise ValueError(f"public must be a 1-D float32 array, got {_array_label(public)}")
    size = codec.payload_size(public.size)
    if not isinstance(payload, np.ndarray) or payload.ndim != 1 or payload.size != size:
        raise _bad(
            f"delta payload for {public.size} values must be a 1-D tensor of {size} elements, "
            f"got {_array_label(payload)}"
        )
    codec.validate(tensors, payload.dtype, public.size)
    codec.check_payload(tensors, payload, public.size)  # refused whole: public stays as it was
    for lo, decoded in _iter_decoded(codec, tensors, payload, public.size):
        segment = public[lo : lo + decoded.size]
        np.add(segment, decoded, out=segment)
