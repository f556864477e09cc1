"""``GET /api/status``: what the dashboard, the demo and observers see of the collaboration
(peers, recent rounds, leaderboard, plan, data coverage, the run's configuration).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from toolkit.wire.protocol.rounds import RoundInfo, RoundRecord
from toolkit.wire.protocol.shards import SourceCoverage
from toolkit.wire.protocol.slices import PlanInfo
from toolkit.wire.schema import Schema

PEER_ROLES = ("trainer", "expert_host", "stage_worker")
"""What a peer does in the run, and so which of :class:`PeerStatus`'s fields apply to it."""


@dataclass(frozen=True, kw_only=True)
class PeerStatus(Schema):
    """One peer online, in its role: a ``trainer`` (data-parallel: device, its reported samples/s,
    samples contributed, first contribution), an ``expert_host`` (``experts_hosted``; it trains
    nothing, so it has no samples/s or contribution) or a ``stage_worker`` of a pipeline run
    (``stage``; its work is counted per stage in ``StatusReport.pipeline``)."""

    peer_id: str
    name: str
    username: str
    device: str
    version: int
    samples_per_s: float
    """The peer's own report (trainers), bounded: at most ten times the rate at which its progress
    reports said its samples grew since it joined, 0 before any grew (``samples_per_s_capped`` says
    when it was cut). A self-report, never the collaboration's measured figure."""
    samples_contributed: int
    last_seen_s: float
    online: bool
    role: str = "trainer"
    """One of :data:`PEER_ROLES`."""
    samples_per_s_capped: bool = False
    """The peer reported more samples/s than its reports' growth makes plausible: shown at the bound."""
    experts_hosted: int | None = None
    """``expert_host``: the experts it holds now."""
    stage: int | None = None
    """``stage_worker``: the pipeline stage it runs (None: not assigned yet)."""
    precision: str | None = None
    """The precision policy the peer trains with (the collaboration must see every choice)."""
    first_contribution_s: float | None = None
    """Seconds from this peer's join to its first accepted gradient (None: not yet)."""
    inner_steps: int | None = None
    """``run.mode = "local_sgd"``: inner steps the peer took since its last outer round, as its
    last heartbeat said (None in sync mode)."""
    busy_fraction: float | None = None
    """``run.mode = "local_sgd"``: the share of the peer's training time spent computing rather
    than waiting in outer rounds, as its last heartbeat said (None: not measured yet, or sync mode)."""
    tasks_done: int | None = None
    """``stage_worker``: the tasks whose result the relay accepted from it since it started (its
    ``samples_contributed`` are the samples credited to it as batches committed)."""


@dataclass(frozen=True, kw_only=True)
class LeaderboardEntry(Schema):
    """One volunteer's total contribution, by Hugging Face username (all their peers together)."""

    username: str
    samples: int
    rounds: int
    peers_online: int


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
    mode: str = "sync"
    """How the run makes a step: "sync" (one averaging round per optimizer step), "local_sgd"
    (``run.mode``), or "pipeline" (a ``[pipeline]`` run: stages on a task pool, no averaging)."""


@dataclass(frozen=True, kw_only=True)
class TrafficStatus(Schema):
    """The training bytes this relay moved since it started, per sample its rounds applied: what
    low-bandwidth runs are judged by. ``up_bytes``: the bodies of the gradient or
    pseudo-gradient uploads it accepted (header included); ``down_bytes``: the parameter bodies
    it served (full and delta, on ``GET /api/params`` and the immutable cache URLs), and the
    cache refs. With aggregators, the slices other owners receive and serve are not in here."""

    up_bytes: int
    down_bytes: int
    samples: int
    """Samples of the rounds applied since the relay started."""
    up_bytes_per_sample: float | None = None
    """``up_bytes / samples`` (None before the first applied round)."""
    down_bytes_per_sample: float | None = None
    """``down_bytes / samples`` (None before the first applied round)."""


@dataclass(frozen=True, kw_only=True)
class BatchProgress(Schema):
    """How far the step in flight is, on a run whose step is not a round of samples uploaded by
    peers (a pipeline's batch: ``unit`` "tasks", the micro-batch tasks of the batch)."""

    unit: str
    done: int
    total: int
    eta_s: float | None = None
    """Seconds until the step commits, by the relay's measured step time (None: none measured yet)."""


@dataclass(frozen=True, kw_only=True)
class LocalSgdStatus(Schema):
    """``run.mode = "local_sgd"``: where the outer loop stands and how the peers spend their time."""

    outer_round: int
    """Outer rounds applied: the run's step."""
    inner_steps: int
    """H: inner steps per outer round (0: only the time budget counts)."""
    inner_seconds: float
    """The inner time budget per outer round (0: only H counts)."""
    busy_fraction: float | None = None
    """The mean of the online peers' busy fractions (None: none measured yet)."""
    inner_steps_last_round: float | None = None
    """Mean inner steps behind the pseudo-gradients of the last outer round (None: none yet)."""


@dataclass(frozen=True, kw_only=True)
class LossReference(Schema):
    """A loss worth comparing the run's to, computed by the relay from the run's configuration:
    ``chance`` (a uniform guess over the targets: ln of the vocabulary or of the labels) or
    ``unigram`` (each target's frequency in the shipped demo text, ignoring its context)."""

    name: str
    value: float
    label: str
    """What the dashboard and the demo print next to the value, e.g. "chance: ln 2000"."""


@dataclass(frozen=True, kw_only=True)
class EvalSample(Schema):
    """What the model said to one of the run's fixed prompts (``[evaluation] prompts``)."""

    prompt: str
    kind: str
    """"fill-mask" (masked-LM: the top tokens at the first mask), "continuation" (causal and byte
    models: a short greedy continuation) or "label" (classification: the predicted label)."""
    output: str
    """The continuation, the predicted label, or the top tokens joined by spaces."""
    tokens: list[str] = field(default_factory=list)
    """fill-mask: the top tokens, best first."""
    scores: list[float] = field(default_factory=list)
    """fill-mask and label: each answer's probability."""


@dataclass(frozen=True, kw_only=True)
class EvalRecord(Schema):
    """One published version evaluated on the run's held-out validation batches."""

    step: int
    loss: float
    """Mean cross-entropy per target (masked token, next token, label or byte)."""
    perplexity: float | None = None
    """exp(loss), for language models (on masked tokens only, for a masked-LM)."""
    accuracy: float | None = None
    """Masked-token or label accuracy (masked-LM, classification)."""
    targets: int = 0
    """How many targets the loss averages over."""
    duration_s: float = 0.0
    """Seconds the evaluation took (on the relay's bounded evaluator threads)."""
    samples: list[EvalSample] = field(default_factory=list)
    """The fixed prompts on this version (in /api/status: on the latest record only)."""


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
    """Measured by the relay: the samples its last rounds applied over the time they took
    (``samples_per_s_rounds`` of them; 0 before two rounds finished), falling while no round
    finishes. Not the peers' reports (``reported_samples_per_s``)."""
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
    experts: dict[str, Any] | None = None
    """Runs with ``[moe]``: experts live/total, calls/s and failure rate over the last minute,
    experts per host, queued rows (``relay_server.moe.state.Experts.summary``)."""
    pipeline: dict[str, Any] | None = None
    """Runs with ``[pipeline]``: the stages, their workers and queues, the batch in flight, the
    boundary bytes, predicted vs measured time per batch (:class:`~toolkit.wire.protocol.PipelineStatus`)."""
    loss_references: list[LossReference] = field(default_factory=list)
    """Chance level and, on the demo text, its unigram entropy: where the loss curve stands."""
    evaluations: list[EvalRecord] = field(default_factory=list)
    """Runs with ``[evaluation]``: the validation metrics of recent evaluated versions, oldest
    first; the last one carries the samples ("what the model says now")."""
    traffic: TrafficStatus | None = None
    """Training bytes both ways per applied sample (every run)."""
    local_sgd: LocalSgdStatus | None = None
    """Runs with ``run.mode = "local_sgd"``: the outer round, H and the time budget, the peers' busy fraction."""
    samples_per_s_rounds: int = 0
    """How many finished rounds ``samples_per_s`` was measured over."""
    reported_samples_per_s: float = 0.0
    """The trainers' self-reported samples/s, each bounded (``PeerStatus.samples_per_s``), summed:
    what the peers say they compute, beside what the rounds applied."""
    progress: BatchProgress | None = None
    """Runs whose step is not a round of samples (pipeline): the step in flight's progress in its
    own unit; ``samples_accumulated`` then counts the samples of finished micro-batches."""
    refused_steps: int = 0
    """Rounds whose step the relay refused because it would have made the parameters or the
    optimizer state non-finite: on a single relay nothing was published (the next round starts
    from the same version); in a sliced round the refusing slices were published unchanged.
    Non-zero means some accepted gradients or the run's settings were extreme: look at the
    round's peers and the learning rate."""

    def dumps(self) -> bytes:
        """Never fails on a number: one inf that reached a statistic made every poll
        of the dashboard and every observer fail. The relay keeps its statistics finite; should
        one still be NaN or Inf, it is shown as null (the fast path is the plain dump)."""
        try:
            return super().dumps()
        except ValueError:  # allow_nan=False met a NaN or Inf
            return json.dumps(_finite_json(self.to_json()), separators=(",", ":"), allow_nan=False).encode()


def _finite_json(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_json(v) for v in value]
    return value
