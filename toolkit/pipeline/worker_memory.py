"""What a stage worker holds in memory, predicted before it starts: the relay sizes stages with it.

The terms, per stage of ``P`` parameters (``docs/pipeline.md`` has the measured figures):

* **parameters**, 8 B/param: the stage's fp32 tensors (4) and the slice it downloads the
  published version into before copying it in (4); a tied embedding's copy on the last stage of
  two or more counts as parameters of that stage in every term (it is downloaded, held, given a
  gradient, summed and uploaded as they are);
* **gradients**, 8 B/param: a backward task's parameter gradient (4) and the sum of the stage
  gradients it holds until its upload (4);
* **transfers**, 5 B/param: the upload's concatenated gradient vector and what the allocator keeps
  of the transient copies around it -- the one fitted term: a worker's peak RSS less the other
  terms was 4-7 B/param on the models measured (``benchmarks/pipeline_memory.py``);
* **optimizer state**: none -- each stage's owner on the relay steps it;
* **activations**: what autograd saves for backward on one micro-batch of the stage (a backward
  task recomputes the forward once; the last stage adds the head and the loss), counted exactly by
  running the stage on the meta device (shapes, no memory) under ``saved_tensors_hooks`` -- or,
  for code the meta device cannot run (transformers' GPT-2), estimated from the boundary's size;
* **input cache**: the stage inputs of up to :data:`CACHE_INPUTS` micro-batches it ran forward on
  (a backward then needs no input from the relay); the last stage runs forward and backward as one
  task and caches nothing;
* **boundaries**: one task's tensors crossing the relay (the input activation and its gradient,
  the output and the gradient coming back: 4 boundary matrices).

This module is the shared layer's (the relay imports it to size stages and refuse ``stages =
"auto"`` at load); the worker takes :data:`CACHE_INPUTS` from here so the two cannot disagree.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from toolkit.pipeline.cuts import PipelineUnits, stage_cut
from toolkit.wire.protocol import ModelSpec

CACHE_INPUTS = 64
"""Stage inputs a worker keeps for its backward tasks (the oldest dropped first)."""
WORKER_BYTES_PER_PARAM = {"parameters": 8, "gradients": 8, "transfers": 5, "optimizer_state": 0}
"""Bytes a stage worker holds per parameter of its stage, by term (the module docstring says which)."""
BOUNDARY_TENSORS = 4
"""Boundary matrices one task holds at once: input, its gradient, output, the gradient coming back."""
ESTIMATED_LAYER_BOUNDARIES = 18
"""Where a block cannot run on the meta device: its saved activations in boundary matrices (a
pre-norm transformer block with a 4x MLP saves 17-18 of them on the toolkit's model, counted)."""
HEAD_COPIES = 3
"""... and the head's: the logits, their softmax and its gradient, each ``[b, t, vocab]`` float32."""


@dataclass(frozen=True)
class MemoryTerms:
    """Predicted bytes by term; ``total`` their sum."""

    parameters: int = 0
    gradients: int = 0
    transfers: int = 0
    optimizer_state: int = 0
    activations: int = 0
    input_cache: int = 0
    boundaries: int = 0
    versions: int = 0
    fixed: int = 0
    """What does not grow with the model (the relay's, measured)."""

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def to_json(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class StageMemoryModel:
    """What a worker's memory depends on, read once from the model on the meta device: the
    parameters of a block and of the first and last stages' extras, and the activation bytes one
    micro-batch saves for backward in a block, in stage 0's embedding and in the last stage's
    head and loss; a boundary matrix's and a data micro-batch's bytes."""

    layers: int
    layer_params: int
    first_params: int
    last_params: int
    layer_activations: int
    first_activations: int
    last_activations: int
    boundary_bytes: int
    batch_bytes: int
    activations_counted: bool = True
    """False: the model's code cannot run on the meta device (transformers' GPT-2 masks call
    ``.item()``), so activations are estimated (:data:`ESTIMATED_LAYER_BOUNDARIES`, :data:`HEAD_COPIES`)."""

    tied_params: int = 0
    """A tied input/output embedding's size: the last stage of two or more holds a copy of it."""

    def stage_params(self, k: int, num_stages: int, layers: int) -> int:
        """The values stage ``k`` holds as parameters, a tied embedding's copy included."""
        return (
            layers * self.layer_params
            + (self.first_params if k == 0 else 0)
            + (self.last_params + (self.tied_params if num_stages > 1 else 0) if k == num_stages - 1 else 0)
        )

    def worker(self, k: int, num_stages: int, layers: int) -> MemoryTerms:
        """Stage ``k`` of ``num_stages`` holding ``layers`` blocks."""
        params = self.stage_params(k, num_stages, layers)
        first, last = k == 0, k == num_stages - 1
        activations = (
            layers * self.layer_activations
            + (self.first_activations if first else 0)
            + (self.last_activations if last else 0)
        )
        cache = 0 if last else CACHE_INPUTS * (self.batch_bytes if first else self.boundary_bytes)
        crossing = (2 if first or last else BOUNDARY_TENSORS) * self.boundary_bytes if num_stages > 1 else 0
        per = WORKER_BYTES_PER_PARAM
        return MemoryTerms(
            parameters=per["parameters"] * params,
            gradients=per["gradients"] * params,
            transfers=per["transfers"] * params,
            optimizer_state=per["optimizer_state"] * params,
            activations=activations,
            input_cache=cache,
            boundaries=crossing,
        )

    def worker_bytes(self, k: int, num_stages: int, layers: int) -> int:
        return self.worker(k, num_stages, layers).total


def even_layers(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage as even as they go, the earlier stages taking the remainder."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if k < extra else 0) for k in range(num_stages)]


def auto_stage_count(model: StageMemoryModel, memory_bytes: int) -> int:
    """``stages = "auto"``: the fewest stages (at least 2, even layers) whose every worker fits
    ``memory_bytes``; a ``ValueError`` saying what to change when even one layer per stage does not."""
    for k in range(1, model.layers + 1):
        if all(model.worker_bytes(i, k, h) <= memory_bytes for i, h in enumerate(even_layers(model.layers, k))):
            return max(k, 2)
    need = max(model.worker_bytes(i, model.layers, 1) for i in range(model.layers))
    raise ValueError(
        f'pipeline.stages = "auto": even one layer per stage needs {math.ceil(need / 2**20)} MiB on a worker '
        f"(parameters, gradients, activations, input cache), more than pipeline.worker_memory_mb = "
        f"{memory_bytes >> 20}: raise worker_memory_mb, lower pipeline.microbatch_size or use a smaller model"
    )


def memory_model(spec: ModelSpec, units: PipelineUnits, microbatch_size: int, tokens: int) -> StageMemoryModel:
    """Measure ``spec``'s :class:`StageMemoryModel` on the meta device for micro-batches of
    ``microbatch_size`` samples of ``tokens`` tokens (no memory is allocated, nothing is computed):
    the whole model as one stage, its embedding, its blocks (their mean) and its head and loss
    each run under ``saved_tensors_hooks``, parameters not counted."""
    from toolkit.pipeline.stages import architecture_of, meta_model

    model = meta_model(spec)
    stage = architecture_of(model)(model, stage_cut(units, 0, 1, 0, units.num_layers))
    width = _width(model)
    batch = _meta_batch(stage, microbatch_size, tokens)
    params = {id(p) for p in stage.parameters()}

    def saved(run: Any) -> int:
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            if not _of_parameter(t, params):
                total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
        return total

    def hidden() -> torch.Tensor:
        return torch.empty(microbatch_size, tokens, width, device="meta", requires_grad=True)

    boundary = microbatch_size * tokens * width * 4
    try:
        layer = math.ceil(saved(lambda: stage.run_blocks(hidden())) / units.num_layers)
        first = saved(lambda: stage.embed(stage.inputs(batch)))
        last = saved(lambda: stage.head_loss(hidden(), batch))
        counted = True
    except (RuntimeError, NotImplementedError, TypeError, ValueError):  # code the meta device cannot run
        layer, first, last = ESTIMATED_LAYER_BOUNDARIES * boundary, 0, HEAD_COPIES * boundary // width * _vocab(model)
        counted = False
    data = batch.values() if isinstance(batch, dict) else [batch]
    return StageMemoryModel(
        layers=units.num_layers,
        layer_params=max(units.layer_numels) if units.layer_numels else 0,
        first_params=units.prefix[1] - units.prefix[0],
        last_params=units.suffix[1] - units.suffix[0],
        layer_activations=layer,
        first_activations=first,
        last_activations=last,
        boundary_bytes=boundary,
        batch_bytes=sum(t.numel() * t.element_size() for t in data),
        activations_counted=counted,
        tied_params=units.tied[1] - units.tied[0] if units.tied else 0,
    )


def _vocab(model: torch.nn.Module) -> int:
    cfg = getattr(model, "cfg", None)
    return int(cfg.vocab_size) if cfg is not None else int(_hf_config(model).vocab_size)


def _of_parameter(t: torch.Tensor, params: set[int]) -> bool:
    """Whether a tensor autograd saves is a parameter or a view of one (a linear layer saves its
    weight, transposed): the parameters are counted per parameter, not as activations."""
    if id(t) in params:
        return True
    fn = t.grad_fn
    while fn is not None and len(fn.next_functions) == 1:
        nxt = fn.next_functions[0][0]
        if nxt is None:
            return False
        variable = getattr(nxt, "variable", None)  # AccumulateGrad: the leaf it feeds
        if variable is not None:
            return id(variable) in params
        fn = nxt
    return False


def _width(model: torch.nn.Module) -> int:
    cfg = getattr(model, "cfg", None)
    return int(cfg.d_model) if cfg is not None else int(_hf_config(model).hidden_size)


def _meta_batch(stage: Any, microbatch_size: int, tokens: int) -> Any:
    """A data micro-batch on the meta device in the form the stage reads: byte rows [b, t + 1]
    for the toolkit's model, ``input_ids``/``labels`` for transformers' (tried in that order)."""
    rows = torch.empty(microbatch_size, tokens + 1, dtype=torch.long, device="meta")
    ids = torch.empty(microbatch_size, tokens, dtype=torch.long, device="meta")
    as_dict = {"input_ids": ids, "labels": ids}
    try:
        stage.tokens(rows)
        return rows
    except Exception:  # noqa: BLE001 -- not this architecture's form: the other one
        return as_dict


def sequence_length(model: torch.nn.Module) -> int:
    """The most tokens a sample of ``model`` has (the toolkit's ``seq_len``, transformers'
    ``n_positions`` or ``max_position_embeddings``): what a boundary's rows are sized by."""
    cfg = getattr(model, "cfg", None)
    if cfg is not None:
        return int(cfg.seq_len)
    hf = _hf_config(model)
    return int(getattr(hf, "n_positions", None) or hf.max_position_embeddings)


def _hf_config(model: torch.nn.Module) -> Any:
    """A transformers model's ``config`` (the toolkit's own keep theirs in ``cfg``)."""
    return getattr(model, "config")
