"""What every message module shares: the protocol version, every route, the header and size
limits, the error body any route may answer with, and the field limits the schemas reuse.

Routes are listed in one table so the relay's router and the peer's client cannot disagree on a
path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.wire.schema import Schema, limits

# 8: a pipeline run's own figures (StatusReport.progress, PeerStatus.tasks_done, PipelineStatus's tasks,
# workers, traffic and wasted work, WorkerCredit on ROUTES["pipeline_credit"]); 7: refusal counts (StatusReport.refused_steps, SliceReport's refused step, PipelineStatus.cut_uploads
# and refused_steps), capability parameter URLs on hf runs; 6: the inner learning-rate schedule in RunInfo.local_sgd; 5: RunInfo.download_compression and topk2
# codecs; 4: local SGD runs (RunInfo.local_sgd), HTTP-cache refs, typed DMoE messages; 3: aggregators
PROTOCOL_VERSION = 8

ROUTES = {
    "run": "/api/run",
    "status": "/api/status",
    "progress": "/api/progress",
    "join": "/api/peers/join",
    "heartbeat": "/api/peers/{peer_id}/heartbeat",
    "leave": "/api/peers/{peer_id}/leave",
    "gradient": "/api/rounds/{step}/gradient",
    "params": "/api/params",
    # immutable parameter bodies any HTTP cache may serve (.params); ``tag``: the sha256 on open
    # runs, a capability on signed ones (relay_server/api/params_cache.py says why)
    "params_blob": "/api/params/v/{step}/{tag}/{kind}",
    "params_egress": "/api/admin/params/egress",  # the organizer's: the admin token, as under /api/admin
    "state": "/api/state",
    "login": "/api/auth/login",
    "refresh": "/api/auth/refresh",
    "tokenizer": "/api/tokenizer",
    # shard leases (.shards)
    "shard_lease": "/api/peers/{peer_id}/shards/lease",
    "shard_report": "/api/peers/{peer_id}/shards/report",
    "shards": "/api/shards",
    # rounds through extra aggregators (.slices)
    "plan": "/api/plan",
    "ticket": "/api/rounds/{step}/ticket",
    "done": "/api/rounds/{step}/done",
    # decentralized mixture-of-experts (toolkit.wire.payloads: bodies are tensor containers)
    "moe_spec": "/api/moe/spec",
    "moe_directory": "/api/moe/directory",
    "moe_call": "/api/moe/peers/{peer_id}/calls/{uid}",
    "moe_lease": "/api/moe/hosts/{peer_id}/lease",
    "moe_tasks": "/api/moe/hosts/{peer_id}/tasks",
    "moe_result": "/api/moe/hosts/{peer_id}/tasks/{task_id}",
    "moe_checkpoint": "/api/moe/hosts/{peer_id}/experts/{uid}/checkpoint",
    # the staged pipeline (.pipeline: work and results are tensor containers)
    "pipeline": "/api/pipeline",
    "pipeline_stage": "/api/pipeline/workers/{peer_id}/stage",
    "pipeline_work": "/api/pipeline/workers/{peer_id}/work",
    "pipeline_result": "/api/pipeline/workers/{peer_id}/tasks/{task_id}",
    "pipeline_ticket": "/api/pipeline/workers/{peer_id}/rounds/{step}/ticket",
    "pipeline_done": "/api/pipeline/workers/{peer_id}/rounds/{step}/done",
    "pipeline_credit": "/api/pipeline/workers/{peer_id}/credit",
    # relay <-> aggregator, under the admin prefix: the admin token, never a peer's pass
    "aggregator_register": "/api/admin/aggregators/register",
    "aggregator_heartbeat": "/api/admin/aggregators/{aggregator_id}/heartbeat",
    "grad_norm": "/api/admin/grad_norm",
    "finalize": "/api/admin/finalize",
    "assign": "/api/admin/assign",
    "slice_state": "/api/admin/state",
}
TICKET_HEADER = "X-Collab-Ticket"
MAX_JSON_BODY = 256 * 1024

# Field limits the message modules of this package share (``field(metadata=_ID)``).
_ID = limits(max_len=64)
_NAME = limits(max_len=128)
_NONNEG = limits(ge=0)
_HEX64 = limits(max_len=64)


@dataclass(frozen=True, kw_only=True)
class ErrorBody(Schema):
    error: str = field(metadata=_NAME)
    message: str
    hint: str = ""
