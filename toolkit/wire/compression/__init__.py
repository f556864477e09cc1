"""Compression codecs for both directions of the wire (DESIGN.md s6), numpy only.

A run picks one codec by name (``get_codec("int8")``); peers and relay build the same one. A codec
turns a float32 vector (n,) into named tensors **in wire order**: small side tensors first, then
exactly one big ``"payload"`` of ``payload_size(n)`` elements. That order is what lets the relay
reduce a 100 MB gradient chunk by chunk while it is still arriving: it reads the side tensors
whole, validates them once, then decodes each chunk of values the moment its payload bytes are in
(``decode_range``: a value range starting on the codec's ``alignment``, whose payload elements
``payload_range`` computes from sizes alone), and the peer streams the tensors straight from
their buffers. Dense codecs (``payload_size(n) == n``: element i encodes value i) are the only
ones that carry row matrices (pipeline boundaries, DMoE activations).

Wire layouts for n values (``Codec.layout(n)``; dtypes as safetensors codes):

    none     payload F32 (n,)                        4 bytes/value, exact
    float16  payload F16 (n,)                        2 bytes/value, |x| < 65520
    int8     scales  F32 (ceil(n/256),)              1 + 4/256 bytes/value = 0.254 x float32
             payload I8  (n,)   value i = payload[i] * scales[i // 256]
    topk2-K  scales  F32 (ceil(n/4096),)             (18 K + 32) / 4096 bits/value (0.29 for K = 64)
             payload U8  (one 9K/4-byte record per 4096 values: K uint16 positions, K 2-bit codes)

Pipeline boundaries only, a matrix [rows, width] (not a vector: ``lowrank.LowRankCodec``):

    lowrank-r  s F32 (r,), p I8 (rows, r), q I8 (width, r)     r (rows + width) + 4 r bytes

Two helpers carry the quantization error across steps so it never accumulates:
``ErrorFeedback`` (peer -> relay gradient sums) and ``DeltaEncoder`` / ``apply_delta``
(relay -> peer parameters as deltas against the copy every peer holds). The package never imports
torch, so the relay's reduction path and the codec stay light.

Import from here (``from toolkit.wire.compression import get_codec``); the modules, lowest first:

    base      Codec (the contract: layout, validation, chunked encode / decode_range), TensorSpec
    codecs    NoneCodec, Float16Codec, Int8Codec (the dense codecs), their input ranges, CODECS
    sparse    TopK2Codec ("topk2-<K>": top-K per 4096-value chunk, 2-bit values)
    lowrank   LowRankCodec ("lowrank-<r>": a boundary matrix as rank-r factors; matrices only)
    registry  get_codec (by run-config name), boundary_codec ([pipeline] boundary_codec), codec_error, CHOICES
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
)
from toolkit.wire.compression.feedback import DeltaEncoder, ErrorFeedback, apply_delta
from toolkit.wire.compression.lowrank import LowRankCodec
from toolkit.wire.compression.registry import (
    BOUNDARY_CHOICES,
    CHOICES,
    DENSE_CHOICES,
    RunCodecs,
    boundary_codec,
    codec_error,
    get_codec,
    run_codecs,
)
from toolkit.wire.compression.sparse import CHUNK, TOPK2_INPUT_MAX, TOPK2_SCALE_MAX, TopK2Codec

__all__ = [
    "Codec",
    "Tensors",
    "TensorSpec",
    "BLOCK",
    "CODECS",
    "INT8_INPUT_MAX",
    "SCALE_MAX",
    "NoneCodec",
    "Float16Codec",
    "Int8Codec",
    "CHUNK",
    "TOPK2_INPUT_MAX",
    "TOPK2_SCALE_MAX",
    "TopK2Codec",
    "CHOICES",
    "BOUNDARY_CHOICES",
    "LowRankCodec",
    "boundary_codec",
    "DENSE_CHOICES",
    "RunCodecs",
    "codec_error",
    "get_codec",
    "run_codecs",
    "ErrorFeedback",
    "DeltaEncoder",
    "apply_delta",
]
