"""The star's inputs, outputs and time model: what the paper's Eq. 1-2
(``research.hetero_pipeline.timemodel``) reduce to when one relay holds every stage boundary and
volunteers only dial out. :mod:`.star` plans with it; the relay publishes
:meth:`StagePlan.to_json` at ``/api/pipeline``.

Why it is simpler than the paper's: every worker reaches every stage through the same link (its
own to the relay), so there is no server graph, no stage order to search and no frontal/backward
split; the inter-stage hops of Eq. 2 are the relay handing a boundary from one queue to the next,
in process. What is left is each worker's round trips, bytes and compute per task, and memory.

A task is a whole micro-batch (the task pool leases micro-batches, not slices of one), so a
stage's workers share the batch's ``d`` micro-batches by speed: a stage finishes its batch in
``d / sum_i 1/tau_i`` where ``tau_i`` is worker i's time for one task pair, and the batch takes
the slowest stage's time (Eq. 2: ``d * max_k DT_k`` with ``DT_k = 1 / sum_i 1/tau_i``), times
``(d + K - 1) / d`` for 1F1B's fill and drain (the partition planner's ``warmup``). Per
micro-batch a worker of stage k (``K > 1`` stages, ``a`` boundary bytes per sample, ``m``
samples per micro-batch, ``h_k`` layers, ``c_i`` its layer-samples per second):

* first stage: a forward task (lease; upload its output) and a backward task (lease with the
  output gradient; recompute from its own tokens; ack): 4 round trips, ``2 m a`` bytes;
* middle stage: forward (download input, upload output) and backward (download the input again
  and the output gradient, upload the input gradient): 4 round trips, ``5 m a`` bytes;
* last stage: one fused task (download input, loss and backward, upload input gradient):
  2 round trips, ``2 m a`` bytes;
* compute ``work * m * h_k / c_i`` with ``work`` = 4/3 where backward recomputes the forward
  (forward 1/3 of a training step, twice, plus backward 2/3) and 1 in the fused last stage.

One stage (``K = 1``) is data parallelism: no boundary, no tasks, ``d m L / sum c``. Memory: a
worker of stage k holds ``(h_k * layer_params + fixed_k) * bytes_per_param`` bytes, ``fixed_k``
the embeddings on the first stage and the head on the last.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from toolkit.wire.compression.lowrank import lowrank_rank

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

CODEC_BYTES = {"float32": 4, "none": 4, "float16": 2, "bfloat16": 2, "int8": 1}
"""Bytes per boundary element by codec; int8 adds one float32 scale per token row."""


class StagePlanError(ValueError):
    """A stage plan that cannot exist (memory, too few workers or layers); the message says which
    input to change."""


def boundary_bytes_per_sample(codec: str, width: int, tokens: int) -> float:
    """Bytes of one sample's activation (or gradient) at a stage boundary: ``tokens`` rows of
    ``width`` values in ``codec``."""
    rank = lowrank_rank(codec)
    if rank is not None:  # per micro-batch r (rows + width) + 4 r: per sample at most one sample's rows
        return float(min(rank, tokens, width) * (tokens + width) + 4 * rank)
    if codec not in CODEC_BYTES:
        raise StagePlanError(f"boundary codec {codec!r} is not one of {sorted(CODEC_BYTES)}")
    return float(tokens * (width * CODEC_BYTES[codec] + (4 if codec == "int8" else 0)))


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


class _Json:
    def to_json(self: DataclassInstance) -> dict[str, Any]:
        """Plain JSON types; an infinite time (a stage nobody can run) becomes null."""
        return _jsonable(dataclasses.asdict(self))


@dataclass(frozen=True)
class MeasuredWorker(_Json):
    """A volunteer as measured: memory for its stage (bytes), training throughput over one layer
    (samples/s: samples through one layer's forward and backward per second), heartbeat round trip
    (s) and bandwidth to the relay (bytes/s)."""

    id: str
    memory_bytes: int
    samples_per_s: float
    rtt_s: float
    bandwidth: float


@dataclass(frozen=True)
class ModelShape(_Json):
    """What the plan needs of the model: its layers, parameters per layer, the first stage's extra
    parameters (embeddings), the last stage's (head; with ``K = 1`` one stage holds both), and the
    boundary's bytes per sample (:func:`boundary_bytes_per_sample`)."""

    layers: int
    layer_params: int
    first_params: int
    last_params: int
    boundary_bytes_per_sample: float


@dataclass(frozen=True)
class PipelineConfig(_Json):
    """``stages`` a number or "auto"; ``microbatch_size`` samples per micro-batch; ``microbatches``
    per batch (d); ``bytes_per_param`` a worker holds per parameter while training: 16 for fp32
    parameters, gradient, gradient accumulator and the public copy it uploads from (no optimizer
    state: the stage's owner steps); ``wire_bytes_per_param`` a parameter download costs (fp32);
    ``rebalance_every_batches`` between rebalancing checks."""

    stages: int | str = "auto"
    microbatch_size: int = 4
    microbatches: int = 8
    bytes_per_param: float = 16.0
    wire_bytes_per_param: float = 4.0
    rebalance_every_batches: int = 10


@dataclass(frozen=True)
class PlannedStage(_Json):
    """One stage of a plan: layers ``[layer_start, layer_end)``, its workers, their summed
    throughput, its parameters, the memory each worker needs for it, and its predicted seconds
    per batch."""

    index: int
    layer_start: int
    layer_end: int
    workers: tuple[str, ...]
    compute: float
    params: int
    memory_bytes: int
    seconds_per_batch: float


@dataclass(frozen=True)
class Candidate(_Json):
    """A number of stages the planner weighed: its predicted time, or why it cannot be run."""

    stages: int
    seconds_per_batch: float | None
    reason: str


@dataclass(frozen=True)
class StagePlan(_Json):
    """The plan the relay runs and publishes: stages, predicted seconds per batch (the slowest
    stage's), the bottleneck stage, the relay's boundary bytes per batch, the inputs it was made
    from (so joiners and rebalancing need nothing else) and the alternatives weighed."""

    stages: tuple[PlannedStage, ...]
    seconds_per_batch: float
    bottleneck: int
    relay_bytes_per_batch: float
    model: ModelShape
    config: PipelineConfig
    workers: tuple[MeasuredWorker, ...]
    candidates: tuple[Candidate, ...] = ()
    idle: tuple[MeasuredWorker, ...] = ()

    def stage_of(self, worker_id: str) -> int:
        """The stage a worker is placed on."""
        for stage in self.stages:
            if worker_id in stage.workers:
                return stage.index
        raise KeyError(f"worker {worker_id!r} has no stage in this plan")


@dataclass(frozen=True)
class Move(_Json):
    """Rebalancing's answer: move ``worker`` from one stage to another, predicted to save
    ``gain_s_per_batch`` at the cost of ``download_s`` to fetch its new stage's parameters."""

    worker: str
    from_stage: int
    to_stage: int
    gain_s_per_batch: float
    download_s: float
    seconds_per_batch_after: float


def stage_fixed_params(model: ModelShape, k: int, num_stages: int) -> int:
    """Parameters a stage holds besides its layers: embeddings on the first, the head on the last."""
    return (model.first_params if k == 0 else 0) + (model.last_params if k == num_stages - 1 else 0)


def stage_memory(model: ModelShape, cfg: PipelineConfig, k: int, num_stages: int, layers: int) -> int:
    """Bytes a worker needs to train ``layers`` layers as stage k of ``num_stages``."""
    params = layers * model.layer_params + stage_fixed_params(model, k, num_stages)
    return int(math.ceil(params * cfg.bytes_per_param))


def layer_capacity(worker: MeasuredWorker, model: ModelShape, cfg: PipelineConfig, k: int, num_stages: int) -> int:
    """The most layers ``worker`` can hold as stage k (0 when not even one fits)."""
    spare = worker.memory_bytes / cfg.bytes_per_param - stage_fixed_params(model, k, num_stages)
    return max(0, int(spare // model.layer_params)) if model.layer_params else model.layers


def task_time(
    worker: MeasuredWorker, model: ModelShape, cfg: PipelineConfig, k: int, num_stages: int, layers: int
) -> float:
    """tau: one worker's seconds for one micro-batch on stage k (the module docstring's terms)."""
    m = cfg.microbatch_size
    if num_stages == 1:
        trips, boundaries, work = 0, 0, 1.0
    elif k == 0:
        trips, boundaries, work = 4, 2, 4.0 / 3.0
    elif k == num_stages - 1:
        trips, boundaries, work = 2, 2, 1.0
    else:
        trips, boundaries, work = 4, 5, 4.0 / 3.0
    link = trips * worker.rtt_s + boundaries * m * model.boundary_bytes_per_sample / worker.bandwidth
    return link + work * m * layers / worker.samples_per_s


def stage_seconds(
    workers: Sequence[MeasuredWorker], model: ModelShape, cfg: PipelineConfig, k: int, num_stages: int, layers: int
) -> float:
    """A stage's seconds per batch: its workers share the ``d`` micro-batches by speed (``inf``
    with no worker)."""
    rate = sum(1.0 / task_time(w, model, cfg, k, num_stages, layers) for w in workers)
    return cfg.microbatches / rate if rate > 0 else math.inf


def relay_bytes_per_batch(model: ModelShape, cfg: PipelineConfig, num_stages: int) -> float:
    """Boundary bytes through the relay per batch: 2 per sample at each end stage, 5 in between
    (the per-stage counts above), ``(5K - 6) a`` per sample for ``K >= 2``, none for one stage."""
    per_sample = 0 if num_stages == 1 else 4 + 5 * (num_stages - 2)
    return float(per_sample * model.boundary_bytes_per_sample * cfg.microbatch_size * cfg.microbatches)
