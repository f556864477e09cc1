"""The run's model as the relay cuts it: each stage's range of the flat vector, and what every
boundary looks like (its width, the rows a micro-batch may have, the token ids' range).

The model is built on the meta device (no memory, no initialisation) by the same code peers use
(:mod:`toolkit.pipeline.stages`), so the relay's cut and a worker's stage agree by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from relay_server.core.config import RelayConfig
from relay_server.pipeline.plan import model_shape
from relay_server.pipeline.results import Shapes
from relay_server.pipeline.star_model import ModelShape, PipelineConfig
from toolkit.pipeline.stages import cut_stages, meta_model, pipeline_units
from toolkit.pipeline.worker_memory import StageMemoryModel, auto_stage_count, even_layers, memory_model


@dataclass(frozen=True)
class ModelCut:
    cuts: list[tuple[int, int]]
    layers: list[int]
    shapes: Shapes
    model: ModelShape
    """What the planner weighs (layers, parameters per layer, embeddings, head, boundary bytes)."""
    plan_config: PipelineConfig
    memory: StageMemoryModel
    """What a worker of each stage holds (:mod:`toolkit.pipeline.worker_memory`)."""
    tied: tuple[int, int] | None = None
    """Stage 0's range of a tied input/output embedding (:mod:`.tied`), None when untied."""

    def stage_bytes(self) -> list[int]:
        """The memory a worker needs for each stage, every term counted (:mod:`toolkit.pipeline.worker_memory`)."""
        return [self.memory.worker_bytes(k, len(self.layers), h) for k, h in enumerate(self.layers)]


def cut_model(config: RelayConfig) -> ModelCut:
    model = meta_model(config.model.spec())
    units = pipeline_units(model)  # a tied embedding: units.tied (the relay's side is .tied)
    cfg = config.pipeline
    shapes = _shapes(model, cfg.microbatch_size)
    shape = model_shape(units, cfg.boundary_codec, shapes.width, shapes.max_positions)
    plan_config = PipelineConfig(
        stages=cfg.stages,
        microbatch_size=cfg.microbatch_size,
        microbatches=cfg.microbatches_per_batch,
        rebalance_every_batches=max(1, cfg.rebalance_every_batches),
    )
    memory = memory_model(config.model.spec(), units, cfg.microbatch_size, shapes.max_positions)
    stages = cfg.num_stages() or auto_stage_count(memory, cfg.worker_memory_mb << 20)
    if stages > units.num_layers:
        raise ValueError(
            f"pipeline.stages = {stages}, but the model has {units.num_layers} layers: lower pipeline.stages"
        )
    layers = list(cfg.layers_per_stage) or even_layers(units.num_layers, stages)
    cuts = cut_stages(units, layers)
    return ModelCut(
        cuts=[(c.start, c.end) for c in cuts],
        layers=layers,
        shapes=shapes,
        model=shape,
        plan_config=plan_config,
        memory=memory,
        tied=units.tied,
    )


def _shapes(model: torch.nn.Module, microbatch_size: int) -> Shapes:
    cfg = getattr(model, "cfg", None)
    if cfg is not None:  # the toolkit's ByteTransformer
        return Shapes(
            width=cfg.d_model, microbatch_size=microbatch_size, max_positions=cfg.seq_len, vocab=cfg.vocab_size
        )
    hf: Any = model.config  # a transformers PretrainedConfig (torch types a module's attributes as Tensor | Module)
    return Shapes(
        width=hf.hidden_size,
        microbatch_size=microbatch_size,
        max_positions=getattr(hf, "n_positions", None) or hf.max_position_embeddings,
        vocab=hf.vocab_size,
        tokens_key="input_ids",
        label_columns=0,
    )
