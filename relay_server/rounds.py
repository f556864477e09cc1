"""One averaging round: the streaming reduction and its adaptive deadline.

Gradients arrive as sums over each peer's samples, in chunks of ``CHUNK_ELEMS`` float32 values.
Each chunk is validated (finite) and added in place to the preallocated float32 buffer while the
next chunk is still on the wire. Each chunk also carries its own sample weight (part-wise
averaging, as in hivemind): an upload that stops early -- its peer died, its round closed, or a
later chunk was refused (NaN/Inf) -- keeps only the chunks it delivered whole and valid, and the
mean of every chunk is exact over the peers that delivered that chunk. No invalid value ever
enters the buffer. Undoing the valid chunks instead would need a staging copy of every upload in
flight (n x P floats), which a relay on a small VM cannot afford.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from relay_server.config import RoundsSection

CHUNK_ELEMS = 1 << 20  # 4 MiB of float32: reduce one while the next arrives


@dataclass
class Round:
    step: int
    round_id: str
    grad: np.ndarray  # (P,) float32, the master's gradient buffer, zeroed at open
    expected: set[str]
    deadline_s: float
    opened_at: float = field(default_factory=time.monotonic)
    uploading: set[str] = field(default_factory=set)
    received: dict[str, int] = field(default_factory=dict)  # peer_id -> samples
    partial: set[str] = field(default_factory=set)  # uploads cut short after some chunks were reduced
    arrival_s: dict[str, float] = field(default_factory=dict)
    loss_sum: float = 0.0
    closed: bool = False
    finalized_by: str = ""

    def __post_init__(self) -> None:
        self.chunk_weight = np.zeros(-(-self.grad.size // CHUNK_ELEMS), dtype=np.float64)
        self.grad.fill(0.0)

    @property
    def deadline(self) -> float:
        return self.opened_at + self.deadline_s

    def add_chunk(self, start: int, values: np.ndarray, samples: int) -> None:
        """Add one whole chunk (already validated) of a peer's gradient sum."""
        segment = self.grad[start:start + values.size]
        np.add(segment, values, out=segment)
        self.chunk_weight[start // CHUNK_ELEMS] += samples

    def complete(self, peer_id: str, samples: int, loss_sum: float) -> None:
        self.uploading.discard(peer_id)
        self.received[peer_id] = samples
        self.arrival_s[peer_id] = time.monotonic() - self.opened_at
        self.loss_sum += loss_sum

    def begin(self, peer_id: str) -> bool:
        """An upload starts; returns whether the round already expected this peer."""
        expected = peer_id in self.expected
        self.expected.add(peer_id)
        self.uploading.add(peer_id)
        return expected

    def abort(self, peer_id: str, *, reduced: bool, was_expected: bool) -> None:
        """An upload failed. With nothing reduced the round is exactly as before it began (the
        peer may retry). With some chunks reduced those stay (part-wise), and the peer may not
        upload again to this round: its retry would count them twice."""
        self.uploading.discard(peer_id)
        if reduced:
            self.partial.add(peer_id)
        if reduced or not was_expected:
            self.expected.discard(peer_id)

    def drop(self, peer_id: str) -> None:
        """A peer left, died or failed validation: stop waiting for it."""
        self.expected.discard(peer_id)
        self.uploading.discard(peer_id)

    def everyone_arrived(self) -> bool:
        return not self.uploading and self.expected <= set(self.received)

    def finish_mean(self) -> None:
        """Turn the sums into the sample-weighted mean, chunk by chunk; empty chunks stay 0."""
        for c, weight in enumerate(self.chunk_weight):
            segment = self.grad[c * CHUNK_ELEMS:(c + 1) * CHUNK_ELEMS]
            if weight > 0:
                np.divide(segment, np.float32(weight), out=segment)
            else:
                segment.fill(0.0)

    @property
    def samples(self) -> int:
        return sum(self.received.values())

    @property
    def loss(self) -> float | None:
        return self.loss_sum / self.samples if self.samples else None


class DeadlinePolicy:
    """Upload window from observed arrival times (DESIGN.md s11: fixed timeouts are wrong for
    someone every time): slack x p90 of recent arrivals, clamped to [floor, ceiling]."""

    def __init__(self, cfg: RoundsSection, history: int = 64) -> None:
        self.cfg = cfg
        self.arrivals: deque[float] = deque(maxlen=history)

    def observe(self, round_: Round) -> None:
        self.arrivals.extend(round_.arrival_s.values())

    def window_s(self) -> float:
        if not self.arrivals:
            return self.cfg.deadline_initial_s
        p90 = float(np.percentile(np.fromiter(self.arrivals, float), 90))
        return min(self.cfg.deadline_ceiling_s, max(self.cfg.deadline_floor_s, self.cfg.deadline_slack * p90))
