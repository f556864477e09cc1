"""Robust aggregation: CenteredClip (Karimireddy, He & Jaggi 2020, "Learning from History for
Byzantine Robust Optimization"), run by the relay, which is the trusted server it needs.

    v <- v + sum_i w_i * (x_i - v) * min(1, tau / ||x_i - v||)      (w normalised, L iterations)

Each peer's residual is clipped to norm ``tau``, so one peer moves the center by at most
``w_i * tau`` per iteration however large its vector; honest vectors inside the ball are
averaged exactly. With ``tau = inf`` one iteration is the weighted mean.

Choices (and why):

* Inputs ``x_i`` are per-peer MEAN gradients (sum / samples) so their norms are comparable;
  weights are samples, capped at ``max_weight_ratio`` x the median weight, because samples are
  self-reported: an attacker claiming 10^9 samples would otherwise own the weighted center.
  The cap only changes the variance of honest contributions, never their expectation.
* Start: the coordinate-wise median (unweighted, robust to < n/2 attackers), or the caller's
  ``start`` such as the previous round's center (the paper's momentum start).
* ``tau`` (auto): ``tau_scale`` x the median residual norm ``||x_i - start||``. Honest residuals
  concentrate near that value, so scale 1-2 clips them little while capping an outlier's pull
  at about one honest deviation; the bias it can cause is <= (w_attacker / w_honest) * tau.
* Iterations: 3 by default. From a median start the center is already close; each further
  iteration costs n x chunk flops and lets a heavily weighted attacker pull up to w*tau more.
* Per chunk: the relay reduces the flat vector in chunks, so clipping is per chunk of
  ``chunk_elems`` coordinates (block-wise CenteredClip); auto tau adapts to each chunk's scale.
  Memory: the relay keeps every peer's chunks for the round (n_peers x P float32): a mean can be
  streamed, a robust center cannot. Float64 accumulation; peers are reduced in sorted id order,
  so the result does not depend on arrival order (bitwise deterministic).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class CenteredClipConfig:
    """Settings of the robust reducer (``rounds.aggregation = "centered_clip"``)."""

    iterations: int = 3
    """Clipping iterations from the start point (>= 1)."""
    tau: float = 0.0
    """Absolute clipping radius per chunk; 0 = automatic (``tau_scale`` x median residual norm)."""
    tau_scale: float = 1.0
    """Multiple of the median residual norm used as the radius when ``tau`` is 0."""
    max_weight_ratio: float = 2.0
    """Cap each peer's weight at this multiple of the median weight (0 = no cap). A clipped peer
    of weight share s biases the center by up to about s / (1 - s) x tau; at 2x the median among
    9 peers that is ~0.25 tau, below the honest mean's own noise."""

    def __post_init__(self) -> None:
        if self.iterations < 1:
            raise ValueError("centered_clip.iterations must be >= 1")
        if self.tau < 0 or self.tau_scale <= 0 or self.max_weight_ratio < 0:
            raise ValueError("centered_clip.tau must be >= 0, tau_scale > 0 and max_weight_ratio >= 0")


@dataclass(frozen=True)
class ClipResult:
    center: np.ndarray  # (d,) float32
    tau: float
    clipped: int  # peers clipped in the last iteration (a dashboard signal: who sends outliers)


def capped_weights(weights: Sequence[float], max_ratio: float) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or not len(w) or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError("weights must be positive and finite")
    if max_ratio > 0:
        w = np.minimum(w, max_ratio * np.median(w))
    return w / w.sum()


def centered_clip(
    xs: Sequence[np.ndarray] | np.ndarray,
    weights: Sequence[float],
    *,
    config: CenteredClipConfig = CenteredClipConfig(),
    start: np.ndarray | None = None,
) -> ClipResult:
    """The CenteredClip center of the rows ``xs`` (n vectors of d values)."""
    rows = [np.asarray(x, dtype=np.float32).reshape(-1) for x in xs]
    if not rows or any(r.shape != rows[0].shape for r in rows):
        raise ValueError("centered_clip needs one or more vectors of equal length")
    w = capped_weights(weights, config.max_weight_ratio)
    if len(w) != len(rows):
        raise ValueError("one weight per vector")
    v = (np.median(np.stack(rows), axis=0) if start is None else np.asarray(start).reshape(-1)).astype(np.float64)
    diff = np.empty_like(v)
    tau = config.tau or config.tau_scale * float(np.median([_residual(r, v, diff) for r in rows]))
    clipped = 0
    for _ in range(config.iterations):
        step = np.zeros_like(v)
        clipped = 0
        for row, weight in zip(rows, w):
            norm = _residual(row, v, diff)  # diff = row - v
            scale = 1.0 if norm <= tau else tau / norm  # tau = 0 leaves v at the start point
            clipped += int(scale < 1.0)
            step += (weight * scale) * diff
        v += step
    return ClipResult(v.astype(np.float32), tau, clipped)


def _residual(row: np.ndarray, v: np.ndarray, out: np.ndarray) -> float:
    np.subtract(row, v, out=out)
    return float(np.sqrt(np.dot(out, out)))


@dataclass
class RobustAccumulator:
    """One round's contributions in robust mode: the counterpart of ``Round.add_chunk`` /
    ``Round.finish_mean`` that stores chunks instead of summing them.

    Like the streaming mean, each chunk is reduced over the peers that delivered it whole.
    """

    num_params: int
    chunk_elems: int
    config: CenteredClipConfig = field(default_factory=CenteredClipConfig)
    start: np.ndarray | None = None  # (P,) e.g. the previous round's center; None = median
    _chunks: list[dict[str, tuple[np.ndarray, float]]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self._chunks = [{} for _ in range(-(-self.num_params // self.chunk_elems))]

    def add_chunk(self, peer_id: str, start: int, values_sum: np.ndarray, samples: int) -> None:
        """Keep a peer's chunk (a SUM over ``samples``) as its mean gradient, float32."""
        if start % self.chunk_elems or samples <= 0:
            raise ValueError("chunks must start on a chunk boundary and carry samples > 0")
        index = start // self.chunk_elems
        expected = min(self.chunk_elems, self.num_params - start)
        if values_sum.size != expected:
            raise ValueError(f"chunk {index} must have {expected} values")
        mean = np.divide(values_sum, np.float32(samples), dtype=np.float32)  # a copy: inputs are request buffers
        self._chunks[index][peer_id] = (mean, float(samples))

    def discard(self, peer_id: str) -> None:
        """Forget a peer's chunks (e.g. banned mid-round)."""
        for chunk in self._chunks:
            chunk.pop(peer_id, None)

    def finish_into(self, grad: np.ndarray) -> dict[str, int]:
        """Write the robust center of every chunk into ``grad`` (P,) float32; chunks nobody
        delivered are 0. Returns how many chunks clipped each peer (for the moderation view)."""
        clipped_counts: dict[str, int] = {}
        for index, chunk in enumerate(self._chunks):
            lo, hi = index * self.chunk_elems, min(self.num_params, (index + 1) * self.chunk_elems)
            if not chunk:
                grad[lo:hi] = 0.0
                continue
            peers = sorted(chunk)
            start = None if self.start is None else self.start[lo:hi]
            result = centered_clip(
                [chunk[p][0] for p in peers], [chunk[p][1] for p in peers], config=self.config, start=start
            )
            grad[lo:hi] = result.center
            if result.clipped:
                for p in peers:
                    if _residual(chunk[p][0], result.center.astype(np.float64), np.empty(hi - lo)) > result.tau:
                        clipped_counts[p] = clipped_counts.get(p, 0) + 1
            chunk.clear()  # release memory chunk by chunk
        return clipped_counts
