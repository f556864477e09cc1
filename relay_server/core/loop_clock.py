"""The relay's clock: the time during which its event loop listened.

Everything the relay waits on (an expert call's deadline, a pipeline lease, a task's lease-to-
result time, a long poll) is a promise about the relay's own attention. When its event loop
stalls (a slow disk, swap, a starved VM, a long synchronous step), results and heartbeats sent
meanwhile wait unread in its sockets; counted on the wall clock, a 3 s stall fails every call
whose deadline fell inside it although its answer arrived in time, and after the stall the
loop's timers fire before the sockets' data is read, so the answer is always too late.

So the relay counts deadlines on :class:`LoopClock`, which stops while the loop is not
listening: it runs with the monotonic clock, but never more than ``grace_s`` past the loop's
last :meth:`~LoopClock.beat` (the relay's ticker beats it every tenth of a second). A stall is
the time beyond that: it counts toward no deadline, is handed to the ``on_stall`` listeners (the
peer registry: it counts toward nobody's silence either) and is summed up by
:class:`StallReport`, one warning line a minute at most. Reading the clock needs no beat first:
a deadline judged by a timer that fires right after a stall, before the ticker ran, already
sees the stopped clock. The clock never goes back and never runs ahead of the monotonic clock: a
busy relay degrades its throughput (deadlines stretch by its stalls), not its correctness.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
GRACE_S = 0.5  # a beat later than this means the loop was not listening (it beats every 0.1 s)
REPORT_EVERY_S = 60.0


class StallReport:
    """The stalls of the last minute in one warning line (count, worst, total), instead of a
    line per stall: a relay on a busy machine stalls many times a minute, and a log of a hundred
    identical warnings hides everything else in it. The first stall is reported at once."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, every_s: float = REPORT_EVERY_S) -> None:
        self.clock, self.every_s = clock, every_s
        self.count, self.worst_s, self.total_s = 0, 0.0, 0.0
        self._logged_at: float | None = None

    def note(self, seconds: float) -> None:
        self.count += 1
        self.worst_s = max(self.worst_s, seconds)
        self.total_s += seconds

    def flush(self, *, final: bool = False) -> None:
        """Log what was noted, if a minute passed since the last line (or there was none), or
        ``final``ly (the relay stops: no stall goes unreported)."""
        now = self.clock()
        if not self.count or not final and self._logged_at is not None and now - self._logged_at < self.every_s:
            return
        span = "" if self._logged_at is None else f" in the last {now - self._logged_at:.0f} s"
        log.warning(
            "the relay's event loop stalled %d time%s%s (worst %.1f s, %.1f s in all); time during a stall "
            "counts toward no deadline and no peer's silence. Give the relay more CPU or a faster disk if "
            "this repeats",
            self.count,
            "" if self.count == 1 else "s",
            span,
            self.worst_s,
            self.total_s,
        )
        self.count, self.worst_s, self.total_s = 0, 0.0, 0.0
        self._logged_at = now


class LoopClock:
    """Monotonic seconds during which the relay's event loop listened (see the module docstring).

    Pass :meth:`now` (or the clock itself) wherever code takes ``clock=``; call :meth:`beat` from
    the loop, often (every 0.1 s). ``clock`` is the monotonic clock under it (tests pass the fake
    one)."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, grace_s: float = GRACE_S, report: StallReport | None = None
    ) -> None:
        self._clock, self.grace_s = clock, grace_s
        self._beat_at = clock()  # under-clock time of the last beat
        self._at_beat = self._beat_at  # this clock's time then
        self.stalled_s = 0.0
        self.report = report or StallReport(clock)
        self.on_stall: list[Callable[[float], None]] = []

    def now(self) -> float:
        return self._at_beat + min(self._clock() - self._beat_at, self.grace_s)

    __call__ = now

    def beat(self) -> float:
        """The loop listens now: the seconds it did not since the previous beat (beyond
        ``grace_s``; 0.0 when it kept listening), told to ``on_stall`` and the report."""
        wall = self._clock()
        gap = wall - self._beat_at
        stalled = max(0.0, gap - self.grace_s)
        self._at_beat += gap - stalled
        self._beat_at = wall
        if stalled > 0:
            self.stalled_s += stalled
            self.report.note(gap)
            for listener in self.on_stall:
                listener(stalled)
        self.report.flush()
        return stalled

    def resume(self) -> None:
        """Start beating after a pause nobody waited through (the relay's startup): the pause is
        neither counted nor reported."""
        wall = self._clock()
        self._at_beat += min(wall - self._beat_at, self.grace_s)
        self._beat_at = wall
