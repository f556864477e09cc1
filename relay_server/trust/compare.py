"""How far two computations of one pipeline task may differ, and how far they do.

Two honest workers computing one task on the same inputs and the same version differ only by
float rounding: the order of a matmul's sums (another BLAS, another thread count, another
accelerator) and, under bf16 or fp16 autocast, the half-precision products. A boundary codec
adds its own rounding on the way. The tolerance is a relative L2 distance (``|a - b| / max(|a|,
|b|)``) per precision, plus the codec's: far below what a deliberate change of a result costs
(a 1.3x scale is 0.23, noise at 10% of the norm 0.1, a sign flip 2.0), far above rounding
(fp32 on the same CPU: 0 to 1e-6; bf16 autocast against fp32: about 1e-2 over a few blocks).
The largest distance seen between agreeing results is reported next to it (``/api/pipeline``),
so an organizer sees the margin measured, not only the guess.
"""

from __future__ import annotations

import numpy as np

from toolkit.wire import payloads
from toolkit.wire.compression import Codec

PRECISION_TOLERANCE = {"": 1e-3, "fp32": 1e-3, "fp16": 2e-2, "bf16": 6e-2}
"""Relative L2 distance two honest results of one task may have, by the run's pinned precision
("": the run pins none, and a stage computes in fp32)."""
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
