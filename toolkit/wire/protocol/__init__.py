"""The wire protocol: every request and response body exchanged by peers, the relay and its
aggregators. Import from here (``from toolkit.wire.protocol import RoundInfo``): this package
re-exports every public name of its modules, which group the messages by concern.

JSON bodies are :class:`~toolkit.wire.schema.Schema` dataclasses; tensors travel in the
safetensors container (:mod:`toolkit.wire.tensor_container`). Lowest first, each module imports
only those above it:

    routes   PROTOCOL_VERSION, the ROUTES table (one, so router and client agree on every path),
             TICKET_HEADER, MAX_JSON_BODY, ErrorBody, and the field limits the others share
    run      RunInfo, ModelSpec, ParamSpec: the run a peer joins, and the flat vector's layout
    slices   rounds through extra aggregators: the plan (PlanInfo, PlanSlice, ...), tickets,
             slice digests, manifests, and the relay <-> aggregator messages
    rounds   RoundInfo, GradientMeta, UploadReceipt, RoundRecord, StateInfo; the version rule
    shards   shard leases and data coverage (ShardLease, ShardReport, ShardsReport, ...)
    peers    join, heartbeat and progress: JoinRequest/Response, Heartbeat, CollabState
    status   GET /api/status: StatusReport, PeerStatus, LeaderboardEntry, RunSummary, LossReference,
             EvalRecord, EvalSample, TrafficStatus, LocalSgdStatus, BatchProgress
    login    LoginRequest, LoginResponse (the HF login and the access pass)
    pipeline the staged pipeline: StageRequest/Assignment, PipelineWork/Task/Result, its tickets
    params   ParamsRef: a version's immutable body at the run's HTTP cache, and its cache headers
    moe      the expert routes: MoeSpec, MoeDirectory, LeaseRequest/ExpertLease, TaskBatch/TaskHead, ResultAck,
             CheckpointReceipt
"""

from __future__ import annotations

from toolkit.wire.protocol.login import MAX_PASS_CHARS, LoginRequest, LoginResponse
from toolkit.wire.protocol.moe import (
    CheckpointReceipt,
    ExpertLease,
    LeaseRequest,
    MoeDirectory,
    MoeSpec,
    ResultAck,
    TaskBatch,
    TaskHead,
)
from toolkit.wire.protocol.params import BLOB_CACHE_CONTROL, FRESH_CACHE_CONTROL, PARAMS_REF_TYPE, ParamsRef
from toolkit.wire.protocol.peers import CollabState, Heartbeat, JoinRequest, JoinResponse
from toolkit.wire.protocol.pipeline import (
    TASK_KINDS,
    PipelineAck,
    PipelineDone,
    PipelineResult,
    PipelineRoundCall,
    PipelineStatus,
    PipelineTask,
    PipelineTicketRequest,
    PipelineTraffic,
    PipelineWork,
    StageAssignment,
    StageRequest,
    StageStatus,
    TrustBan,
    TrustRollback,
    TrustStatus,
    WastedWork,
    WorkerCredit,
)
from toolkit.wire.protocol.rounds import GradientMeta, RoundInfo, RoundRecord, StateInfo, UploadReceipt
from toolkit.wire.protocol.routes import MAX_JSON_BODY, PROTOCOL_VERSION, ROUTES, TICKET_HEADER, ErrorBody
from toolkit.wire.protocol.run import ModelSpec, ParamSpec, RunInfo
from toolkit.wire.protocol.shards import (
    MAX_SHARD_UPDATES,
    ShardCoverage,
    ShardLease,
    ShardLeaseRequest,
    ShardReport,
    ShardReportAck,
    ShardsReport,
    ShardUpdate,
    SourceCoverage,
)
from toolkit.wire.protocol.slices import (
    AggregatorHeartbeat,
    AggregatorRegistration,
    AggregatorStatus,
    AggregatorWelcome,
    AssignRequest,
    DoneRequest,
    FinalizeRequest,
    GradNormReport,
    GradNormRequest,
    ParamsManifest,
    PlanInfo,
    PlanInput,
    PlanSlice,
    RelayLinkLoad,
    SliceDigest,
    SliceReport,
    SliceVersion,
    Ticket,
    TicketRequest,
    TransferSample,
)
from toolkit.wire.protocol.status import (
    PEER_ROLES,
    BatchProgress,
    EvalRecord,
    EvalSample,
    LeaderboardEntry,
    LocalSgdStatus,
    LossReference,
    PeerStatus,
    RunSummary,
    StatusReport,
    TrafficStatus,
)

__all__ = [
    # routes
    "PROTOCOL_VERSION",
    "ROUTES",
    "TICKET_HEADER",
    "MAX_JSON_BODY",
    "ErrorBody",
    # run
    "ParamSpec",
    "ModelSpec",
    "RunInfo",
    # slices
    "PlanSlice",
    "PlanInput",
    "AggregatorStatus",
    "PlanInfo",
    "RelayLinkLoad",
    "SliceDigest",
    "TicketRequest",
    "Ticket",
    "DoneRequest",
    "SliceVersion",
    "ParamsManifest",
    "AggregatorRegistration",
    "AggregatorWelcome",
    "TransferSample",
    "AggregatorHeartbeat",
    "FinalizeRequest",
    "SliceReport",
    "AssignRequest",
    "GradNormRequest",
    "GradNormReport",
    # rounds
    "RoundInfo",
    "GradientMeta",
    "UploadReceipt",
    "RoundRecord",
    "StateInfo",
    # shards
    "MAX_SHARD_UPDATES",
    "ShardLeaseRequest",
    "ShardLease",
    "ShardUpdate",
    "ShardReport",
    "ShardReportAck",
    "SourceCoverage",
    "ShardCoverage",
    "ShardsReport",
    # peers
    "CollabState",
    "JoinRequest",
    "JoinResponse",
    "Heartbeat",
    # status
    "PEER_ROLES",
    "PeerStatus",
    "LeaderboardEntry",
    "RunSummary",
    "StatusReport",
    "LossReference",
    "EvalRecord",
    "EvalSample",
    "TrafficStatus",
    "LocalSgdStatus",
    "BatchProgress",
    # login
    "MAX_PASS_CHARS",
    "LoginRequest",
    "LoginResponse",
    # pipeline
    "TASK_KINDS",
    "StageRequest",
    "StageAssignment",
    "PipelineTask",
    "PipelineRoundCall",
    "PipelineWork",
    "PipelineResult",
    "PipelineAck",
    "PipelineTicketRequest",
    "PipelineDone",
    "StageStatus",
    "PipelineStatus",
    "PipelineTraffic",
    "TrustBan",
    "TrustRollback",
    "TrustStatus",
    "WastedWork",
    "WorkerCredit",
    # params
    "PARAMS_REF_TYPE",
    "BLOB_CACHE_CONTROL",
    "FRESH_CACHE_CONTROL",
    "ParamsRef",
    # moe
    "MoeSpec",
    "MoeDirectory",
    "LeaseRequest",
    "ExpertLease",
    "TaskHead",
    "TaskBatch",
    "ResultAck",
    "CheckpointReceipt",
]
