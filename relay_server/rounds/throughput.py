"""The collaboration's samples/s as the relay measured it: samples its rounds applied over the
time those rounds took. What ``/api/status``, the dashboard, every heartbeat answer
(the peers' panels, the ETA) and W&B show as *the* samples/s.

The peers' own figures are self-reports: a peer that times its compute wrongly (one with many
micro-batches in flight, say) or lies reports any number, and summing them once showed 32,574
samples/s on a run whose rounds applied 0.8. Those reports stay on the dashboard as what they
are, bounded by :func:`bounded_report`; the headline figure is counted here.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

RATE_WINDOW = 5
"""Rounds per measured figure: one round alone is too spiky (the dashboard's chart uses the same)."""
PLAUSIBLE_FACTOR = 10.0
"""A peer's self-reported samples/s is believed up to this many times the rate at which its own
progress reports said its samples grew since it joined (compute-only timing legitimately beats
the wall-clock rate, by its share of time spent waiting on rounds: 10x is a generous margin)."""


def measured_samples_per_s(
    points: Sequence[tuple[float, int]], window: int = RATE_WINDOW, now: float | None = None
) -> tuple[float | None, int]:
    """(samples/s, rounds it spans) over the last ``window`` of ``points``, (finalized_at unix
    seconds, samples applied) oldest first: the samples of the last k rounds over the time from
    the end of the round before them to the end of the last one (the first round's samples only
    start the clock). None with fewer than two rounds. With ``now``, a collaboration that has
    finished no round for longer than those k rounds took is measured up to ``now`` instead, so
    a stalled run's figure falls rather than stays at its last value."""
    if len(points) < 2:
        return None, 0
    k = min(window, len(points) - 1)
    start, end = points[-1 - k][0], points[-1][0]
    elapsed = end - start
    if now is not None:
        elapsed = max(elapsed, now - end)
    samples = sum(n for _, n in points[-k:])
    return (samples / elapsed if elapsed > 0 else None), k


class RoundRate:
    """The last few rounds' (finalized_at, samples), kept in memory for the figure every heartbeat
    answers with (a database query per heartbeat would cost more than the heartbeat). Fed by the
    store as it commits rounds (on the reducer thread), read on the event loop: one lock."""

    def __init__(self, points: Sequence[tuple[float, int]] = ()) -> None:
        self._points: deque[tuple[float, int]] = deque(points, maxlen=RATE_WINDOW + 1)
        self._lock = threading.Lock()

    def add(self, finalized_at: float, samples: int) -> None:
        with self._lock:
            self._points.append((finalized_at, samples))

    def samples_per_s(self, now: float | None = None) -> tuple[float, int]:
        """(samples/s, rounds measured over): 0.0 and 0 before two rounds finished."""
        with self._lock:
            points = list(self._points)
        rate, rounds = measured_samples_per_s(points, now=time.time() if now is None else now)
        return (rate or 0.0), rounds


def bounded_report(reported: float, accumulated: int, online_s: float) -> tuple[float, bool]:
    """A peer's self-reported samples/s, and whether it was capped: at most
    :data:`PLAUSIBLE_FACTOR` times the samples its progress reports said it accumulated per second
    since it joined (``accumulated`` over ``online_s``). A peer that reported no growth yet has
    shown nothing to believe a figure by: its report counts as 0 until it does."""
    if reported <= 0:
        return 0.0, False
    bound = PLAUSIBLE_FACTOR * accumulated / online_s if online_s > 0 else 0.0
    return (bound, True) if reported > bound else (reported, False)
