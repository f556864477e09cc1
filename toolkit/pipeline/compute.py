"""What a stage task computes: a forward with the task's dropout masks under the run's precision,
and a backward that recomputes exactly that forward.

**Dropout masks are replayed, not redrawn.** A pipeline keeps no activations between a
micro-batch's forward and its backward: the backward runs the stage's forward again from the
stored input (on the worker that ran the forward, or on any other when that one left). With
dropout, a second forward drawing from wherever the generator happens to be uses other masks,
and the gradient it gives is not the gradient of the forward whose output the next stage used
(measured on GPT-2 with its default dropout 0.1: cosine 0.64 to the true stage gradient). So
every forward of stage ``k`` on micro-batch ``m`` runs with the torch generators (the CPU's, and
the stage device's) seeded to :func:`stage_seed` ``(m, k)``, restored afterwards: the seed follows
from the task's identity, which the relay gives every task of that micro-batch and stage (its
forward, its backward, a backward redone elsewhere, a batch re-run after a relay restart), so no
generator state has to travel with the boundary, and nothing new crosses the wire.

The one-process run these gradients equal is the whole model with its generators seeded the same
way: :func:`pipeline_masks` seeds ``(m, 0)`` before the micro-batch's forward and ``(m, k)`` as
stage ``k``'s first block starts. One seed gives one set of masks on every CPU; on GPUs, torch's
CUDA dropout kernels spread their random numbers over a launch grid that follows from the GPU
model, so a backward moved to a CPU or another GPU model draws other masks (the relay prefers
the forward's own worker for a backward; a stage served by one kind of device stays exact). The
generators are the process's default ones: nothing else in the worker may draw from them while a
task runs (its data comes from generators of its own, :mod:`toolkit.data`).

**Precision** (:class:`~toolkit.runtime.precision.PrecisionPolicy`): the forward and its
recomputation run under the same autocast, so the recomputed forward is the forward. Boundaries
travel in float32 whatever the policy (the codec decides their bytes). Under fp16 the backward
is loss-scaled by the worker's own scaler -- the last stage scales its loss, any other stage the
gradient it received -- and unscaled before anything leaves the worker, so a boundary gradient is
the true one whatever scale produced it (scales are powers of two: scaling is exact); on an
overflow the scale halves and the backward is recomputed, since a micro-batch cannot be dropped
(the relay counts every one).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from toolkit.errors import CollabError
from toolkit.pipeline.cuts import cut_stages
from toolkit.pipeline.stage import Stage
from toolkit.runtime import environment
from toolkit.runtime.environment import DeviceInfo
from toolkit.runtime.precision import PrecisionPolicy, choose_precision

FP32 = PrecisionPolicy(name="fp32", device_type="cpu", reason="the run pins no precision")
"""What a stage computes in when the run pins none: every worker of a stage must compute the same
function (a backward may be recomputed by another worker), so none picks its own."""


def stage_precision(pinned: str | None, device: torch.device | str = "cpu") -> PrecisionPolicy:
    """The policy a stage worker on ``device`` computes in: the run's pin (``run.precision``),
    refused with :class:`~toolkit.errors.PrecisionUnsupported` where ``device`` cannot execute it
    (the trainers' table, :mod:`toolkit.runtime.precision`), fp32 when the run pins none."""
    if not pinned:
        return FP32
    info = environment.detect()
    if torch.device(device).type == "cpu" and info.kind != "cpu":  # a CPU stage on a machine with a GPU
        info = DeviceInfo(kind="cpu", name="CPU", memory_bytes=None)
    return choose_precision(info, pinned)


def stage_seed(microbatch: int, stage: int) -> int:
    """The seed of stage ``stage``'s forward on micro-batch ``microbatch``: the same on every
    worker and in every process (a hash, not Python's salted ``hash``), distinct per pair."""
    digest = hashlib.sha256(f"collabtrain.pipeline.dropout/{microbatch}/{stage}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # 63 bits: every generator takes it


@contextlib.contextmanager
def replaying(seed: int, device: torch.device | str = "cpu") -> Iterator[None]:
    """Run the body with torch's generators seeded to ``seed`` (the CPU's, and ``device``'s when it
    is an accelerator), then put them back as they were: a task's masks never depend on what the
    worker computed before, and nothing after it depends on the task's masks."""
    device = torch.device(device)
    accelerator = device.type if device.type not in ("cpu", "meta") else None
    devices = [device] if accelerator else []
    with torch.random.fork_rng(devices=devices, device_type=accelerator or "cuda"):
        torch.manual_seed(seed)  # the CPU's generator and every accelerator's
        yield


@contextlib.contextmanager
def pipeline_masks(model: nn.Module, layers_per_stage: Sequence[int], microbatch: int) -> Iterator[None]:
    """The one-process reference of a pipeline with dropout: inside, ``model`` (the whole model,
    in training mode) draws the masks a pipeline cut into ``layers_per_stage`` draws for
    ``microbatch`` -- seeded :func:`stage_seed` ``(microbatch, 0)`` now, and ``(microbatch, k)``
    when stage ``k``'s first block starts. One micro-batch's forward per context."""
    from toolkit.pipeline.stages import architecture_of, pipeline_units

    units = pipeline_units(model)  # a reference: which blocks start a stage
    parent, _, leaf = architecture_of(model).anatomy.blocks.rpartition(".")
    blocks = list(getattr(model.get_submodule(parent), leaf))
    device = next(model.parameters()).device
    hooks = []
    with replaying(stage_seed(microbatch, 0), device):
        try:
            for cut in cut_stages(units, list(layers_per_stage))[1:]:
                seed = stage_seed(microbatch, cut.index)
                hooks.append(blocks[cut.first_layer].register_forward_pre_hook(lambda *_, s=seed: _seed(s)))
            yield
        finally:
            for hook in hooks:
                hook.remove()


def _seed(seed: int) -> None:
    torch.manual_seed(seed)


def forward(stage: Stage, x: torch.Tensor, microbatch: int, policy: PrecisionPolicy = FP32) -> torch.Tensor:
    """A forward task's output (no graph kept): stage ``x`` with micro-batch ``microbatch``'s masks."""
    with torch.no_grad(), replaying(stage_seed(microbatch, stage.index), x.device), policy.autocast():
        return stage(x)


@dataclass
class StageGrads:
    """A backward task's result: the stage's parameter gradients (float32, the parameters' order),
    the gradient of the stage's input (None on stage 0) and, on the last stage, the loss."""

    params: list[torch.Tensor]
    input: torch.Tensor | None
    loss: float | None = None
    tied: torch.Tensor | None = None
    """The last stage's head gradient for stage 0's tied embedding (tied models only)."""


def backward(
    stage: Stage,
    x: torch.Tensor,
    microbatch: int,
    policy: PrecisionPolicy = FP32,
    *,
    grad_output: torch.Tensor | None = None,
    batch: Any = None,
    samples: int = 1,
) -> StageGrads:
    """Recompute the forward of ``x`` (stage 0: the tokens; else the stored boundary) with the
    masks and autocast its forward task used, and backpropagate: on the last stage the loss of
    ``batch`` times ``samples`` (a *sum* over samples, as a data-parallel peer's gradient is),
    elsewhere ``grad_output``, the gradient of the stage's output."""
    params = list(stage.parameters())
    tied = [stage.tied_weight()] if stage.tied_name is not None else []
    x = x if stage.first else x.detach().requires_grad_(True)
    wrt = [] if stage.first else [x]
    scaler = policy.scaler
    while True:
        scale = scaler.scale if scaler is not None else 1.0
        for t in [*wrt, *params, *tied]:
            t.grad = None
        with replaying(stage_seed(microbatch, stage.index), x.device):
            with policy.autocast():
                if stage.last:
                    loss = stage.loss(x, batch)
                    out, grad = loss * samples, None
                else:
                    out, grad = stage(x), grad_output
            if scale != 1.0:  # fp16: the loss, or the gradient this stage received, scaled
                if grad is None:
                    out = out * scale
                else:
                    grad = grad * scale
            torch.autograd.backward(out, grad, inputs=[*wrt, *params, *tied])
        if policy.unscale_and_check([*wrt, *params, *tied]):
            break
        if scaler is not None and scaler.scale <= scaler.min_scale:
            raise CollabError(
                "non_finite",
                f"stage {stage.index}'s fp16 gradients overflow even at the minimum loss scale "
                f"(micro-batch {microbatch}): the loss itself is not finite",
                "Ask the organizer to pin bf16 or fp32, or to lower the learning rate.",
            )
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in [*params, *tied]]
    for t in [*params, *tied]:
        t.grad = None
    return StageGrads(
        params=grads[: len(params)],
        input=x.grad if wrt else None,
        loss=float(loss.detach()) if stage.last else None,
        tied=grads[-1] if tied else None,
    )
