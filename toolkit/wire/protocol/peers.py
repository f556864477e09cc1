"""A peer's membership: joining (the run and the collaboration's state in one answer) and the
heartbeat that carries its progress; join, heartbeat and ``GET /api/progress`` all answer with
:class:`CollabState`. Leaving has no body.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from toolkit.wire.protocol.rounds import RoundInfo
from toolkit.wire.protocol.routes import _ID, _NAME, _NONNEG
from toolkit.wire.protocol.run import RunInfo
from toolkit.wire.schema import Schema, limits


@dataclass(frozen=True, kw_only=True)
class CollabState(Schema):
    """What every peer needs to decide its next move; returned by join and heartbeat."""

    step: int = field(metadata=_NONNEG)
    target_batch: int
    samples_accumulated: int = field(metadata=_NONNEG)
    samples_per_s: float = field(metadata=_NONNEG)
    """The collaboration's samples/s as the relay measured it from its last rounds (not the peers' reports)."""
    eta_s: float | None
    num_peers: int = field(metadata=_NONNEG)
    round: RoundInfo | None
    finished: bool = False
    lr: float | None = field(default=None, metadata=_NONNEG)
    """The learning rate of the next update (the run's schedule at ``step``); None from an older relay."""


@dataclass(frozen=True, kw_only=True)
class JoinRequest(Schema):
    peer_name: str = field(metadata=_NAME)
    protocol: int
    device: dict[str, Any] = field(default_factory=dict)
    precision: str | None = None
    client_version: str = field(default="", metadata=_NAME)


@dataclass(frozen=True, kw_only=True)
class JoinResponse(Schema):
    peer_id: str = field(metadata=_ID)
    run: RunInfo
    state: CollabState


@dataclass(frozen=True, kw_only=True)
class Heartbeat(Schema):
    """Liveness plus progress: ``samples`` accumulated locally on parameters of ``version``
    (the oldest version in the accumulator) and not yet uploaded."""

    version: int = field(metadata=_NONNEG)
    samples: int = field(metadata=limits(ge=0, le=10**9))
    samples_per_s: float = field(metadata=limits(ge=0, le=1e7))
    inner_steps: int = field(default=0, metadata=limits(ge=0, le=10**9))
    """``run.mode = "local_sgd"``: inner steps this peer took since its last outer round (0 otherwise)."""
    busy_fraction: float | None = field(default=None, metadata=limits(ge=0, le=1))
    """``run.mode = "local_sgd"``: the share of this peer's training time spent computing rather than
    waiting for outer rounds (None: not measured yet, or sync mode)."""
