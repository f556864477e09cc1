"""Decentralized mixture-of-experts (``ROUTES["moe_*"]``): the JSON messages of the expert routes.

Tensors travel as containers (:mod:`toolkit.wire.payloads`): a call's ``x`` (and ``g``), a task
batch (whose metadata ``tasks`` is a :class:`TaskBatch`), a result, a checkpoint. The JSON bodies
are these: the run's ``[moe]`` as trainers and hosts need it (:class:`MoeSpec`), the directory
trainers route by (:class:`MoeDirectory`), a host's lease (:class:`LeaseRequest` ->
:class:`ExpertLease`) and the receipts
of its checkpoints (:class:`CheckpointReceipt`) and results (:class:`ResultAck`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from toolkit.wire.protocol.routes import _ID, _NONNEG
from toolkit.wire.schema import Schema, limits

_UID = limits(max_len=64)


@dataclass(frozen=True, kw_only=True)
class MoeSpec(Schema):
    """``GET /api/moe/spec``: what every trainer and host must agree on (the relay's ``[moe]``)."""

    uid_prefix: str = field(metadata=_UID)
    layers: int = field(metadata=limits(ge=1, le=64))
    grid: list[int] = field(metadata=limits(max_len=3))
    k: int = field(metadata=limits(ge=1, le=64))
    k_min: int = field(metadata=limits(ge=1, le=64))
    expert: dict[str, Any]
    """``kind`` (the toolkit's own architectures only) and its arguments, e.g. ``d``, ``hidden``."""
    optimizer: dict[str, Any]
    """``name`` (none|sgd|adam), ``lr`` and the optimizer's own arguments."""
    seed: int
    forward_timeout_s: float = field(metadata=limits(gt=0))
    backward_timeout_s: float = field(metadata=limits(gt=0))
    checkpoint_every_s: float = field(metadata=limits(gt=0))
    max_rows_per_call: int = field(metadata=limits(ge=1))
    codec: str = field(default="none", metadata=limits(choices=("none", "float16", "int8")))

    @property
    def width(self) -> int:
        """Features in and out of every expert."""
        return int(self.expert.get("d", 0))


@dataclass(frozen=True, kw_only=True)
class MoeDirectory(Schema):
    """``GET /api/moe/directory``: the uids with a host now (a trainer's beam search picks among
    these only), bumped ``version`` on every change."""

    version: int = field(metadata=_NONNEG)
    live: list[str] = field(metadata=limits(max_len=100_000))
    total: int = field(metadata=_NONNEG)


@dataclass(frozen=True, kw_only=True)
class LeaseRequest(Schema):
    """The body of ``POST /api/moe/hosts/{peer_id}/lease`` (optional): the experts this host still
    holds in memory, which it takes back first when they have no host (after a blip past the peer
    TTL, or a relay restart), so its copies are not traded for another host's older checkpoints."""

    held: list[str] = field(default_factory=list, metadata=limits(max_len=4096))


@dataclass(frozen=True, kw_only=True)
class ExpertLease(Schema):
    """``POST /api/moe/hosts/{peer_id}/lease``: the experts this host serves now."""

    uids: list[str] = field(metadata=limits(max_len=4096))
    spec: MoeSpec
    granted: list[str] = field(default_factory=list, metadata=limits(max_len=4096))
    """The uids of ``uids`` this request leased (the host held no lease on them before it): a host
    that still has a copy of one was away long enough to lose it, and checks the checkpoint."""


@dataclass(frozen=True, kw_only=True)
class TaskHead(Schema):
    """One task of a batch: the call's id, expert, kind and rows (its body is tensor ``{i}``)."""

    task_id: str = field(metadata=_ID)
    uid: str = field(metadata=_UID)
    kind: Literal["forward", "backward"]
    rows: int = field(metadata=limits(ge=1))


@dataclass(frozen=True, kw_only=True)
class TaskBatch(Schema):
    """The metadata ``tasks`` of ``GET /api/moe/hosts/{peer_id}/tasks``'s container."""

    tasks: list[TaskHead] = field(metadata=limits(max_len=100_000))


@dataclass(frozen=True, kw_only=True)
class ResultAck(Schema):
    """``PUT /api/moe/hosts/{peer_id}/tasks/{task_id}``: the result reached the caller."""

    ok: bool


@dataclass(frozen=True, kw_only=True)
class CheckpointReceipt(Schema):
    """``PUT /api/moe/hosts/{peer_id}/experts/{uid}/checkpoint``: stored as number ``checkpoint``."""

    uid: str = field(metadata=_UID)
    checkpoint: int = field(metadata=_NONNEG)
    updates: int = field(metadata=_NONNEG)
