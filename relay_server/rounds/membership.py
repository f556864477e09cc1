"""One averaging round's membership -- who is expected, uploading, done -- and its adaptive
deadline. The numbers themselves are summed by :mod:`relay_server.rounds.reducer`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from relay_server.core.config import RoundsSection
from toolkit.wire.protocol import PlanSlice


class RoundClosedMidUpload(Exception):
    """The round closed while an upload was streaming into it."""


@dataclass
class Round:
    step: int
    round_id: str
    expected: set[str]
    deadline_s: float
    clock: Callable[[], float] = time.monotonic
    """The relay's clock (:mod:`relay_server.core.loop_clock`): a stall of its event loop, while
    uploads wait unread in its sockets, does not run the round's deadline down."""
    opened_at: float = field(init=False)
    uploading: set[str] = field(default_factory=set)
    received: dict[str, int] = field(default_factory=dict)  # peer_id -> samples
    partial: set[str] = field(default_factory=set)  # sliced uploads that delivered only some slices
    outcomes: dict[str, str] = field(default_factory=dict)  # peer_id -> an upload not counted plainly whole
    """What the round record says about uploads that were not simply counted whole (see
    ``RoundRecord.outcomes``): refused, partial (slices), or banned after counting."""
    arrival_s: dict[str, float] = field(default_factory=dict)
    loss_sum: float = 0.0
    inner_steps: int = 0  # run.mode = "local_sgd": inner steps behind the received pseudo-gradients, summed
    closed: bool = False
    finalized_by: str = ""
    plan_version: str = ""
    slices: list[PlanSlice] = field(default_factory=list)  # empty when the relay owns the whole vector
    tickets: dict[str, tuple[int, float, bool]] = field(default_factory=dict)  # peer -> (samples, loss, was expected)

    def __post_init__(self) -> None:
        self.opened_at = self.clock()

    @property
    def deadline(self) -> float:
        return self.opened_at + self.deadline_s

    @property
    def remaining_s(self) -> float:
        """Seconds left before the deadline, on the round's clock (0 once passed)."""
        return max(0.0, self.deadline - self.clock())

    def complete(self, peer_id: str, samples: int, loss_sum: float) -> None:
        self.uploading.discard(peer_id)
        self.received[peer_id] = samples
        self.outcomes.pop(peer_id, None)  # a retry after a refusal that counted nothing
        self.arrival_s[peer_id] = self.clock() - self.opened_at
        self.loss_sum += loss_sum

    def begin(self, peer_id: str) -> bool:
        """An upload starts; returns whether the round already expected this peer."""
        expected = peer_id in self.expected
        self.expected.add(peer_id)
        self.uploading.add(peer_id)
        return expected

    def abort(self, peer_id: str, *, reduced: bool, was_expected: bool) -> None:
        """An upload failed. With nothing reduced the round is exactly as before it began (the
        peer may retry; the record says "refused" unless a retry counts). With some reduced (a
        sliced upload whose other slices arrived) those stay, part-wise, the record says
        "partial", and the peer may not upload again to this round: its retry would count them twice."""
        self.uploading.discard(peer_id)
        self.outcomes[peer_id] = "partial" if reduced else "refused"
        if reduced:
            self.partial.add(peer_id)
        if reduced or not was_expected:
            self.expected.discard(peer_id)

    def drop(self, peer_id: str) -> None:
        """A peer left, died or failed validation: stop waiting for it."""
        self.expected.discard(peer_id)
        self.uploading.discard(peer_id)
        self.tickets.pop(peer_id, None)

    def everyone_arrived(self) -> bool:
        return not self.uploading and self.expected <= set(self.received)

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
