"""How far two computations of one pipeline task may differ, and how far they do.

Two honest workers computing one task on the same inputs and the same version differ only by
float rounding: the order of a matmul's sums (another BLAS, another accelerator) and, under bf16
or fp16 autocast, the half-precision products. A boundary codec adds its own rounding on the way.
The tolerance is a relative L2 distance (``|a - b| / max(|a|, |b|)``) per precision, plus the
codec's, **measured, not guessed** (:mod:`.calibrate`; ``python benchmarks/trust.py --tolerance
1000``): every honest result lies within its rounding error ``e`` of the exact (fp64) one, so two
lie within ``2 e``; the table is :data:`~.calibrate.MARGIN` (4x) times the largest ``2 e``
measured over 1,000 checked results per precision, rounded up. Every attack stays far above it (a
1.3x scale is 0.23, noise at 10% of the norm 0.1, a sign flip 2.0). The largest distance seen
between agreeing results is reported next to it (``/api/pipeline``), so an organizer sees the
margin on the run's own hardware too.
"""

from __future__ import annotations

import numpy as np

from toolkit.wire import payloads
from toolkit.wire.compression import Codec

PRECISION_TOLERANCE = {"": 3e-3, "fp32": 3e-3, "fp16": 3e-3, "bf16": 3e-2}
"""Relative L2 distance two honest results of one task may have, by the run's pinned precision
("": the run pins none, and a stage computes in fp32). Measured (``benchmarks/trust.py
--tolerance 1000``, 1,000 checked results each, docs/benchmarks.md): the largest ``2 e`` was
5.4e-7 in fp32, 6.6e-4 in fp16 and 5.3e-3 in bf16, times 4 rounded up: 3e-6, 3e-3 and 3e-2. fp32 takes
fp16's: a GPU worker may run fp32 matmuls in TF32 (PyTorch's default for convolutions, one line
in a notebook for matmuls), whose 10-bit mantissa is fp16's, and it is honest."""
CODEC_TOLERANCE = {"none": 0.0, "float16": 2e-3, "int8": 3e-2}


def tolerance(precision: str, codec: str) -> float:
    return PRECISION_TOLERANCE.get(precision, PRECISION_TOLERANCE["bf16"]) + CODEC_TOLERANCE.get(codec, 3e-2)


def rows(entry: bytes, width: int, codec: Codec) -> np.ndarray:
    """A stored boundary entry (``v`` and its codec parts, :mod:`relay_server.pipeline.results`) as
    float32 rows."""
    _, tensors = payloads.decode(entry, len(entry))
    return payloads.read_rows(tensors, "v", None, width, codec)


def distance(a: np.ndarray, b: np.ndarray) -> float:
    """Relative L2 distance; 2.0 for a shape mismatch (a result of another task is as wrong as can be)."""
    if a.shape != b.shape:
        return 2.0
    a64, b64 = a.astype(np.float64, copy=False), b.astype(np.float64, copy=False)
    scale = max(float(np.linalg.norm(a64)), float(np.linalg.norm(b64)), 1e-30)
    return float(np.linalg.norm(a64 - b64)) / scale
