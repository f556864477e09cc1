"""What a pipeline run with a lossy boundary codec equals: the whole model with the codec's
round trip applied at every cut, in both directions.

A stage's output crosses the relay encoded (``[pipeline] boundary_codec``), and the next stage
computes on what it decodes; that stage's backward sends the gradient of *its* input encoded too,
and the stage before backpropagates what it decodes. So the pipeline trains the model in which
each cut is a layer whose forward is ``decode(encode(h))`` and whose backward is
``decode(encode(g))`` (the straight-through rule, the compressed gradient included).
:func:`through_cuts` installs that layer in a one-process model: with a deterministic codec
(every codec here) the pipeline's parameters equal that model's trained on the same batches, to
float rounding (which a rounding codec amplifies where an input lies at a rounding boundary:
1e-4 after 5 steps with ``lowrank-4``). That is the reference tests hold a compressed run against, and what
``benchmarks/pipeline_compression.py`` means by a compressed model's loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from toolkit.pipeline.cuts import cut_stages
from toolkit.wire import payloads
from toolkit.wire.compression import Codec


def round_trip(codec: Codec, h: torch.Tensor) -> torch.Tensor:
    """``h`` [..., width] as the next stage reads it after ``codec`` carried it: the same bytes
    the stage worker sends (``h`` as float32 rows), decoded and checked as the worker decodes."""
    width = h.shape[-1]
    rows = h.detach().to("cpu", torch.float32).reshape(-1, width).numpy()
    tensors = payloads.encode_rows("v", rows, codec)
    decoded = payloads.read_rows(tensors, "v", rows.shape[0], width, codec)
    return torch.from_numpy(np.array(decoded)).to(h.device, h.dtype).view_as(h)


class _Cut(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, codec: Codec) -> torch.Tensor:
        ctx.codec = codec
        return round_trip(codec, h)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return round_trip(ctx.codec, grad), None


def at_cut(h: torch.Tensor, codec: Codec) -> torch.Tensor:
    """``h`` through one cut: forward and backward both carried by ``codec``."""
    return _Cut.apply(h, codec)


@contextlib.contextmanager
def through_cuts(model: nn.Module, layers_per_stage: Sequence[int], codec: Codec) -> Iterator[None]:
    """Inside, ``model`` (the whole model) computes as a pipeline cut into ``layers_per_stage``
    with boundaries in ``codec`` does: the input of every stage's first block but stage 0's goes
    through :func:`at_cut`."""
    from toolkit.pipeline.stages import architecture_of, pipeline_units

    units = pipeline_units(model)
    parent, _, leaf = architecture_of(model).anatomy.blocks.rpartition(".")
    blocks = list(getattr(model.get_submodule(parent), leaf))

    def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if args:
            return (at_cut(args[0], codec), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": at_cut(kwargs["hidden_states"], codec)}

    hooks = [
        blocks[cut.first_layer].register_forward_pre_hook(hook, with_kwargs=True)
        for cut in cut_stages(units, list(layers_per_stage))[1:]
    ]
    try:
        yield
    finally:
        for handle in hooks:
            handle.remove()
