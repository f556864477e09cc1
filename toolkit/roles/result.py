"""What one ``join()`` did, whichever role it played: :class:`JoinResult` and its sentence."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from toolkit.errors import CollabError

if TYPE_CHECKING:
    from toolkit.client import RelayClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JoinResult:
    """What one ``join()`` did; :meth:`summary` says it in a sentence (what the notebook prints)."""

    peer_id: str
    final_step: int
    contributed_samples: int
    local_steps: int
    last_loss: float | None
    seconds: float
    finished: bool
    device: str
    precision: str
    first_contribution_s: float | None = None
    """Seconds from this peer's join to the relay accepting its first gradient, as the relay
    measured it (the number its dashboard shows); None: no gradient was accepted."""
    joined_step: int = 0
    """The global step when this peer joined."""
    hosted_experts: bool = False
    """``join(role="expert_host")``: ``local_steps`` counts expert tasks served, not micro-batches."""
    in_flight: int = 1
    """The most micro-batches this trainer kept in flight at once (a run with mixture layers)."""

    def summary(self) -> str:
        """One readable sentence, e.g. "Contributed 16 samples over 2 steps (first contribution
        3.2 s after joining); left at step 2 after 41 s."."""
        took = _duration(self.seconds)
        if self.hosted_experts:
            return f"Hosted experts for {took}: {self.local_steps:,} tasks served."
        steps = self.final_step - self.joined_step
        over = f"over {steps:,} step{'s' if steps != 1 else ''}"
        if self.contributed_samples and self.first_contribution_s is not None:
            what = (
                f"Contributed {self.contributed_samples:,} samples {over} (first contribution "
                f"{self.first_contribution_s:.1f} s after joining)"
            )
        elif self.contributed_samples:
            what = f"Contributed {self.contributed_samples:,} samples {over}"
        else:
            what = f"No samples contributed yet ({self.local_steps:,} micro-batches computed {over})"
        end = "the run finished" if self.finished else "left"
        return f"{what}; {end} at step {self.final_step:,} after {took}."


def _duration(seconds: float) -> str:
    """``41 s``, ``12 min``, ``3.5 h``: how long a session took, in the unit a person reads."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def relay_credited_samples(client: "RelayClient", peer_id: str) -> int:
    """The samples the relay credited this stage worker with (the count its dashboard and
    leaderboard show): asked once, as the worker leaves. 0 when the relay cannot say right now
    (it is unreachable, or restarted and counts from zero)."""
    try:
        return client.pipeline.credit(peer_id).samples
    except CollabError as exc:
        log.warning("could not ask the relay for this worker's credited samples: %s", exc)
        return 0
