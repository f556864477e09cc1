"""Rounds through extra aggregators (``relay_server.backbone``, ``relay_server.aggregator``).

The relay's plan (:class:`PlanInfo`) cuts the flat vector into slices, each owned by an aggregator
(or the relay). A peer asks the relay for a :class:`Ticket` for the round (the relay checks
samples, staleness and duplicates as it does for a whole-vector upload), uploads each slice to its
owner with the ticket, then tells the relay it is done (:class:`DoneRequest`). The relay closes the
round as before and has every owner finalize its slice; the new version is a manifest of slice
hashes signed by the relay (:class:`ParamsManifest`), and each slice is downloaded from its owner
(``ROUTES["params"]`` with start/end) and checked against that hash. The relay <-> aggregator
messages (registration, heartbeat, grad norm, finalize, assign) travel under the admin prefix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from toolkit.wire.protocol.routes import _HEX64, _ID, _NAME, _NONNEG
from toolkit.wire.protocol.run import RunInfo
from toolkit.wire.schema import Schema, limits


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
class RelayLinkLoad(Schema):
    """What crosses the relay's own link per step under a plan, in bytes (predicted from the
    peers online, the codec, the run's cache and the copy intervals, not measured)."""

    peers: int = field(metadata=_NONNEG)
    out_per_step: float = field(metadata=_NONNEG)
    in_per_step: float = field(metadata=_NONNEG)
    parameters_out: float = field(metadata=_NONNEG)
    """Peers downloading the relay's slice (the int8 delta on lossy runs); with ``[server]
    public_params_url`` and no aggregators, one body to the cache plus a small ref per peer."""
    gradients_in: float = field(metadata=_NONNEG)
    """Peers uploading their gradient of the relay's slice."""
    recovery_copy_in: float = field(metadata=_NONNEG)
    """Remote slices pulled into the relay's recovery copy, averaged over steps: parameters every
    ``aggregators.params_copy_every`` steps, the whole state every ``state_copy_every``."""
    migration_bytes: float = field(metadata=_NONNEG)
    """What one plan change moving slices costs the relay's link (once, not per step): the remote
    owners' state in, the new remote owners' state out."""
    cached: bool = False
    """Whether peers fetch the parameters through the run's HTTP cache."""


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
    relay_link: RelayLinkLoad | None = None
    """The relay's link load per step under this plan (None from an older relay)."""


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
class GradNormRequest(Schema):
    """Close round ``round_id`` of ``step`` and answer the squared L2 norm of the slice's mean
    gradient (:class:`GradNormReport`), without stepping. Asked of every owner before finalize,
    only while ``optimizer.clip_grad_norm > 0``: the relay sums the squares into the global norm
    every owner then clips by (``FinalizeRequest.grad_norm``)."""

    step: int = field(metadata=_NONNEG)
    round_id: str = field(metadata=limits(max_len=32))
    plan_version: str = field(metadata=limits(max_len=64))


@dataclass(frozen=True, kw_only=True)
class GradNormReport(Schema):
    step: int = field(metadata=_NONNEG)
    """The round's step (the slice has not stepped yet)."""
    round_id: str = field(metadata=limits(max_len=32))
    start: int = field(metadata=_NONNEG)
    end: int = field(metadata=_NONNEG)
    sq_norm: float = field(metadata=_NONNEG)
    """Squared L2 norm of the slice's mean gradient (finite: the schema refuses NaN/inf)."""


@dataclass(frozen=True, kw_only=True)
class FinalizeRequest(Schema):
    step: int = field(metadata=_NONNEG)
    round_id: str = field(metadata=limits(max_len=32))
    plan_version: str = field(metadata=limits(max_len=64))
    grad_norm: float | None = field(default=None, metadata=_NONNEG)
    """The mean gradient's global norm to clip by (``optimizer.clip_grad_norm > 0``); None: the
    slice's own norm (no clipping configured). Left out of the body when None, so a finalize
    without clipping is the same bytes as before this field existed."""

    def dumps(self) -> bytes:
        body = self.to_json()
        if body["grad_norm"] is None:
            del body["grad_norm"]
        return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


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
    refused: bool = False
    """Finalize: the step would have made this slice non-finite, so the version holds the slice
    unchanged (the relay counts it in ``StatusReport.refused_steps``)."""


@dataclass(frozen=True, kw_only=True)
class AssignRequest(Schema):
    """Own ``[start, end)`` from version ``step`` on: pull its state from the relay
    (``ROUTES["slice_state"]``); peers download that first version whole (no delta)."""

    plan_version: str = field(metadata=limits(max_len=64))
    step: int = field(metadata=_NONNEG)
    start: int = field(metadata=_NONNEG)
    end: int = field(metadata=_NONNEG)
