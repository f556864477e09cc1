"""The star planner (:mod:`.star`) fed with what the relay measures, and its answers applied.

* **The stage count.** ``pipeline.stages`` is a number, or "auto": the fewest stages whose
  every stage fits ``pipeline.worker_memory_mb`` (the smallest accelerator the organizer expects
  volunteers to bring), by the worker's memory prediction (:mod:`toolkit.pipeline.worker_memory`:
  parameters, gradients, transfers, activations, the input cache, boundaries), checked when the
  configuration loads. Fewer stages is faster in our star: every boundary crosses the relay's link
  twice each way. The cut is fixed when the relay starts (moving layers would make every worker of
  two stages download).
* **Predicted vs measured.** The relay times every accepted task per worker (lease to result:
  compute plus that worker's link, as the worker lives it) and turns it into the planner's
  per-layer throughput; the planner's Eq. 2 for the current placement (the stage whose workers
  share the batch's micro-batches slowest, times 1F1B's fill) plus the measured time of the last
  rounds (upload, step, publish: the aggregation the paper overlaps with DPU) is the predicted
  time per batch, published next to the measured one.
* **Rebalancing**, between batches: when the planner finds a single move of a worker to another
  stage whose predicted gain over the next ``rebalance_every_batches`` batches beats the worker's
  download of its new stage, the worker is moved (it sees its new stage in its next work answer).
  A stage left without workers always gets one from a stage with two or more.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from relay_server.pipeline.star import build_plan, rebalance
from relay_server.pipeline.star_model import (
    MeasuredWorker,
    ModelShape,
    Move,
    PipelineConfig,
    StagePlan,
    boundary_bytes_per_sample,
    stage_memory,
)
from toolkit.pipeline.cuts import PipelineUnits

UNKNOWN_BANDWIDTH = 1e15  # measured task times already hold each worker's link: the model adds none
EWMA = 0.3


def model_shape(units: PipelineUnits, codec: str, width: int, tokens: int) -> ModelShape:
    blocks = units.layer_numels
    return ModelShape(
        layers=units.num_layers,
        layer_params=max(blocks) if blocks else 0,
        first_params=units.prefix[1] - units.prefix[0],
        # a tied head: the last stage downloads, multiplies by and uploads a gradient of the matrix too
        last_params=units.suffix[1] - units.suffix[0] + (units.tied[1] - units.tied[0] if units.tied else 0),
        boundary_bytes_per_sample=boundary_bytes_per_sample(codec, width, tokens),
    )


@dataclass
class Measured:
    """One worker's seconds per task (an exponential average over its accepted tasks)."""

    task_s: float | None = None
    memory_bytes: int = 0

    def observe(self, seconds: float) -> None:
        self.task_s = seconds if self.task_s is None else (1 - EWMA) * self.task_s + EWMA * seconds


@dataclass
class Planner:
    model: ModelShape
    config: PipelineConfig
    layers: list[int]
    measured: dict[str, Measured] = field(default_factory=dict)
    round_s: float | None = None
    plan: StagePlan | None = None

    def observe_task(self, worker: str, seconds: float) -> None:
        self.measured.setdefault(worker, Measured()).observe(seconds)

    def observe_round(self, seconds: float) -> None:
        self.round_s = seconds if self.round_s is None else (1 - EWMA) * self.round_s + EWMA * seconds

    def task_seconds(self, worker: str) -> float | None:
        """``worker``'s measured seconds per task (None until one of its results was accepted)."""
        m = self.measured.get(worker)
        return m.task_s if m is not None else None

    def forget(self, worker: str) -> None:
        self.measured.pop(worker, None)

    def _worker(self, worker: str, stage: int, memory_bytes: int) -> MeasuredWorker | None:
        m = self.measured.get(worker)
        if m is None or not m.task_s:
            return None
        k_total, h = len(self.layers), self.layers[stage]
        tasks, work = (1, 1.0) if stage == k_total - 1 else (2, 4.0 / 3.0)  # the star model's per-stage work
        per_layer = work * self.config.microbatch_size * h / (tasks * m.task_s)
        return MeasuredWorker(worker, memory_bytes or (1 << 62), per_layer, 0.0, UNKNOWN_BANDWIDTH)

    def replan(self, placement: dict[str, tuple[int, int]]) -> StagePlan | None:
        """The plan of the current placement (worker -> (stage, memory bytes)) on fresh
        measurements; None until every stage has a measured worker."""
        groups: list[list[MeasuredWorker]] = [[] for _ in self.layers]
        for worker, (stage, memory) in placement.items():
            w = self._worker(worker, stage, memory)
            if w is not None:
                groups[stage].append(w)
        if not all(groups):
            self.plan = None
            return None
        self.plan = build_plan(groups, self.layers, self.model, self.config)
        return self.plan

    def predicted_batch_s(self) -> float | None:
        if self.plan is None or not math.isfinite(self.plan.seconds_per_batch):
            return None
        return self.plan.seconds_per_batch + (self.round_s or 0.0)

    def move(self, placement: dict[str, tuple[int, int]]) -> Move | None:
        """The planner's rebalancing move for the current placement, if one pays."""
        plan = self.replan(placement)
        if plan is None:
            return self.fill_empty(placement)
        return rebalance(plan, plan.workers)

    def fill_empty(
        self, placement: dict[str, tuple[int, int]], can_move: Callable[[str], bool] = lambda worker: True
    ) -> Move | None:
        """A stage nobody runs stalls every batch: move a worker there from a stage with two or
        more (the most crowded first), whatever the measurements say -- the first, in that
        order, whose memory fits and that ``can_move`` (one holding a stage gradient it has not
        uploaded cannot: the next one is tried, never none while any other could)."""
        counts = [sum(1 for s, _ in placement.values() if s == k) for k in range(len(self.layers))]
        sources = sorted((k for k, n in enumerate(counts) if n >= 2), key=lambda k: (-counts[k], k))
        for empty in (k for k, n in enumerate(counts) if n == 0):
            need = stage_memory(self.model, self.config, empty, len(self.layers), self.layers[empty])
            for src in sources:
                for worker, (stage, memory) in sorted(placement.items()):
                    if stage == src and (not memory or memory >= need) and can_move(worker):
                        return Move(worker, src, empty, math.inf, 0.0, math.inf)
        return None
