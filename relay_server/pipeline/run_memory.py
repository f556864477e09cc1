"""The memory a pipeline run needs, predicted when the relay starts: its own and each stage worker's.

``GET /api/pipeline`` states it under ``memory`` (every term, in bytes), ``relay-server trial``
holds it against the machine it runs on. A worker's terms are :mod:`toolkit.pipeline.worker_memory`'s.
The relay's, per parameter of the whole model (every stage's owner lives on the relay):

* **parameters**, 8 B/param: each stage owner's master (4) and the collaboration's flat vector
  the stages were cut from (4);
* **gradients**, 4 B/param: each stage's round sum, where its workers' uploads add up (with a
  tied embedding, the last stage's sum of the head's gradient of it too, :mod:`.tied`);
* **optimizer state**: AdamW, Adam and LAMB 8 B/param (two moments; 2 with ``state_bits = 8``),
  SGD with momentum 4, plain SGD 0;
* **versions**, 8 B/param: each step's whole model assembled for ``relay-server export`` and
  evaluation (:mod:`.whole_model`, 4) and a stage's version while it is written (4);
* **transfers**, 1 B/param, and **fixed**, 36 MiB: fitted to the measurements (uploads being
  read, the allocator's slack, the threads that commit versions): the relay's peak RSS less the
  terms above, against the model's parameters, is close to 36 MiB + 1 B/param;
* **boundaries**: what the relay keeps of a batch's boundaries in memory (activations and their
  gradients at every cut), at most ``pipeline.boundary_memory_mb`` (beyond it they spill to disk).

So about 29 B/param with AdamW, against 19 for a data-parallel run's relay: the organizer's
machine needs half again as much memory per parameter with ``[pipeline]``. Measured by
``benchmarks/pipeline_memory.py`` (peak RSS less a 17k-parameter run's; docs/pipeline.md has the table).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relay_server.core.config import RelayConfig
from toolkit.pipeline.worker_memory import MemoryTerms, StageMemoryModel

RELAY_BYTES_PER_PARAM = {"parameters": 8, "gradients": 4, "versions": 8, "transfers": 1}
"""The relay's bytes per parameter of the model by term, the optimizer's state apart (:func:`optimizer_bytes`)."""
RELAY_FIXED_BYTES = 36 << 20
"""The relay's memory for a pipeline run that does not grow with the model (fitted, as transfers)."""


def optimizer_bytes(optimizer: Any) -> float:
    """Bytes per parameter of the stage owners' optimizer state."""
    if optimizer.name in ("adamw", "adam", "lamb"):
        return 2.03 if getattr(optimizer, "state_bits", 32) == 8 else 8.0
    return 4.0 if optimizer.name == "sgd" and optimizer.momentum > 0 else 0.0


@dataclass(frozen=True)
class PipelineMemory:
    """The relay's predicted memory and each stage worker's, by term."""

    relay: MemoryTerms
    workers: list[MemoryTerms]
    activations_counted: bool = True
    """False where the model's code cannot run on the meta device and activations are estimated."""

    def worker_bytes(self) -> list[int]:
        return [w.total for w in self.workers]

    def total_bytes(self) -> int:
        """The relay and one worker per stage: what a trial on one machine needs."""
        return self.relay.total + sum(self.worker_bytes())

    def to_json(self) -> dict[str, Any]:
        return {
            "relay": self.relay.to_json(),
            "workers": [{"stage": k, **w.to_json()} for k, w in enumerate(self.workers)],
            "activations": "counted" if self.activations_counted else "estimated",
        }


def relay_memory(config: RelayConfig, num_params: int, memory: StageMemoryModel, num_stages: int) -> MemoryTerms:
    """The relay's terms for ``num_params`` parameters cut into ``num_stages`` stages."""
    cfg = config.pipeline
    per = RELAY_BYTES_PER_PARAM
    batch_boundaries = cfg.microbatches_per_batch * (num_stages - 1) * 2 * memory.boundary_bytes
    return MemoryTerms(
        parameters=per["parameters"] * num_params,
        gradients=per["gradients"] * (num_params + (memory.tied_params if num_stages > 1 else 0)),
        optimizer_state=int(optimizer_bytes(config.optimizer) * num_params),
        versions=per["versions"] * num_params,
        transfers=per["transfers"] * num_params,
        boundaries=min(cfg.boundary_memory_mb << 20, batch_boundaries),
        fixed=RELAY_FIXED_BYTES,
    )


def predict_memory(config: RelayConfig, cut: Any) -> PipelineMemory:
    """Both sides' predictions for the run's cut (:class:`.model_cut.ModelCut`)."""
    num_stages = len(cut.layers)
    num_params = cut.cuts[-1][1]
    return PipelineMemory(
        relay=relay_memory(config, num_params, cut.memory, num_stages),
        workers=[cut.memory.worker(k, num_stages, h) for k, h in enumerate(cut.layers)],
        activations_counted=cut.memory.activations_counted,
    )
