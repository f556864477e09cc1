"""The staged pipeline's messages (``relay_server.pipeline``, ``toolkit.pipeline``).

A worker asks for a stage (:class:`StageRequest` -> :class:`StageAssignment`), then polls for
work: the answer is a tensor container whose metadata ``work`` is a :class:`PipelineWork` (the
tasks, and when a batch is complete the round this worker must upload to) and whose tensors are
each task's inputs, named ``{i}.x`` (the stage's input activation, or ``{i}.batch.<key>`` the
micro-batch's data for the first and last stages) and ``{i}.g`` (the gradient of the stage's
output). A result is a container with metadata ``result`` (:class:`PipelineResult`) and the
tensors ``y`` (a forward's output activation), ``g`` (a backward's input gradient) and, from the
first stage, ``batch.<key>`` (the data it read). Activations travel as [rows, width] matrices in
the run's boundary codec. The stage gradient goes up through the ticketed rounds every sliced run
uses (:class:`PipelineTicketRequest` -> :class:`~toolkit.wire.protocol.slices.Ticket`, then
``ROUTES["gradient"]`` with the ticket, then ``ROUTES["pipeline_done"]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from toolkit.wire.protocol.routes import _HEX64, _ID, _NONNEG
from toolkit.wire.schema import Schema, limits

TASK_KINDS = ("first", "forward", "last", "backward")
"""``first``: read a micro-batch of your own data, run stage 0, send its output and the data;
``forward``: run a middle stage on the input; ``last``: the last stage's forward, loss and
backward at once (1F1B), sending the gradient of its input; ``backward``: recompute the stage
from its stored input and send the gradient of that input (stage 0 sends none)."""


@dataclass(frozen=True, kw_only=True)
class StageRequest(Schema):
    """What a worker offers: its accelerator's free memory and measured speed (0: unknown)."""

    memory_bytes: int = field(default=0, metadata=_NONNEG)
    samples_per_s: float = field(default=0.0, metadata=_NONNEG)


@dataclass(frozen=True, kw_only=True)
class StageAssignment(Schema):
    """The stage a worker runs: layers ``[first_layer, end_layer)`` and the flat vector's
    ``[start, end)``, which is all it downloads, computes and uploads."""

    stage: int = field(metadata=_NONNEG)
    num_stages: int = field(metadata=limits(ge=2, le=64))
    layers_per_stage: list[int] = field(metadata=limits(max_len=64))
    start: int = field(metadata=_NONNEG)
    end: int = field(metadata=_NONNEG)
    microbatch_size: int = field(metadata=limits(gt=0))
    boundary_codec: str = field(metadata=limits(pattern=r"none|float16|int8|lowrank-[0-9]{1,4}"))
    width: int = field(metadata=limits(gt=0))
    """Features of every boundary activation (rows are samples x tokens)."""
    step: int = field(metadata=_NONNEG)
    """The published version the worker's first tasks need."""


@dataclass(frozen=True, kw_only=True)
class PipelineTask(Schema):
    task_id: str = field(metadata=_ID)
    kind: Literal["first", "forward", "last", "backward"]
    stage: int = field(metadata=_NONNEG)
    batch: int = field(metadata=_NONNEG)
    microbatch: int = field(metadata=_NONNEG)
    version: int = field(metadata=_NONNEG)
    """The parameters to compute with: every task of a batch uses the same version."""
    lease_s: float = field(metadata=limits(gt=0))
    """The relay re-dispatches the task if no result arrives within this."""
    input_cached: bool = False
    """The relay left out ``x``: this worker ran the forward and said it still holds the input."""
    replay: bool = False
    """A first-stage task of a batch a rollback undid: the micro-batch's data comes with it
    (``batch`` or ``batch.<key>``, as the first result that read it sent it); compute on it, not on
    your own data, and send it back as any first-stage result does."""
    redo: bool = False
    """Only the stage's parameter gradient is missing (its worker left before uploading it): the
    boundary gradient this backward produces was delivered already and is not sent again."""


@dataclass(frozen=True, kw_only=True)
class PipelineRoundCall(Schema):
    """A batch is complete: upload the stage gradient of exactly these micro-batches."""

    step: int = field(metadata=_NONNEG)
    round_id: str = field(metadata=limits(max_len=32))
    stage: int = field(metadata=_NONNEG)
    microbatches: list[int] = field(metadata=limits(max_len=4096))
    contributor: str = field(metadata=_ID)
    """The id the upload's gradient metadata names (the ticket is issued to it)."""


@dataclass(frozen=True, kw_only=True)
class PipelineWork(Schema):
    stage: int = field(metadata=_NONNEG)
    """The worker's stage now (a different one than it holds: the planner moved it)."""
    tasks: list[PipelineTask] = field(default_factory=list, metadata=limits(max_len=64))
    round: PipelineRoundCall | None = None
    cached: list[int] = field(default_factory=list, metadata=limits(max_len=4096))


@dataclass(frozen=True, kw_only=True)
class PipelineResult(Schema):
    task_id: str = field(metadata=_ID)
    loss_sum: float = 0.0
    """The last stage: the micro-batch's loss times its samples."""


@dataclass(frozen=True, kw_only=True)
class PipelineAck(Schema):
    task_id: str = field(metadata=_ID)
    accepted: bool
    """False: another worker's result for this task came first; drop this task's gradient."""


@dataclass(frozen=True, kw_only=True)
class PipelineTicketRequest(Schema):
    round_id: str = field(metadata=limits(max_len=32))
    stage: int = field(metadata=_NONNEG)
    microbatches: list[int] = field(metadata=limits(max_len=4096))
    loss_sum: float = 0.0
    header_sha256: str = field(metadata=_HEX64)
    """sha256 of the stage gradient's container header (binds the ticket to the upload)."""


@dataclass(frozen=True, kw_only=True)
class PipelineDone(Schema):
    round_id: str = field(metadata=limits(max_len=32))
    contributor: str = field(metadata=_ID)
    delivered: bool
    """False: the upload failed; the relay recomputes those micro-batches' stage gradient."""


@dataclass(frozen=True, kw_only=True)
class WorkerCredit(Schema):
    """One stage worker's work as the relay counted it since it started: ``tasks`` whose result
    it accepted first, and ``samples`` credited when batches committed (a micro-batch's samples
    for each stage whose gradient of it this worker delivered: what the leaderboard credits).
    ``GET ROUTES["pipeline_credit"]`` answers a worker with its own; ``PipelineStatus.workers``
    lists the workers online."""

    peer_id: str = field(metadata=_ID)
    stage: int | None = None
    """The stage it runs now (None: it left, or has none yet)."""
    tasks: int = field(default=0, metadata=_NONNEG)
    samples: int = field(default=0, metadata=_NONNEG)


@dataclass(frozen=True, kw_only=True)
class PipelineTraffic(Schema):
    """The pipeline's bytes through the relay since it started, by what they carry. Up:
    ``boundaries_up`` (task results: activations, their gradients, the first stage's data) and
    ``stage_gradients_up`` (each worker's stage gradient, once per batch it holds some of);
    down: ``boundaries_down`` (work answers: task inputs) and ``stage_params_down`` (each
    worker's stage parameters, once per version it computes on). All four are also in
    ``StatusReport.traffic``."""

    boundaries_up: int = 0
    boundaries_down: int = 0
    stage_gradients_up: int = 0
    stage_params_down: int = 0


@dataclass(frozen=True, kw_only=True)
class WastedWork(Schema):
    """Work a batch paid for twice: ``redispatched`` tasks (a lease lapsed or its worker left:
    the task ran, or began, again elsewhere), ``recomputed`` stage gradients (their holder left
    or failed to deliver: a redo task recomputed them) and ``refused`` results (a duplicate that
    came after another worker's result for the same task)."""

    batch: int
    redispatched: int = 0
    recomputed: int = 0
    refused: int = 0


@dataclass(frozen=True, kw_only=True)
class StageStatus(Schema):
    stage: int
    layers: list[int]
    """[first, end) of the model's layers."""
    params: int
    workers: list[str]
    queued: int
    leased: int
    lease_s: float
    task_s: float | None
    """The measured time of this stage's tasks (None: none finished yet)."""


@dataclass(frozen=True, kw_only=True)
class TrustBan(Schema):
    worker: str
    reason: str
    batch: int


@dataclass(frozen=True, kw_only=True)
class TrustRollback(Schema):
    """What a ban undid: its committed batches rolled back, or why not (``outcome``)."""

    worker: str
    outcome: str
    """"rolled back", "too late" (its first unchecked result is older than ``rollback_batches``),
    "nothing counted unchecked", "a rollback was in progress", or "failed" (the relay's log says why)."""
    at_version: int
    """The published version when the ban came."""
    to_version: int | None = None
    """The version every stage returned to (the first batch holding an unchecked result of it)."""
    published_as: int | None = None
    """The version that holds that state (versions only move forward)."""
    batches_undone: int = 0
    batches_replayed: int = 0
    """Undone committed batches computed again on the first-stage data kept for them: their
    micro-batch ids' first-stage tasks carry it (``[pipeline] rollback_batches`` keeps it)."""
    microbatches_replayed: int = 0
    """Micro-batches whose first-stage task carries its kept data: those batches', and those of the
    batch in flight whose data had been read (the rest of it reads fresh data)."""


@dataclass(frozen=True, kw_only=True)
class TrustStatus(Schema):
    """What the relay's spot checks and monitors of stage workers' results found so far."""

    check_share: float
    """The base share: the probability a result of a worker past its probation is checked."""
    tolerance: float
    """The relative L2 distance two honest results of one task may have (the run's precision and codec)."""
    probation: int = 0
    """Checks a new worker's results are chosen for at a raised share (1, 1/2, 1/4, ...) first."""
    probation_checks: int = 0
    """Checks chosen above the base share because their worker was on probation (their cost)."""
    on_probation: list[str] = field(default_factory=list)
    """Workers whose share is still raised by their probation."""
    checks: int = 0
    """Results chosen for a check."""
    agreed: int = 0
    disagreed: int = 0
    refereed: int = 0
    """Tasks the relay computed itself (checked first-stage results, disagreements)."""
    unserved: int = 0
    """Checks dropped because no other worker of the stage (nor the relay's copy) could compute them."""
    pending: int = 0
    max_agreeing_distance: float = 0.0
    """The largest distance measured between results that agreed: the tolerance's margin."""
    batches_restarted: int = 0
    bans: list[TrustBan] = field(default_factory=list)
    rollback_batches: int = 0
    """Committed batches a late ban can undo (``[pipeline] rollback_batches``)."""
    kept_input_bytes: int = 0
    """The first-stage data the relay keeps for a rollback's replay (the window's batches and a replay not yet counted)."""
    rollbacks: list[TrustRollback] = field(default_factory=list)
    """What each ban undid, oldest first (:mod:`relay_server.pipeline.rollback`)."""
    monitored: int = 0
    """Boundaries the statistical monitors scored (every accepted one)."""
    outliers: int = 0
    suspects: list[str] = field(default_factory=list)
    """Workers whose every result is checked now (the monitors found them odd)."""
    gradient_audits: int = 0
    """Stage-gradient uploads chosen for an audit against the relay's own sum (relay_server.trust.gradient_audit)."""
    gradient_audits_agreed: int = 0
    gradient_lies: int = 0
    """Audited uploads refused beyond the tolerance (their workers banned)."""
    gradient_audits_unserved: int = 0
    """Audits the relay could not compute (another version, a codec it cannot compare through, too late)."""
    gradient_audit_microbatches: int = 0
    """Backwards the relay computed for its audits (their compute, in tasks)."""
    gradient_audit_probation_microbatches: int = 0
    """Of those, the ones of new workers' first uploads (a fixed cost per joining worker)."""
    max_audit_distance: float = 0.0
    """The largest distance of an audited upload that agreed: the audit tolerance's margin."""


@dataclass(frozen=True, kw_only=True)
class PipelineStatus(Schema):
    """``GET /api/pipeline``: the stages, the batch in flight, the boundaries and the plan."""

    stages: list[StageStatus]
    batch: int
    microbatches: int
    finished: int
    round_open: bool
    boundary_memory_bytes: int
    boundary_spilled_bytes: int
    boundary_bytes_per_sample: float | None
    predicted_batch_s: float | None
    measured_batch_s: float | None
    redispatched: int
    redone: int
    refused_results: int
    silenced: int = 0
    """Workers found silent holding stage gradients, whose gradients were recomputed."""
    restarted: int = 0
    """``dispatch = "restart"`` only: micro-batches started again from stage 0."""
    counted: list[list[int]] = field(default_factory=list)
    """The samples each stage's parameter server counted, per recent round (exactly the batch's)."""
    expired_holds: int = 0
    """Workers whose held stage gradients passed the hold deadline uncommitted and were recomputed."""
    lapsed_leases: int = 0
    """Leases that passed their deadline without a result (each a strike against its worker)."""
    hold_deadline_s: list[float] = field(default_factory=list)
    """Per stage: the seconds a holder has, from the round's opening, to commit its stage gradient."""
    cut_uploads: int = 0
    """Stage-gradient uploads cut for running past their stage's hold deadline (recomputed)."""
    refused_steps: int = 0
    """Batches in which some stage refused its step because it would have made parameters non-finite."""
    tasks_done: int = 0
    """Tasks of the batch in flight whose result was accepted (a redo's undone one counts again when redone)."""
    tasks_total: int = 0
    """Tasks one batch needs: ``microbatches`` x (2 x stages - 1) (a forward per stage, a backward per stage but the last)."""
    eta_s: float | None = None
    """Seconds until the batch in flight commits, from the measured batch time and the tasks left
    (None before a batch was measured)."""
    workers: list[WorkerCredit] = field(default_factory=list)
    """The workers online, each with the tasks and samples the relay credited it."""
    traffic: PipelineTraffic | None = None
    wasted: list[WastedWork] = field(default_factory=list)
    """Per recent committed batch, oldest first (totals: ``redispatched``, ``redone``, ``refused_results``)."""
    wasted_now: WastedWork | None = None
    """The batch in flight's so far."""
    trust: TrustStatus | None = None
    """Spot checks, monitors and bans of workers caught lying (``[pipeline] check_share``)."""
