"""Cutting a run's model into stages: which models can be cut, and building one stage alone.

:func:`pipeline_units` refuses, in one line that says what to do, a model it cannot cut: an
architecture it does not know how to run in parts, input/output embeddings tied in a way it
cannot hold apart (a decoder's tied head is fine: the last stage reads stage 0's embedding as a
copy, :mod:`relay_server.pipeline.tied`), parameters out of layer order, or parameters shared
between modules (a stage owns each of its parameters alone, a tied head aside). :func:`build_stage` builds the
model on the meta device, where a parameter is a shape without storage, keeps the stage's
modules and only then allocates them: a worker never holds more than its stage, which is the
point of a pipeline (a model larger than any one volunteer's memory).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from toolkit.errors import ModelMismatch
from toolkit.models import build_model
from toolkit.pipeline.byte import ByteStage
from toolkit.pipeline.cuts import PipelineUnits, StageCut, cut_stages, stage_cut, units_from_named
from toolkit.pipeline.families import DECODERS
from toolkit.pipeline.stage import Stage
from toolkit.wire.protocol import ModelSpec

__all__ = [
    "ARCHITECTURES",
    "PipelineUnits",
    "Stage",
    "StageCut",
    "build_stage",
    "cut_stages",
    "meta_model",
    "pipeline_units",
    "units_of",
]

ARCHITECTURES: tuple[type[Stage], ...] = (ByteStage, *DECODERS)
"""The architectures a pipeline can cut, each with the stage that runs its parts."""

SUPPORTED = (
    "the toolkit's ByteTransformer (factory \"toolkit.models:ByteTransformer\") and transformers' "
    'decoders (architecture "AutoModelForCausalLM", model_type '
    + " / ".join(f'"{t}"' for d in DECODERS for t in d.family.model_types)
    + ")"
)


def architecture_of(model: nn.Module) -> type[Stage]:
    """The stage class that can cut ``model``, or a refusal naming the ones that exist."""
    for arch in ARCHITECTURES:
        if arch.matches(model):
            return arch
    raise ModelMismatch(
        "not_cuttable",
        f"pipeline stages cannot be cut from {type(model).__name__}; they are cut from {SUPPORTED}",
        "Name one of those in [model], or train this model without [pipeline] (data parallelism).",
    )


def pipeline_units(model: nn.Module) -> PipelineUnits:
    """Where ``model``'s embeddings, blocks and head lie in the flat parameter vector (``model``
    may live on the meta device: only names and shapes are read).

    A decoder whose head is its input embedding has ``units.tied``: that matrix's range, held
    once on stage 0, which the last stage reads as a copy. A tie the stages cannot hold apart
    (the ByteTransformer's, a head with a bias) is refused."""
    arch = architecture_of(model)
    arch.check(model)  # first: tie_hint reads the parts where the architecture says they are
    hint = arch.tie_hint(model)
    pair = arch.tied_pair(model) if hint else None
    if hint and pair is None:
        raise ModelMismatch(
            "tied_embeddings",
            f"this {arch.anatomy.name} ties its input and output embeddings in a way its pipeline "
            "stages cannot hold apart (the last stage would need the first stage's matrix as its own)",
            hint[0].upper() + hint[1:] + ".",
        )
    num_layers = arch.num_layers(model)
    named, seen = list(model.named_parameters(remove_duplicate=False)), dict[int, str]()
    kept = []
    for name, param in named:
        if id(param) in seen:
            if pair == (seen[id(param)], name):
                continue  # the head is the embedding: held once, where the embedding is
            raise ModelMismatch(
                "shared_parameters",
                f"{name} and {seen[id(param)]} of this {arch.anatomy.name} are "
                "one shared parameter, and a stage owns each of its parameters alone",
                "Give each module its own parameters (untie them) to cut the model into stages.",
            )
        seen[id(param)] = name
        kept.append((name, param))
    units = units_from_named(kept, arch.anatomy, num_layers)
    if pair is None:
        return units
    offset = 0
    for name, param in kept:
        if name == pair[0]:
            return dataclasses.replace(units, tied=(offset, offset + param.numel()))
        offset += param.numel()
    raise AssertionError(f"{pair[0]} is not a parameter of the model")  # tied_pair names the model's own


def meta_model(spec: ModelSpec) -> nn.Module:
    """The run's full model on the meta device: its parameters' names and shapes, no storage."""
    if spec.kind == "module":
        raise ModelMismatch(
            "not_cuttable",
            f"pipeline stages cannot be cut from the organizer's own model "
            f"{spec.factory!r}; they are cut from {SUPPORTED}",
            "Name one of those in [model], or train this model without [pipeline] (data parallelism).",
        )
    with torch.device("meta"):
        return build_model(spec)


def units_of(spec: ModelSpec) -> PipelineUnits:
    """:func:`pipeline_units` of the run's model, without allocating it."""
    return pipeline_units(meta_model(spec))


def build_stage(
    spec: ModelSpec, cut: StageCut, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> Stage:
    """Stage ``cut`` of the run's model on ``device``, the rest never allocated. Its parameters
    hold finite placeholder values: load the run's slice into them (:meth:`Stage.load_flat`)."""
    model = meta_model(spec)
    units = pipeline_units(model)
    try:
        fits = stage_cut(units, cut.index, cut.num_stages, cut.first_layer, cut.end_layer) == cut
    except ValueError:
        fits = False
    if not fits:
        raise ModelMismatch(
            "stage_mismatch",
            f"stage cut {cut} does not fit this model ({units.num_layers} layers, {units.total} parameters)",
            "Cut the stages from the run's own model: cut_stages(units_of(spec), layers_per_stage).",
        )
    stage = architecture_of(model)(model, cut)
    stage.to_empty(device=device)
    stage.retie()
    stage.restore_buffers(device)
    with torch.no_grad():
        for name, param in stage.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02)
            else:
                param.fill_(0.0 if name.endswith("bias") else 1.0)
    if dtype is not None:
        stage.to(dtype)
    if stage.tied is not None:  # after the cast: the copy is a leaf of the stage's dtype
        stage.load_tied(torch.zeros(stage.tied[1] - stage.tied[0]))
    return stage
