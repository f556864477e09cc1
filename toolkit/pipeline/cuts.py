"""Where a model's parts lie in the flat parameter vector, and how its layers are dealt to stages.

The run's flat vector is the model's parameters in ``named_parameters`` order (the layout the
relay publishes). A stage must be ONE contiguous range of it, so that its ``SliceOwner`` holds
and steps a slice like any other and its worker downloads and uploads one range. That holds when
the parameters come in layer order: the embeddings (the *prefix*), block 0, block 1, ..., then
the final norm and output head (the *suffix*). :class:`PipelineUnits` records those ranges,
:func:`cut_stages` deals whole blocks to stages: stage 0 also takes the prefix, the last stage
the suffix. Everything here is pure data: the relay's planner uses it without building a model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from toolkit.errors import ModelMismatch

Range = tuple[int, int]
"""A flat element range [start, end) of the parameter vector."""


@dataclass(frozen=True)
class Anatomy:
    """Where an architecture keeps its parts, as module paths of its parameters' names."""

    name: str
    """The architecture as the volunteer knows it (messages name it)."""
    prefix: tuple[str, ...]
    """The modules or parameters before block 0 (embeddings)."""
    blocks: str
    """The ``ModuleList`` of the repeated blocks."""
    suffix: tuple[str, ...]
    """The modules after the last block (final norm, output head)."""

    def rank(self, name: str, num_layers: int) -> int | None:
        """-1 for a prefix parameter, i for one of block i, ``num_layers`` for the suffix's; None
        for a parameter in none of them."""
        if any(_under(name, p) for p in self.prefix):
            return -1
        if _under(name, self.blocks):
            index = name[len(self.blocks) + 1 :].split(".", 1)[0]
            return int(index) if index.isdigit() and int(index) < num_layers else None
        if any(_under(name, s) for s in self.suffix):
            return num_layers
        return None


def _under(name: str, path: str) -> bool:
    return name == path or name.startswith(path + ".")


@dataclass(frozen=True)
class PipelineUnits:
    """The flat ranges of a model's cuttable parts: ``prefix`` (embeddings), one range per block
    in ``blocks``, ``suffix`` (final norm and head); together they cover [0, ``total``) in order."""

    num_layers: int
    prefix: Range
    blocks: tuple[Range, ...]
    suffix: Range
    total: int
    tied: Range | None = None
    """The input embedding's range (in the prefix) when the output head is the same matrix (tied
    embeddings): the flat vector holds it once, on stage 0, and the last stage's head reads it."""

    @property
    def layer_numels(self) -> tuple[int, ...]:
        """Parameters per block: what the planner weighs a layer's memory and compute by."""
        return tuple(end - start for start, end in self.blocks)


@dataclass(frozen=True)
class StageCut:
    """Stage ``index`` of ``num_stages``: blocks [``first_layer``, ``end_layer``) and the flat
    range [``start``, ``end``) of its parameters (with the prefix on stage 0, the suffix on the last)."""

    index: int
    num_stages: int
    first_layer: int
    end_layer: int
    start: int
    end: int
    tied: Range | None = None
    """Tied embeddings, on the last stage of two or more: stage 0's range of the input embedding,
    which this stage's head reads as a copy outside its own range (its gradient goes to stage 0)."""

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.first_layer


def units_from_named(named: Iterable[tuple[str, torch.Tensor]], anatomy: Anatomy, num_layers: int) -> PipelineUnits:
    """The units of parameters ``named`` (in the model's order), refused unless every parameter
    belongs to a part and the parts come in layer order."""
    ranges: dict[int, list[int]] = {}
    offset, last_rank, last_name = 0, -1, ""
    for name, param in named:
        rank = anatomy.rank(name, num_layers)
        if rank is None:
            raise ModelMismatch(
                "not_cuttable",
                f"parameter {name} of this {anatomy.name} is in no stage part "
                "(embeddings, blocks, final norm and head)",
                "Cut only the model as its architecture defines it, without added modules.",
            )
        if rank < last_rank:
            raise ModelMismatch(
                "not_layer_ordered",
                f"this {anatomy.name}'s parameters are not in layer order: {name} comes after {last_name}",
                "Register the modules in the order they run "
                "(embeddings, blocks, final norm, head), so that each stage is one contiguous range "
                "of the flat parameter vector.",
            )
        span = ranges.setdefault(rank, [offset, offset])
        span[1] = offset = offset + param.numel()
        last_rank, last_name = rank, name
    missing = [i for i in range(num_layers) if i not in ranges]
    if num_layers < 1 or missing:
        raise ModelMismatch(
            "not_cuttable",
            f"this {anatomy.name} has no parameters in block(s) {missing or [0]}",
            "A stage is cut from whole blocks that have parameters: check the model's config.",
        )
    blocks = tuple((ranges[i][0], ranges[i][1]) for i in range(num_layers))
    prefix, suffix = ranges.get(-1, [0, 0]), ranges.get(num_layers, [offset, offset])
    return PipelineUnits(
        num_layers=num_layers,
        prefix=(prefix[0], prefix[1]),
        blocks=blocks,
        suffix=(suffix[0], suffix[1]),
        total=offset,
    )


def cut_stages(units: PipelineUnits, layers_per_stage: Sequence[int]) -> list[StageCut]:
    """Deal ``layers_per_stage[k]`` consecutive blocks to stage k; the flat ranges of the cuts
    are contiguous and cover [0, ``units.total``). A bad allocation is a ValueError in one line."""
    layers = list(layers_per_stage)
    if not layers:
        raise ValueError("layers_per_stage is empty: give each stage (at least one) its number of layers")
    bad = [k for k, n in enumerate(layers) if not isinstance(n, int) or isinstance(n, bool) or n < 1]
    if bad:
        raise ValueError(
            f"layers_per_stage {layers}: stage {bad[0]} has {layers[bad[0]]!r} layers; every stage "
            "needs a whole number >= 1 of them"
        )
    if sum(layers) != units.num_layers:
        raise ValueError(
            f"layers_per_stage {layers} deals {sum(layers)} layers and the model has "
            f"{units.num_layers}: make them sum to {units.num_layers}"
        )
    cuts, first_layer = [], 0
    for index, count in enumerate(layers):
        cuts.append(stage_cut(units, index, len(layers), first_layer, first_layer + count))
        first_layer += count
    return cuts


def stage_cut(units: PipelineUnits, index: int, num_stages: int, first_layer: int, end_layer: int) -> StageCut:
    """The cut of stage ``index`` holding blocks [``first_layer``, ``end_layer``); a cut that
    cannot be one of ``units``' is a ValueError."""
    fits = (
        0 <= index < num_stages
        and 0 <= first_layer < end_layer <= units.num_layers
        and (first_layer == 0) == (index == 0)
        and (end_layer == units.num_layers) == (index == num_stages - 1)
    )
    if not fits:
        raise ValueError(
            f"stage {index} of {num_stages} with blocks [{first_layer}, {end_layer}) is no stage of a "
            f"{units.num_layers}-layer model: cut the stages with cut_stages(units, layers_per_stage)"
        )
    start = 0 if index == 0 else units.blocks[first_layer][0]
    end = units.total if index == num_stages - 1 else units.blocks[end_layer - 1][1]
    tied = units.tied if index == num_stages - 1 and index > 0 else None
    return StageCut(
        index=index,
        num_stages=num_stages,
        first_layer=first_layer,
        end_layer=end_layer,
        start=start,
        end=end,
        tied=tied,
    )
