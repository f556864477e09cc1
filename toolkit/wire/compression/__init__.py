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
(relay -> peer parameters as deltas against the copy every peer holds). The package never imports
torch, so the relay's reduction path and the codec stay light.

Import from here (``from toolkit.wire.compression import get_codec``); the modules, lowest first:

    base      Codec (the contract: layout, validation, chunked encode / decode_range), TensorSpec
    codecs    NoneCodec, Float16Codec, Int8Codec, their input ranges, CODECS and get_codec
    feedback  ErrorFeedback, DeltaEncoder, apply_delta
"""

from __future__ import annotations

from toolkit.wire.compression.base import Codec, Tensors, TensorSpec
from toolkit.wire.compression.codecs import (
    BLOCK,
    CODECS,
    INT8_INPUT_MAX,
    SCALE_MAX,
    Float16Codec,
    Int8Codec,
    NoneCodec,
    get_codec,
)
from toolkit.wire.compression.feedback import DeltaEncoder, ErrorFeedback, apply_delta

__all__ = [
    "Codec", "Tensors", "TensorSpec",
    "BLOCK", "CODECS", "INT8_INPUT_MAX", "SCALE_MAX", "NoneCodec", "Float16Codec", "Int8Codec", "get_codec",
    "ErrorFeedback", "DeltaEncoder", "apply_delta",
]
