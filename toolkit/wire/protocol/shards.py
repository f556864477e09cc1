"""Shard leases (``toolkit.data.shards``, ``relay_server.data.pool``).

A peer asks the relay for the next shard of one dataset of the mix; the relay's pool answers
with the least-processed shard nobody holds, or a shared copy of the least-held one when every
shard is leased (a peer never idles). Progress and releases travel batched in one report. A
lease ends when its peer releases it or leaves the registry (heartbeat TTL, or leave).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.wire.protocol.routes import _NAME, _NONNEG
from toolkit.wire.schema import Schema, limits

MAX_SHARD_UPDATES = 256
_SHARD = limits(max_len=2048)


@dataclass(frozen=True, kw_only=True)
class ShardLeaseRequest(Schema):
    """The next shard of dataset ``source`` (a ``[[dataset.sources]]`` name) for this peer."""

    source: str = field(metadata=_NAME)
    request_id: str = field(default="", metadata=limits(max_len=32))
    """Makes a retried request idempotent: the relay answers a repeated id with the lease it
    already granted, so a lost response never leaks a second lease."""


@dataclass(frozen=True, kw_only=True)
class ShardLease(Schema):
    source: str = field(metadata=_NAME)
    shard: str = field(metadata=_SHARD)
    """A path or URL ``datasets`` opens, exactly as the run's data_files resolve on the relay."""
    holders: int = field(metadata=limits(ge=1))
    """Leases on this shard now, this one included: > 1 only when every shard of the source is leased."""
    passes: int = field(metadata=_NONNEG)
    """Times the shard was read to its end and trained on, before this lease."""
    samples: int = field(metadata=_NONNEG)
    """Rows of it trained on so far, over all passes and peers."""


@dataclass(frozen=True, kw_only=True)
class ShardUpdate(Schema):
    source: str = field(metadata=_NAME)
    shard: str = field(metadata=_SHARD)
    samples: int = field(default=0, metadata=limits(ge=0, le=10**9))
    """Rows of the shard that reached training since this peer's last update (a delta)."""
    release: bool = False
    """The peer holds this shard no more (one lease ends)."""
    finished: bool = False
    """With ``release``: every row was read and trained on (one more pass over the shard)."""
    rows: int | None = field(default=None, metadata=limits(ge=0, le=10**12))
    """With ``finished``: the shard's row count as this peer counted it (the pool learns its size)."""


@dataclass(frozen=True, kw_only=True)
class ShardReport(Schema):
    """Progress and releases of several shards in one request (a peer batches them)."""

    updates: list[ShardUpdate] = field(metadata=limits(max_len=MAX_SHARD_UPDATES))
    request_id: str = field(default="", metadata=limits(max_len=32))
    """A repeated id (a retry whose first answer was lost) is acknowledged, not counted twice."""


@dataclass(frozen=True, kw_only=True)
class ShardReportAck(Schema):
    accepted: int = field(metadata=_NONNEG)
    unknown: list[str] = field(default_factory=list)
    """Shards (as sent) the pool does not have; their updates were dropped."""


@dataclass(frozen=True, kw_only=True)
class SourceCoverage(Schema):
    """One dataset's coverage; the list of these is the compact summary for ``/api/status``."""

    source: str
    shards: int
    leased: int
    """Shards held by at least one peer now."""
    started: int
    """Shards with at least one row trained on."""
    finished: int
    """Shards read to their end (and trained on) at least once."""
    min_passes: int
    """Complete passes over every shard of the dataset: its epoch count."""
    samples: int
    """Rows trained on, over all shards, passes and peers."""


@dataclass(frozen=True, kw_only=True)
class ShardCoverage(Schema):
    source: str
    shard: str
    samples: int
    passes: int
    rows: int | None
    """Row count, known once the shard was finished once."""
    holders: int


@dataclass(frozen=True, kw_only=True)
class ShardsReport(Schema):
    """``GET /api/shards``: the run's data coverage, per dataset and per shard."""

    sources: list[SourceCoverage]
    shards: list[ShardCoverage]
