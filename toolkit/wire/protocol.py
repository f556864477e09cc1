"""The wire protocol: every request and response body exchanged by peers and the relay.

One module, imported by both ``toolkit`` (the peer) and ``relay_server``. JSON bodies are the
:class:`Schema` dataclasses below; tensors travel in the safetensors container
(:mod:`toolkit.wire.tensor_container`). Routes are listed in :data:`ROUTES` so the relay's router and
the peer's client cannot disagree on a path.

Version rule (DESIGN.md section 3): a gradient computed on parameters of version ``v`` counts
toward round ``r`` (the round that produces version ``r + 1``) iff ``r - v <= max_staleness``.
``max_staleness = 0`` is strict large-batch SGD; ``1`` allows delayed parameter updates.
Otherwise the peer discards its accumulator and downloads the latest parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from toolkit.wire.schema import Schema, limits

PROTOCOL_VERSION = 3  # 3: rounds through extra aggregators (tickets, slices, manifests)

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
    """The codec of gradient uploads and parameter deltas (:mod:`toolkit.wire.compression`)."""
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
    plan_version: str = field(default="", metadata=limits(max_len=64))
    slices: list["PlanSlice"] = field(default_factory=list, metadata=limits(max_len=1024))
    """Where this round's gradient slices go (DESIGN.md s6). Empty: the relay owns the whole
    vector, and the peer uploads it in one piece as before (no ticket)."""


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
    finalized_by: Literal["all_arrived", "deadline", "peers_gone", "rollback", "recovery"]
    """"recovery": no round; a dead aggregator's slice was restored from the relay's copy."""
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

    aggregator_id: str = field(metadata=_ID)
    name: str = field(metadata=_NAME)
    start: int = field(metadata=_NONNEG)
    end: int = field(metadata=_NONNEG)
    fraction: float
    url: str = field(default="", metadata=limits(max_len=512))
    """Where peers upload this slice and download it back; empty = the relay itself."""


@dataclass(frozen=True, kw_only=True)
class PlanInput(Schema):
    """One node as the planner saw it. Rates in bytes/s, ``measured`` when they come from real
    transfers the relay or an aggregator served, ``prior`` (``aggregators.default_bandwidth_mbps``)
    until the first transfer; samples/s is the smoothed heartbeat figure."""

    node_id: str = field(metadata=_ID)
    name: str = field(metadata=_NAME)
    role: Literal["relay", "aggregator", "peer"]
    samples_per_s: float = field(metadata=_NONNEG)
    upload: float = field(metadata=_NONNEG)
    download: float = field(metadata=_NONNEG)
    upload_source: Literal["measured", "prior"] = "prior"
    download_source: Literal["measured", "prior"] = "prior"


@dataclass(frozen=True, kw_only=True)
class AggregatorStatus(Schema):
    """A registered aggregator server, whether or not the plan gives it a slice."""

    aggregator_id: str = field(metadata=_ID)
    name: str = field(metadata=_NAME)
    url: str = field(metadata=limits(max_len=512))
    alive: bool
    last_seen_s: float
    upload: float = 0.0
    """Bytes/s it measured sending parameters (0 = not measured yet)."""
    download: float = 0.0
    """Bytes/s it measured receiving gradients (0 = not measured yet)."""


@dataclass(frozen=True, kw_only=True)
class PlanInfo(Schema):
    """Who aggregates what (DESIGN.md s5); solved and published by the relay only."""

    version: str = field(metadata=limits(max_len=64))
    steps_per_s: float | None
    slices: list[PlanSlice]
    computes: dict[str, float] = field(default_factory=dict)
    inputs: list[PlanInput] = field(default_factory=list)
    """The measurements this plan was solved from."""
    predicted_round_s: float | None = None
    solved_at: float = 0.0
    """Unix time of the solve (0 for the relay-only plan)."""
    aggregators: list[AggregatorStatus] = field(default_factory=list)


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


# --- shard leases (toolkit.data.shards, relay_server.data.pool) ---------------------------------
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


# --- rounds through extra aggregators (relay_server.backbone.coordinator, relay_server.aggregator) ---------
# With aggregators, each owns a slice of the vector (the plan). A peer asks the relay for a
# ticket for the round (the relay checks samples, staleness and duplicates as it does for a
# whole-vector upload), uploads each slice to its owner with the ticket, then tells the relay
# it is done. The relay closes the round as before and has every owner finalize its slice; the
# new version is a manifest of slice hashes signed by the relay, and each slice is downloaded
# from its owner (ROUTES["params"] with start/end) and checked against that hash.
ROUTES.update({
    "plan": "/api/plan",
    "ticket": "/api/rounds/{step}/ticket",
    "done": "/api/rounds/{step}/done",
    # relay <-> aggregator, under the admin prefix: the admin token, never a peer's pass
    "aggregator_register": "/api/admin/aggregators/register",
    "aggregator_heartbeat": "/api/admin/aggregators/{aggregator_id}/heartbeat",
    "finalize": "/api/admin/finalize",
    "assign": "/api/admin/assign",
    "slice_state": "/api/admin/state",
})
TICKET_HEADER = "X-Collab-Ticket"
_HEX64 = limits(max_len=64)


@dataclass(frozen=True, kw_only=True)
class SliceDigest(Schema):
    """One slice upload's container header (``encode_header`` bytes), hashed: a ticket binds it,
    and in signed runs the header lists every data chunk's digest, so it binds the data too."""

    start: int = field(metadata=_NONNEG)
    end: int = field(metadata=_NONNEG)
    header_sha256: str = field(metadata=_HEX64)


@dataclass(frozen=True, kw_only=True)
class TicketRequest(Schema):
    round_id: str = field(metadata=limits(max_len=32))
    version: int = field(metadata=_NONNEG)
    samples: int = field(metadata=limits(gt=0, le=10**9))
    loss_sum: float
    slices: list[SliceDigest] = field(metadata=limits(max_len=1024))


@dataclass(frozen=True, kw_only=True)
class Ticket(Schema):
    """The relay's permission to upload one gradient to round ``round_id``, HMAC'd with a key the
    relay shares with its aggregators (``mac``, hex, over every other field)."""

    round_id: str = field(metadata=limits(max_len=32))
    step: int = field(metadata=_NONNEG)
    peer_id: str = field(metadata=_ID)
    samples: int = field(metadata=limits(gt=0, le=10**9))
    version: int = field(metadata=_NONNEG)
    plan_version: str = field(metadata=limits(max_len=64))
    expires_at: float
    slices: list[SliceDigest] = field(metadata=limits(max_len=1024))
    mac: str = field(default="", metadata=_HEX64)


@dataclass(frozen=True, kw_only=True)
class DoneRequest(Schema):
    """After the slice uploads: which slices (by start) an owner accepted, and whether any that
    failed may have been partly reduced (then the peer may not upload to this round again)."""

    round_id: str = field(metadata=limits(max_len=32))
    delivered: list[int] = field(metadata=limits(max_len=1024))
    partial: bool = False


@dataclass(frozen=True, kw_only=True)
class SliceVersion(Schema):
    aggregator_id: str = field(metadata=_ID)
    url: str = field(default="", metadata=limits(max_len=512))
    start: int = field(metadata=_NONNEG)
    end: int = field(metadata=_NONNEG)
    sha256: str = field(metadata=_HEX64)
    """Of the slice's float32 bytes, as the peer holds them after downloading."""


@dataclass(frozen=True, kw_only=True)
class ParamsManifest(Schema):
    """A published version made of slices (``GET /api/params`` when aggregators own slices;
    signed like every relay answer in signed runs)."""

    step: int = field(metadata=_NONNEG)
    num_params: int = field(metadata=limits(gt=0))
    plan_version: str = field(metadata=limits(max_len=64))
    slices: list[SliceVersion] = field(metadata=limits(max_len=1024))


@dataclass(frozen=True, kw_only=True)
class AggregatorRegistration(Schema):
    name: str = field(metadata=_NAME)
    url: str = field(metadata=limits(max_len=512))
    """Where peers and the relay reach this aggregator."""
    protocol: int


@dataclass(frozen=True, kw_only=True)
class AggregatorWelcome(Schema):
    aggregator_id: str = field(metadata=_ID)
    ticket_key: str = field(metadata=limits(max_len=128))
    """Hex HMAC key for tickets; known only to the relay and its aggregators."""
    run: RunInfo
    optimizer: dict[str, Any]
    """The run's ``[optimizer]`` section: the aggregator applies the same optimizer to its slice."""
    rounds: dict[str, Any] = field(default_factory=dict)
    """The run's ``[rounds]`` section (its aggregation rule: mean or CenteredClip)."""
    heartbeat_interval_s: float = field(metadata=limits(gt=0))


@dataclass(frozen=True, kw_only=True)
class TransferSample(Schema):
    """One transfer an aggregator served: a peer's slice upload (``up``) or download (``down``)."""

    peer_id: str = field(metadata=_ID)
    direction: Literal["up", "down"]
    step: int = field(metadata=_NONNEG)
    nbytes: int = field(metadata=_NONNEG)
    seconds: float = field(metadata=limits(gt=0))


@dataclass(frozen=True, kw_only=True)
class AggregatorHeartbeat(Schema):
    step: int = field(metadata=_NONNEG)
    plan_version: str = field(metadata=limits(max_len=64))
    upload: float = field(default=0.0, metadata=_NONNEG)
    """Bytes/s this aggregator sent while serving parameters (0 = not measured yet)."""
    download: float = field(default=0.0, metadata=_NONNEG)
    """Bytes/s it received while gradient uploads streamed in (0 = not measured yet)."""
    transfers: list[TransferSample] = field(default_factory=list, metadata=limits(max_len=4096))


@dataclass(frozen=True, kw_only=True)
class FinalizeRequest(Schema):
    step: int = field(metadata=_NONNEG)
    round_id: str = field(metadata=limits(max_len=32))
    plan_version: str = field(metadata=limits(max_len=64))


@dataclass(frozen=True, kw_only=True)
class SliceReport(Schema):
    """An owner's answer to finalize and assign: its slice's version and hash."""

    step: int = field(metadata=_NONNEG)
    start: int = field(metadata=_NONNEG)
    end: int = field(metadata=_NONNEG)
    sha256: str = field(metadata=_HEX64)
    peers: int = field(default=0, metadata=_NONNEG)
    grad_norm: float = field(default=0.0, metadata=_NONNEG)
    """Finalize: the slice's mean-gradient norm before clipping (the relay sums the squares)."""


@dataclass(frozen=True, kw_only=True)
class AssignRequest(Schema):
    """Own ``[start, end)`` from version ``step`` on: pull its state from the relay
    (``ROUTES["slice_state"]``); peers download that first version whole (no delta)."""

    plan_version: str = field(metadata=limits(max_len=64))
    step: int = field(metadata=_NONNEG)
    start: int = field(metadata=_NONNEG)
    end: int = field(metadata=_NONNEG)


# --- authentication (toolkit.wire.auth / toolkit.signing, relay_server.auth.access) ---------------------
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
