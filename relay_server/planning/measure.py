"""Measured rates the plan is solved from: never what a peer declares.

* A peer's upload and download rate: bytes over seconds of the transfers servers actually saw.
  A peer sends its slices to several owners at once, so one *transfer group* is everything it
  moved in one direction for one step: its rate is the summed bytes over the longest of the
  parallel transfers' durations (they overlap). A group is complete once a later step shows up.
* A server's (relay or aggregator) own rate: per step, the bytes it received (served) over the
  time at least one of that step's transfers was under way, on its own clock (overlapping
  transfers count once; the idle gap before a late peer's download does not count).
* What a server *sends* counts only once the receiver acknowledged it (:func:`delivered`): the
  kernel takes a few MB into the socket's send buffer at once, so "the write returned" would
  overstate a slow link several times over for a slice of a few MB.
* A link's rate is the best of its recent transfers (:class:`RecentPeak`): a transfer never
  goes faster than the link, so the best one is the tightest lower bound of its capacity, while
  an average would also count every time the other end, not the link, was the bottleneck.
  Samples/s are smoothed with an EWMA instead: one slow batch moves the estimate, not the plan.
"""

from __future__ import annotations

import fcntl
import struct
import termios
import time
from collections import defaultdict
from dataclasses import dataclass, field

EWMA_ALPHA = 0.3
PEAK_WINDOW = 8  # transfers a link's rate looks back on (so it can fall when the link slows)


def delivered(sock: object, nbytes: int) -> int:
    """Of ``nbytes`` just written to ``sock``, how many the receiver has acknowledged: ``nbytes``
    less the connection's unacknowledged send queue (Linux ``SIOCOUTQ``). Where that cannot be
    read (another OS, no socket), ``nbytes``."""
    fileno = getattr(sock, "fileno", None)
    if fileno is None or not hasattr(termios, "TIOCOUTQ"):
        return nbytes
    try:
        (queued,) = struct.unpack("i", fcntl.ioctl(fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))
    except (OSError, ValueError):
        return nbytes
    return max(0, nbytes - queued)


@dataclass
class Ewma:
    value: float = 0.0
    samples: int = 0

    def add(self, x: float, alpha: float = EWMA_ALPHA) -> None:
        self.value = x if self.samples == 0 else (1 - alpha) * self.value + alpha * x
        self.samples += 1

    @property
    def measured(self) -> bool:
        return self.samples > 0


@dataclass
class RecentPeak:
    """The largest of the last :data:`PEAK_WINDOW` samples."""

    recent: list[float] = field(default_factory=list)
    samples: int = 0

    def add(self, x: float) -> None:
        self.recent = [*self.recent[1 - PEAK_WINDOW :], x]
        self.samples += 1

    @property
    def value(self) -> float:
        return max(self.recent, default=0.0)

    @property
    def measured(self) -> bool:
        return self.samples > 0


@dataclass
class _Group:
    nbytes: int = 0
    seconds: float = 0.0


class PeerRates:
    """Per peer: upload and download rates (recent peaks) from completed transfer groups."""

    def __init__(self) -> None:
        self.up: dict[str, RecentPeak] = defaultdict(RecentPeak)
        self.down: dict[str, RecentPeak] = defaultdict(RecentPeak)
        self._open: dict[tuple[str, str], tuple[int, _Group]] = {}

    def add(self, peer_id: str, direction: str, step: int, nbytes: int, seconds: float) -> None:
        key = (peer_id, direction)
        current = self._open.get(key)
        if current is not None and current[0] != step:
            self._fold(key, current[1])
            current = None
        if current is None:
            current = self._open[key] = (step, _Group())
        group = current[1]
        group.nbytes += nbytes
        group.seconds = max(group.seconds, seconds)

    def flush(self) -> None:
        """Fold the open groups too (their parallel parts are all in by the time a plan is made)."""
        for key, (_, group) in list(self._open.items()):
            self._fold(key, group)
        self._open.clear()

    def _fold(self, key: tuple[str, str], group: _Group) -> None:
        peer_id, direction = key
        if group.nbytes and group.seconds > 0:
            (self.up if direction == "up" else self.down)[peer_id].add(group.nbytes / group.seconds)

    def forget(self, peer_id: str) -> None:
        self.up.pop(peer_id, None)
        self.down.pop(peer_id, None)
        for key in [k for k in self._open if k[0] == peer_id]:
            del self._open[key]


@dataclass
class _Span:
    step: int
    intervals: list[tuple[float, float]]
    nbytes: int = 0

    def busy_s(self) -> float:
        """Seconds in which at least one of the step's transfers was under way: a peer that
        fetches the version seconds after the others (it joined, or its round closed without
        it) must not count the idle gap as the server sending slowly."""
        total, end = 0.0, float("-inf")
        for a, b in sorted(self.intervals):
            if b > end:
                total += b - max(a, end)
                end = b
        return total


@dataclass
class ServerMeter:
    """A server's own receive (``download``) and send (``upload``) rate, one span per step."""

    download: RecentPeak = field(default_factory=RecentPeak)
    upload: RecentPeak = field(default_factory=RecentPeak)
    _spans: dict[str, _Span] = field(default_factory=dict)

    def record(self, direction: str, step: int, nbytes: int, started: float, ended: float | None = None) -> None:
        """A transfer that began at ``started`` (monotonic) and ended now (or at ``ended``)."""
        ended = time.monotonic() if ended is None else ended
        span = self._spans.get(direction)
        if span is not None and span.step != step:
            self._fold(direction, span)
            span = None
        if span is None:
            span = self._spans[direction] = _Span(step, [])
        span.intervals.append((started, ended))
        span.nbytes += nbytes

    def flush(self) -> None:
        for direction, span in list(self._spans.items()):
            self._fold(direction, span)
        self._spans.clear()

    def _fold(self, direction: str, span: _Span) -> None:
        seconds = span.busy_s()
        if span.nbytes and seconds > 0:
            (self.download if direction == "up" else self.upload).add(span.nbytes / seconds)
