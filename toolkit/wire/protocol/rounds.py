"""Averaging rounds: the open round, a gradient upload's metadata and receipt, the record of a
closed round, and the master parameters' version a newcomer downloads.

Version rule (DESIGN.md section 3): a gradient computed on parameters of version ``v`` counts
toward round ``r`` (the round that produces version ``r + 1``) iff ``r - v <= max_staleness``.
``max_staleness = 0`` is strict large-batch SGD; ``1`` allows delayed parameter updates.
Otherwise the peer discards its accumulator and downloads the latest parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from toolkit.wire.protocol.routes import _ID, _NONNEG
from toolkit.wire.protocol.slices import PlanSlice
from toolkit.wire.schema import Schema, limits


@dataclass(frozen=True, kw_only=True)
class RoundInfo(Schema):
    """The averaging round that is accepting gradients (at most one at a time)."""

    step: int = field(metadata=_NONNEG)
    round_id: str = field(metadata=limits(max_len=32))
    """Unique per round, across relay restarts: a round that closed empty (or died with the
    relay) re-opens for the same step under a new id, and peers upload once per id."""
    deadline_in_s: float
    expected_peers: int = field(metadata=_NONNEG)
    received_peers: int = field(metadata=_NONNEG)
    plan_version: str = field(default="", metadata=limits(max_len=64))
    slices: list["PlanSlice"] = field(default_factory=list, metadata=limits(max_len=1024))
    """Where this round's gradient slices go (DESIGN.md s6). Empty: the relay owns the whole
    vector, and the peer uploads it in one piece as before (no ticket)."""


@dataclass(frozen=True, kw_only=True)
class GradientMeta(Schema):
    """Rides in the safetensors header of a gradient upload. The tensor is the SUM of
    per-sample gradients over ``samples`` samples, so the relay only adds."""

    peer_id: str = field(metadata=_ID)
    step: int = field(metadata=_NONNEG)
    version: int = field(metadata=_NONNEG)
    samples: int = field(metadata=limits(gt=0, le=10**9))
    loss_sum: float


@dataclass(frozen=True, kw_only=True)
class UploadReceipt(Schema):
    step: int
    accepted_samples: int
    received_peers: int


@dataclass(frozen=True, kw_only=True)
class RoundRecord(Schema):
    step: int
    """The version this round produced."""
    contributors: int
    samples: int
    loss: float | None
    duration_s: float
    deadline_s: float
    finalized_by: Literal["all_arrived", "deadline", "peers_gone", "rollback", "recovery", "pipeline"]
    """"recovery": no round; a dead aggregator's slice was restored from the relay's copy.
    "pipeline": a pipeline's batch, every stage counting all its micro-batches."""
    finalized_at: float = 0.0
    """Unix time, for throughput curves."""
    lr: float | None = None
    """The learning rate the step applied."""
    grad_norm: float | None = None
    """The averaged gradient's global norm (before clipping)."""
    outcomes: dict[str, str] = field(default_factory=dict, metadata=limits(max_len=4096))
    """peer_id -> what happened to an upload that was not simply counted whole (such peers are
    absent from ``contributors``/``samples`` unless noted): "refused" (nothing of it counted),
    "partial" (a sliced upload: only some owners' slices counted), "banned_kept" (counted, then
    its user was banned: the mean keeps it -- roll back if it did harm), "banned_removed"
    (counted, then taken out by the ban: CenteredClip mode)."""


@dataclass(frozen=True, kw_only=True)
class StateInfo(Schema):
    """The master parameters a newcomer downloads; ``sha256`` is over the float32 bytes."""

    step: int = field(metadata=_NONNEG)
    num_params: int
    sha256: str = field(metadata=limits(max_len=64))
