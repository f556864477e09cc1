"""Statistics of every result against its stage's running distribution.

Each accepted boundary (a stage's activations ``a{k}``, the gradient of a stage's input ``g{k}``)
is reduced to one number on the relay's acceptance path: the log of its RMS (the L2 norm, already
computed while validating it, over the square root of its size). Per boundary name the monitor
keeps the last :data:`WINDOW` values of every worker and scores each new one against their
median, in units of the median absolute deviation (at least :data:`FLOOR`, 5% in the log: honest
micro-batches of one batch differ by that much; a 1.3x scale is 0.26, over 5 floors). Median and MAD
are robust: a liar's own results, under half of the window, do not move the reference toward it.

A score beyond :data:`OUTLIER_Z` is an outlier; a worker's suspicion is an exponential average of
its outliers (one every result: 1.0). Suspicion alone never bans -- a shift of the distribution
between versions, or a stage served by one odd machine, must not end anybody -- it makes every
result of that worker a spot check (:mod:`.checks`), whose comparison is the proof. What norms
cannot see (a sign flipped, noise that keeps the norm) is the random spot checks' to find.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

WINDOW = 64
WARMUP = 8
FLOOR = 0.05
OUTLIER_Z = 4.0
DECAY = 0.75
SUSPECT = 0.4
"""Suspicion from which every result of a worker is checked (two outliers in a row: 0.44)."""


REFRESH = 16
"""Observations between two computations of a boundary's median and MAD: scoring one result is
then a subtraction and a division (the reference moves slowly, as parameters do)."""


class ResultMonitor:
    def __init__(self) -> None:
        self.window: dict[str, deque[float]] = {}
        self.reference: dict[str, tuple[float, float, int]] = {}  # name -> (median, spread, observations left)
        self.suspicion: dict[str, float] = {}
        self.observed = self.outliers = 0
        self.outliers_by: dict[str, int] = {}

    def observe(self, name: str, worker: str, norm: float, size: int) -> float:
        """Score one boundary ``name`` (its L2 ``norm`` over ``size`` values) from ``worker``; its z."""
        self.observed += 1
        x = math.log(max(norm / math.sqrt(max(size, 1)), 1e-30))
        window = self.window.setdefault(name, deque(maxlen=WINDOW))
        z = 0.0
        if len(window) >= WARMUP:
            median, spread, left = self.reference.get(name, (0.0, 0.0, 0))
            if left <= 0:
                values = np.fromiter(window, dtype=np.float64)
                median = float(np.median(values))
                spread = max(1.4826 * float(np.median(np.abs(values - median))), FLOOR)
                left = REFRESH
            self.reference[name] = (median, spread, left - 1)
            z = (x - median) / spread
        outlier = abs(z) > OUTLIER_Z
        if outlier:
            self.outliers += 1
            self.outliers_by[worker] = self.outliers_by.get(worker, 0) + 1
        self.suspicion[worker] = DECAY * self.suspicion.get(worker, 0.0) + (1 - DECAY) * float(outlier)
        window.append(x)
        return z

    def suspect(self, worker: str) -> bool:
        return self.suspicion.get(worker, 0.0) >= SUSPECT

    def forget(self, worker: str) -> None:
        self.suspicion.pop(worker, None)
