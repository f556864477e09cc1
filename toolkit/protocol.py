"""The wire protocol: every request and response body exchanged by peers and the relay.

One module, imported by both ``toolkit`` (the peer) and ``relay_server``. JSON bodies are the
:class:`Schema` dataclasses below; tensors travel in the safetensors container
(:mod:`toolkit.tensor_container`). Routes are listed in :data:`ROUTES` so the relay's router and
the peer's client cannot disagree on a path.

Version rule (DESIGN.md section 3): a gradient computed on parameters of version ``v`` counts
toward round ``r`` (the round that produces version ``r + 1``) iff ``r - v <= max_staleness``.
``max_staleness = 0`` is strict large-batch SGD; ``1`` allows delayed parameter updates.
Otherwise the peer discards its accumulator and downloads the latest parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from toolkit.schema import Schema, limits

PROTOCOL_VERSION = 2

ROUTES = {
    "run": "/api/run",
    "status": "/api/status",
    "progress": "/api/progress",
    "join": "/api/peers/join",
    "heartbeat": "/api/peers/{peer_id}/heartbeat",
    "leave": "/api/peers/{peer_id}/leave",
    "gradient": "/api/rounds/{step}/gradient",
    "params": "/api/params",
    "state": "/api/state",
    "login": "/api/auth/login",
    "refresh": "/api/auth/refresh",
}

MAX_JSON_BODY = 256 * 1024
_ID = limits(max_len=64)
_NAME = limits(max_len=128)
_NONNEG = limits(ge=0)


@dataclass(frozen=True, kw_only=True)
class ParamSpec(Schema):
    """One model parameter as the flat vector lays it out: ``flat[offset:offset+numel]``."""

    name: str = field(metadata=limits(max_len=512))
    shape: list[int]
    offset: int = field(metadata=_NONNEG)


@dataclass(frozen=True, kw_only=True)
class ModelSpec(Schema):
    """How peers build the run's model. ``factory`` must live under ``toolkit.models``: peers
    import code only from the toolkit they installed, never code chosen by the network."""

    factory: str = field(metadata=_NAME)
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class RunInfo(Schema):
    run_name: str = field(metadata=_NAME)
    protocol: int
    model: ModelSpec
    layout: list[ParamSpec]
    num_params: int = field(metadata=limits(gt=0))
    target_batch: int = field(metadata=limits(gt=0))
    total_steps: int = field(metadata=_NONNEG)
    max_staleness: int = field(metadata=limits(ge=0, le=8))
    heartbeat_interval_s: float = field(metadata=limits(gt=0))
    precision: str | None = None
    auth: str = field(default="open", metadata=limits(choices=("open", "hf")))
    """"hf": log in with a Hugging Face token (``RelayClient.login``) before joining."""
    compression: str = field(default="none", metadata=limits(choices=("none", "float16", "int8")))
    """The codec of gradient uploads and parameter deltas (:mod:`toolkit.compression`)."""
    dataset: dict[str, Any] = field(default_factory=dict)
    wandb: dict[str, str] = field(default_factory=dict)
    """Where peers log their own W&B runs: {"project", "entity"} (empty: nowhere)."""


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


@dataclass(frozen=True, kw_only=True)
class CollabState(Schema):
    """What every peer needs to decide its next move; returned by join and heartbeat."""

    step: int = field(metadata=_NONNEG)
    target_batch: int
    samples_accumulated: int = field(metadata=_NONNEG)
    samples_per_s: float = field(metadata=_NONNEG)
    eta_s: float | None
    num_peers: int = field(metadata=_NONNEG)
    round: RoundInfo | None
    finished: bool = False


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
class StateInfo(Schema):
    """The master parameters a newcomer downloads; ``sha256`` is over the float32 bytes."""

    step: int = field(metadata=_NONNEG)
    num_params: int
    sha256: str = field(metadata=limits(max_len=64))


@dataclass(frozen=True, kw_only=True)
class ErrorBody(Schema):
    error: str = field(metadata=_NAME)
    message: str
    hint: str = ""


@dataclass(frozen=True, kw_only=True)
class PeerStatus(Schema):
    peer_id: str
    name: str
    username: str
    device: str
    version: int
    samples_per_s: float
    samples_contributed: int
    last_seen_s: float
    online: bool
    precision: str | None = None
    """The precision policy the peer trains with (the collaboration must see every choice)."""
    first_contribution_s: float | None = None
    """Seconds from this peer's join to its first accepted gradient (None: not yet)."""


@dataclass(frozen=True, kw_only=True)
class RoundRecord(Schema):
    step: int
    """The version this round produced."""
    contributors: int
    samples: int
    loss: float | None
    duration_s: float
    deadline_s: float
    finalized_by: Literal["all_arrived", "deadline", "peers_gone", "rollback"]
    finalized_at: float = 0.0
    """Unix time, for throughput curves."""
    lr: float | None = None
    """The learning rate the step applied."""
    grad_norm: float | None = None
    """The averaged gradient's global norm (before clipping)."""


@dataclass(frozen=True, kw_only=True)
class LeaderboardEntry(Schema):
    """One volunteer's total contribution, by Hugging Face username (all their peers together)."""

    username: str
    samples: int
    rounds: int
    peers_online: int


@dataclass(frozen=True, kw_only=True)
class PlanSlice(Schema):
    """An aggregator owns ``[start, end)`` of the flat parameter vector: it reduces gradients and
    holds the master parameters and optimizer state for that slice."""

    aggregator_id: str
    name: str
    start: int = field(metadata=_NONNEG)
    end: int = field(metadata=_NONNEG)
    fraction: float


@dataclass(frozen=True, kw_only=True)
class PlanInfo(Schema):
    """Who aggregates what (DESIGN.md s5); solved and published by the relay only."""

    version: str = field(metadata=limits(max_len=64))
    steps_per_s: float | None
    slices: list[PlanSlice]
    computes: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class RunSummary(Schema):
    """The run's configuration as observers see it."""

    model: str
    num_params: int
    optimizer: str
    lr: float
    schedule: str
    target_batch: int
    max_staleness: int
    precision: str | None
    compression: str
    auth_mode: str


@dataclass(frozen=True, kw_only=True)
class StatusReport(Schema):
    """``GET /api/status``: everything the dashboard and the demo print."""

    run_name: str
    step: int
    total_steps: int
    finished: bool
    target_batch: int
    num_params: int
    samples_accumulated: int
    samples_per_s: float
    eta_s: float | None
    loss: float | None
    num_peers: int
    peers: list[PeerStatus]
    recent_rounds: list[RoundRecord]
    round: RoundInfo | None
    auth_mode: str
    uptime_s: float
    leaderboard: list[LeaderboardEntry] = field(default_factory=list)
    plan: PlanInfo | None = None
    config: RunSummary | None = None
    shards: list["SourceCoverage"] = field(default_factory=list)
    """Data coverage per dataset when the run leases shards (``GET /api/shards`` lists every shard)."""


# --- shard leases (toolkit.data.shards, relay_server.shards) ---------------------------------
# A peer asks the relay for the next shard of one dataset of the mix; the relay's pool answers
# with the least-processed shard nobody holds, or a shared copy of the least-held one when every
# shard is leased (a peer never idles). Progress and releases travel batched in one report. A
# lease ends when its peer releases it or leaves the registry (heartbeat TTL, or leave).
ROUTES.update({
    "shard_lease": "/api/peers/{peer_id}/shards/lease",
    "shard_report": "/api/peers/{peer_id}/shards/report",
    "shards": "/api/shards",
})

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


# --- authentication (toolkit.auth / toolkit.signing, relay_server.access) ---------------------
MAX_PASS_CHARS = 512


@dataclass(frozen=True, kw_only=True)
class LoginRequest(Schema):
    """``POST /api/auth/login``: the only message that carries the HF token (never in a URL)."""

    hf_token: str = field(repr=False, metadata=limits(max_len=512))
    peer_public_key: str = field(metadata=limits(max_len=64))
    """Raw Ed25519 public key, b64u (43 chars): the pass binds the username to it."""


@dataclass(frozen=True, kw_only=True)
class LoginResponse(Schema):
    """Answer to login and refresh. ``server_time`` lets the peer sign with the relay's clock."""

    access_pass: str = field(metadata=limits(max_len=MAX_PASS_CHARS))
    username: str = field(metadata=limits(max_len=96))
    issued_at: int
    expires_at: int
    server_time: float
    relay_public_key: str = field(metadata=limits(max_len=64))
    relay_key_id: str = field(metadata=limits(max_len=16))
    warnings: list[str] = field(default_factory=list, metadata=limits(max_len=8))
