"""``lowrank-<r>``: a pipeline boundary matrix as its best rank-``r`` approximation, for links where
the boundaries dominate (the adaptive low-rank class of boundary compressors, PowerSGD's
factorization applied to activations and their gradients).

A boundary of a micro-batch is a matrix ``X`` [rows, width] (rows = samples x tokens). It travels
as three tensors, ``r = min(rank, rows, width)``:

    s  F32 (r,)            each component's scale: its singular value times the two columns' steps
    p  I8  (rows, r)       left singular vectors, each column scaled to [-127, 127]
    q  I8  (width, r)      right singular vectors, the same

and decodes to ``(p * s) @ q.T`` in float32: ``r (rows + width) + 4 r`` bytes instead of
``2 rows width`` in float16 (rows 1024, width 256, r 32: 12.8x fewer). The basis adapts to every
payload (it is the matrix's own), so nothing is learned, stored or synchronised between
micro-batches, and any worker can decode any boundary. Each singular vector is quantized to int8
against its own largest entry (about 1% of its norm lost, far below what the truncation to rank
``r`` loses), so at equal bytes the rank is twice float16 factors'; the scale travels in float32,
so a gradient of 1e-8 keeps its precision as an activation of 10 does.

**How it is computed.** A randomized range finder (Halko, Martinsson and Tropp 2011): ``X``
times a fixed Gaussian test matrix of ``r + 8`` columns (seeded by its shape, so the same on
every machine), one power iteration (re-orthonormalised), then the exact SVD of the small
projected matrix. Cost: a few ``rows x width x (r + 8)`` matmuls, far below the stage's own
compute. Deterministic: the same ``X`` gives the same bytes in every process with the same BLAS,
so a pipeline run equals a one-process run with the same compress/decompress applied at each cut
(:func:`toolkit.pipeline.boundary_codec.through_cuts`) up to the rounding any pipeline has, which
an int8 step can amplify now and then (a K = 2 run: within 1e-4 of it after 5 steps). Not continuous where the ``r``-th and
``r + 1``-th singular values are close (the kept subspace can turn): two workers computing one
task in a slightly different float order may then send visibly different boundaries, which is
why spot checks (``pipeline.check_share``) refuse this codec.

**Why no error feedback.** Error feedback carries one message's compression error into the next
message of the *same* quantity (a gradient sum, step after step). A boundary is one micro-batch's
activation, used once; adding its residual to another micro-batch's samples would move other
samples' activations, and would make a boundary depend on which worker computed what before.

**Validation** (:meth:`LowRankCodec.read_matrix`): names, dtypes and shapes exactly as above for
the expected rows and the run's width, ``s`` finite, non-negative and at most :data:`SIGMA_MAX`
(every int8 byte is a valid factor entry); the decoded matrix is then checked finite by the
caller (:func:`toolkit.wire.payloads.read_rows`) all the same.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NoReturn

import numpy as np

from toolkit.wire.compression.base import Codec, Tensors, _array_label, _bad

NAME = re.compile(r"lowrank-([0-9]{1,4})")
RANK_MIN, RANK_MAX = 1, 1024
OVERSAMPLE = 8
"""Extra test vectors of the range finder: the kept ``r`` directions come out of ``r + 8``."""
POWER_ITERATIONS = 1
SIGMA_MAX = 1e30
"""Largest component scale accepted (an honest boundary's is below 1e10): with int8 factors a
decoded value is at most 128 x 128 x r x 1e30 < 2e37, always finite in float32."""
PARTS = ("s", "p", "q")
_LEVELS = 127.0


def lowrank_rank(name: str) -> int | None:
    """``r`` of a ``lowrank-<r>`` name, None when ``name`` is not of that form; ValueError (one
    line) when it is but ``r`` is outside 1..1024."""
    match = NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        return None
    rank = int(match.group(1))
    if not RANK_MIN <= rank <= RANK_MAX:
        raise ValueError(f"boundary codec {name!r}: the rank must be {RANK_MIN}..{RANK_MAX}, e.g. 'lowrank-32'")
    return rank


class LowRankCodec(Codec):
    """Rank-``r`` factors of a matrix; it carries matrices only (pipeline boundaries), never a
    flat vector: a vector has no rows and columns to factor."""

    name = "lowrank"
    payload_dtype = np.dtype("i1")

    def __init__(self, rank: int) -> None:
        if not RANK_MIN <= rank <= RANK_MAX:
            raise ValueError(f"lowrank rank must be {RANK_MIN}..{RANK_MAX}, got {rank}")
        self.rank = rank
        self.name = f"lowrank-{rank}"  # type: ignore[misc]  # Codec.name is a ClassVar; one class, a name per rank

    # --- sizes ----------------------------------------------------------------------------------
    def kept(self, rows: int, width: int) -> int:
        """The rank a [rows, width] matrix travels at."""
        return min(self.rank, rows, width)

    def matrix_bytes(self, rows: int, width: int) -> int:
        """Tensor bytes of one encoded [rows, width] matrix."""
        r = self.kept(rows, width)
        return 4 * r + r * (rows + width)

    def wire_bytes(self, n: int) -> int:
        """An upper bound on the tensor bytes of a matrix of ``n`` values, whatever its shape
        (``r (rows + width) <= 2 rows width`` since ``r <= min(rows, width)``): what a body limit
        needs, which knows the values but not the shape."""
        return 2 * n + 4 * self.rank

    # --- matrices -------------------------------------------------------------------------------
    def encode_matrix(self, x: np.ndarray) -> Tensors:
        """``[("s", ...), ("p", ...), ("q", ...)]`` for a finite float32 matrix [rows, width];
        ValueError for anything else (local data: the caller's bug, not the network's)."""
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2 or x.size == 0:
            raise ValueError(f"codec {self.name!r} encodes a non-empty 2-D float32 matrix, got {_array_label(x)}")
        if not np.isfinite(x).all():
            raise ValueError(f"codec {self.name!r}: the matrix holds NaN or Inf")
        u, s, v = self.factors(x)
        if not float(s[0] if s.size else 0.0) <= SIGMA_MAX:
            raise ValueError(f"codec {self.name!r}: the matrix's norm {float(s[0]):.3g} exceeds {SIGMA_MAX:g}")
        p, p_step = _quantize_columns(u)
        q, q_step = _quantize_columns(v)
        return [("s", (s * p_step * q_step).astype(np.float32)), ("p", p), ("q", q)]

    def factors(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(u [rows, r], s [r], v [width, r])``, float32, of the randomized SVD (module docstring)."""
        rows, width = x.shape
        r = self.kept(rows, width)
        k = min(r + OVERSAMPLE, rows, width)
        omega = np.random.default_rng([width, k]).standard_normal((width, k)).astype(np.float32)
        y = x @ omega
        for _ in range(POWER_ITERATIONS):
            basis, _ = np.linalg.qr(y)
            y = x @ (x.T @ basis)
        basis, _ = np.linalg.qr(y)  # [rows, k]: an orthonormal basis of X's dominant range
        ub, s, vt = np.linalg.svd(basis.T @ x, full_matrices=False)
        u = basis @ ub[:, :r]
        return u.astype(np.float32), s[:r].astype(np.float32), np.ascontiguousarray(vt[:r].T, dtype=np.float32)

    def read_matrix(self, parts: Mapping[str, np.ndarray], rows: int | None, width: int) -> np.ndarray:
        """The float32 [rows, width] matrix that received ``parts`` (``s``, ``p``, ``q``) encode,
        every part checked first (``ProtocolError`` ``bad_tensor``); ``rows`` None: any number of
        rows (the ``p`` factor's). Any parts that pass decode to finite values (:data:`SIGMA_MAX`);
        the caller checks them finite all the same."""
        if set(parts) != set(PARTS):
            raise _bad(f"codec {self.name!r} expects tensors {list(PARTS)}, got {sorted(parts)}")
        p, q, s = parts["p"], parts["q"], parts["s"]
        n_rows = p.shape[0] if isinstance(p, np.ndarray) and p.ndim == 2 else -1
        if n_rows < 1:
            raise _bad(f"codec {self.name!r}: factor 'p' must be a 2-D int8 matrix, got {_array_label(p)}")
        if rows is not None and n_rows != rows:
            raise _bad(f"codec {self.name!r}: factor 'p' must have {rows} rows, got {_array_label(p)}")
        r = self.kept(n_rows, width)
        for part, array, dtype, shape in (
            ("s", s, np.float32, (r,)),
            ("p", p, np.int8, (n_rows, r)),
            ("q", q, np.int8, (width, r)),
        ):
            if not isinstance(array, np.ndarray) or array.dtype != dtype or array.shape != shape:
                raise _bad(
                    f"codec {self.name!r}: {part!r} must be {np.dtype(dtype)} of shape {shape} for a "
                    f"[{n_rows}, {width}] matrix, got {_array_label(array)}"
                )
            if not np.isfinite(array).all():
                raise _bad(f"codec {self.name!r}: {part!r} holds NaN or Inf")
        if s.size and not (float(s.min()) >= 0.0 and float(s.max()) <= SIGMA_MAX):
            raise _bad(f"codec {self.name!r}: singular values must lie in [0, {SIGMA_MAX:g}]")
        return self.decode_factors(s, p, q)

    @staticmethod
    def decode_factors(s: np.ndarray, p: np.ndarray, q: np.ndarray) -> np.ndarray:
        """``(p * s) @ q.T`` in float32 (an overflow becomes Inf, which the receiver refuses)."""
        with np.errstate(over="ignore", invalid="ignore"):
            return np.ascontiguousarray((p.astype(np.float32) * s) @ q.astype(np.float32).T, dtype=np.float32)

    def round_trip(self, x: np.ndarray) -> np.ndarray:
        """What the receiver of ``x`` decodes (the one-process reference's cut)."""
        s, p, q = (array for _, array in self.encode_matrix(x))
        return self.decode_factors(s, p, q)

    # --- the flat-vector contract: not this codec's ---------------------------------------------
    def encode(self, x: np.ndarray, out: Tensors | None = None) -> Tensors:
        self._no_vectors()

    def decode(
        self, tensors: Mapping[str, np.ndarray] | Tensors, out: np.ndarray | None = None, n: int | None = None
    ) -> np.ndarray:
        self._no_vectors()

    def encode_slice(self, x: np.ndarray, out: dict[str, np.ndarray], start: int, scratch: np.ndarray) -> None:
        self._no_vectors()

    def _decode_range(self, side: Mapping[str, np.ndarray], piece: np.ndarray, start: int, out: np.ndarray) -> None:
        self._no_vectors()

    def _no_vectors(self) -> NoReturn:
        raise ValueError(
            f"codec {self.name!r} carries pipeline boundary matrices only (toolkit.wire.payloads.encode_rows); "
            "for gradients and parameters choose none, float16, int8 or topk2-<K>"
        )


def _quantize_columns(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each column of ``a`` as int8 against its own largest entry: ``(codes, step)`` with
    ``a ~ codes * step`` (a zero column: codes 0, step 0)."""
    peak = np.abs(a).max(axis=0)
    step = (peak / _LEVELS).astype(np.float32)
    safe = np.where(step > 0, step, np.float32(1.0))
    codes = np.clip(np.rint(a / safe), -_LEVELS, _LEVELS).astype(np.int8)
    return codes, step
