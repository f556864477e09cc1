"""``[pipeline]``: a run whose model is cut into stages that volunteers run (the staged pipeline).

A model larger than any volunteer's accelerator is cut into ``stages`` contiguous ranges of its
layers; each volunteer runs one stage; the relay holds every boundary (activations forward,
their gradients backward) and one parameter server per stage (:mod:`relay_server.pipeline`). A
batch is ``microbatches_per_batch`` micro-batches of ``microbatch_size`` samples; the relay steps
every stage once all of them finished their backward, so ``run.target_batch`` must equal their
product (the round counts exactly the batch's samples per stage). ``run.max_staleness`` is 0 (each
batch on the version the previous batch's round produced) or 1 (delayed parameter updates: the
next batch computes on the version before while a round closes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from toolkit.wire.compression import BOUNDARY_CHOICES, boundary_codec

BOUNDARY_CODECS = ("none", "float16", "int8")
"""The dense boundary codecs; ``lowrank-<r>`` (:mod:`toolkit.wire.compression.lowrank`) too."""
DISPATCH = ("pool", "static", "restart")


@dataclass(kw_only=True)
class PipelineSection:
    """``[pipeline]``: the stages, the batch's micro-batches and how boundaries travel."""

    enabled: bool = False
    """Train the model as a staged pipeline instead of data-parallel copies."""
    stages: Any = 2
    """How many stages (an integer >= 2), or "auto": the fewest stages that each fit
    ``worker_memory_mb`` (fewer stages, fewer boundaries through the relay)."""
    worker_memory_mb: int = 0
    """The accelerator memory the organizer expects every volunteer to have (e.g. 15000 for a
    Colab T4); needed by ``stages = "auto"``, which holds it against each worker's predicted
    memory (parameters, gradients, activations, input cache: docs/pipeline.md). Workers report their
    own memory when they join; a worker that cannot hold any stage is told so."""
    layers_per_stage: list[int] = field(default_factory=list)
    """Layers of each stage, in order (empty: the planner allocates them by stage compute, or
    evenly before any worker was measured)."""
    microbatch_size: int = 4
    """Samples per micro-batch: the unit a task computes."""
    microbatches_per_batch: int = 8
    """Micro-batches per batch; ``microbatch_size x microbatches_per_batch = run.target_batch``."""
    boundary_codec: str = "none"
    """How activations and their gradients cross the relay: none (float32, exact), float16 (half
    the bytes), int8 (blockwise, about a quarter) or lowrank-<r> (each micro-batch's matrix as its
    rank-r factors, e.g. lowrank-32: r (rows + width) bytes instead of float16's 2 rows x width;
    docs/pipeline.md, "Compressed boundaries")."""
    boundary_memory_mb: int = 256
    """Boundary tensors the relay keeps in memory until a batch's round closes; beyond it they
    spill to ``data_dir/boundaries``."""
    initial_lease_s: float = 30.0
    """A task's lease before its stage's task time was measured; afterwards the lease is
    ``lease_factor`` x the measured time, at least ``lease_floor_s``."""
    lease_factor: float = 4.0
    lease_floor_s: float = 2.0
    dispatch: str = "pool"
    """How tasks reach workers: "pool" (any worker of the stage takes any task; a lost task is
    re-dispatched, a lost stage gradient recomputed). "static" and "restart" exist only to
    measure what the pool buys (``benchmarks/pipeline.py``): "static" pins each micro-batch to one
    worker per stage, which it waits for (a static 1F1B pipeline); "restart" starts a micro-batch
    whose forward pass lost its worker again from stage 0 (SWARM-like)."""
    rebalance_every_batches: int = 4
    """Between batches, every this many, the planner may move one worker to the bottleneck
    stage (0: never), when the predicted gain beats the cost of downloading its new stage."""
    check_share: float = 0.0
    """The base share of stage workers' results the relay spot-checks (0..1): chosen by a secret
    seed, re-issued to another worker of the stage as an ordinary task (first-stage results:
    computed by the relay itself) and compared; a worker caught lying is banned and its batch
    recomputed (docs/pipeline.md, "Trusting stage workers"). New workers are checked more first
    (probation, :mod:`relay_server.trust.shares`), suspects always; past that it costs this share
    of the checkable results in extra compute."""
    probation_checks: int = 2
    """A new worker's probation: the first checkable result of each of its first this many batches
    is always checked, then its share falls to ``check_share`` (:mod:`relay_server.trust.shares`).
    2 catches a worker that lies from its first batch and one computing its second on stale
    parameters; more catch a liar that hides behind more honest batches, each costs one check per
    joiner."""
    rollback_batches: int = 4
    """With checks on: how many committed batches a late ban can undo. A liar caught after its
    unchecked results were counted makes every stage return to the version before the first batch
    holding one (its masters and optimizer state, kept in the stages' stores: one state file per
    stage and kept batch, on disk), and the undone batches are replayed on their first-stage data,
    kept in memory for this many batches (:mod:`.kept_inputs`); older than this many batches, the
    ban only restarts the open batch and the status says ``too late`` (:mod:`.rollback`). 0: never
    roll back."""

    @property
    def batch(self) -> int:
        return self.microbatch_size * self.microbatches_per_batch

    def num_stages(self) -> int | None:
        """The configured count, or None for "auto"."""
        return None if self.stages == "auto" else int(self.stages)

    def checks(self, target_batch: int, max_staleness: int, moe_enabled: bool) -> list[tuple[bool, str]]:
        if not self.enabled:
            return []
        stages_ok = self.stages == "auto" or (
            isinstance(self.stages, int) and not isinstance(self.stages, bool) and 2 <= self.stages <= 64
        )
        return [
            (stages_ok, f'pipeline.stages must be an integer 2..64 or "auto", got {self.stages!r}'),
            (
                self.stages != "auto" or self.worker_memory_mb > 0,
                'pipeline.stages = "auto" needs pipeline.worker_memory_mb (the memory every volunteer is expected to '
                "have, in MiB)",
            ),
            (
                not self.layers_per_stage
                or (
                    stages_ok
                    and self.stages != "auto"
                    and len(self.layers_per_stage) == self.stages
                    and all(n >= 1 for n in self.layers_per_stage)
                ),
                "pipeline.layers_per_stage must list one count >= 1 per stage (and needs a fixed pipeline.stages)",
            ),
            (
                1 <= self.microbatch_size <= 4096 and 1 <= self.microbatches_per_batch <= 4096,
                "pipeline.microbatch_size and pipeline.microbatches_per_batch must be 1..4096",
            ),
            (
                self.batch == target_batch,
                f"pipeline.microbatch_size x pipeline.microbatches_per_batch = {self.batch}, but run.target_batch "
                f"= {target_batch}: make them equal (a round counts exactly one batch per stage)",
            ),
            (
                max_staleness in (0, 1),
                f"pipeline runs take run.max_staleness = 0 or 1 (1: delayed parameter updates, each batch "
                f"on the version before the latest), got {max_staleness}: set 0 or 1",
            ),
            (
                max_staleness == 0 or self.check_share == 0.0,
                "pipeline.check_share needs run.max_staleness = 0 (spot checks restart the batch in flight, and "
                "with delayed updates two are in flight): set one of them to 0",
            ),
            (not moe_enabled, "[pipeline] and [moe] cannot both be enabled: pick one way to split the model"),
            (
                _codec_error(self.boundary_codec) is None,
                f"pipeline.boundary_codec must be {BOUNDARY_CHOICES}, got {self.boundary_codec!r} "
                f"(topk2-<K> is for run.compression only)",
            ),
            (
                self.check_share == 0.0 or not str(self.boundary_codec).startswith("lowrank-"),
                f"pipeline.check_share needs a boundary codec two honest workers agree on: "
                f"{self.boundary_codec} may turn its kept subspace between two computations of one task; "
                f"set pipeline.check_share = 0 or pipeline.boundary_codec = float16 or int8",
            ),
            (self.boundary_memory_mb >= 1, "pipeline.boundary_memory_mb must be >= 1"),
            (
                self.initial_lease_s > 0 and self.lease_factor >= 1 and self.lease_floor_s > 0,
                "pipeline.initial_lease_s and lease_floor_s must be > 0 and lease_factor >= 1",
            ),
            (self.dispatch in DISPATCH, f"pipeline.dispatch must be one of {DISPATCH}"),
            (self.rebalance_every_batches >= 0, "pipeline.rebalance_every_batches must be >= 0"),
            (0 <= self.probation_checks <= 16, "pipeline.probation_checks must be 0..16"),
            (0 <= self.rollback_batches <= 256, "pipeline.rollback_batches must be 0..256"),
            (
                0.0 <= self.check_share <= 1.0 and (self.check_share == 0.0 or self.dispatch == "pool"),
                f'pipeline.check_share must be 0..1 and needs pipeline.dispatch = "pool", got {self.check_share!r} '
                f"with {self.dispatch!r}",
            ),
        ]


def _codec_error(name: Any) -> str | None:
    """Why ``name`` cannot be a boundary codec (one line), None when it can."""
    try:
        boundary_codec(name)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None
