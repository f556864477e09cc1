"""The training bytes the relay moves, per sample its rounds apply (``GET /api/status``'s
``traffic``, W&B's ``bytes_per_sample/*``): the figure low-bandwidth runs are judged by.

Counted where the bytes pass, with plain int adds on the event loop (no lock, nothing per chunk):
an accepted upload's body once the reducer committed it
(:meth:`~relay_server.collaboration.intake.GradientIntake.receive`), a parameter answer once it
was written (``GET /api/params``, the cache's immutable URLs), the samples once a round's step is
published (:class:`~relay_server.collaboration.round_cycle.RoundCycle`). Since the relay started:
a restart begins again at zero.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.wire.protocol import TrafficStatus


@dataclass
class Traffic:
    up_bytes: int = 0
    """Bodies of the gradient/pseudo-gradient uploads the relay accepted (container header included)."""
    down_bytes: int = 0
    """Parameter bodies (full and delta) and cache refs the relay answered."""
    samples: int = 0
    """Samples of the rounds applied."""

    def report(self) -> TrafficStatus:
        per = (lambda n: n / self.samples) if self.samples else (lambda n: None)
        return TrafficStatus(
            up_bytes=self.up_bytes,
            down_bytes=self.down_bytes,
            samples=self.samples,
            up_bytes_per_sample=per(self.up_bytes),
            down_bytes_per_sample=per(self.down_bytes),
        )
