"""The relay's own copy of a stage: the third opinion, and the only check a first-stage task has.

A first-stage task reads a micro-batch of the worker's own data, so no other worker can be
given "the same task" without it looking different; and when a re-issued task's result differs
from the original, two results do not say which one lies. The relay holds every stage's master
parameters (it is each stage's parameter server), so it can compute the task itself: the same
stage code the workers run (:mod:`toolkit.pipeline.stages`), the same dropout masks for the
(micro-batch, stage) (:mod:`toolkit.pipeline.compute`), the run's precision, on the relay's CPU,
off the event loop, one task at a time. It is asked rarely -- every checked first-stage task and
every disagreement -- so its cost is the check share times a stage's forward (or backward).

It computes only on the version its parameters hold: a task of another version is not refereed
(``None``), and the check counts as unserved rather than guessed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from relay_server.trust.task_kinds import BACKWARD, FIRST, FORWARD, LAST, StepLike
from toolkit.pipeline import compute
from toolkit.pipeline.cuts import cut_stages
from toolkit.pipeline.stage import Stage
from toolkit.pipeline.stages import build_stage, units_of
from toolkit.wire import payloads
from toolkit.wire.compression import Codec
from toolkit.wire.protocol import ModelSpec


class Referee:
    def __init__(
        self,
        spec: ModelSpec,
        layers: list[int],
        params: Callable[[int], tuple[int, np.ndarray]],
        *,
        width: int,
        microbatch_size: int,
        codec: Codec,
        precision: str = "",
    ) -> None:
        """``params(stage)``: the version the stage's master holds and its flat slice."""
        self.spec, self.layers, self.params = spec, list(layers), params
        self.width, self.microbatch_size, self.codec = width, microbatch_size, codec
        self.policy = compute.stage_precision(precision or None, "cpu")
        self.stages: dict[int, Stage] = {}
        self.loaded: dict[int, int] = {}  # stage -> the version its parameters hold
        self.lock = threading.Lock()
        self.computed = 0

    def compute(self, step: StepLike, version: int, inputs: Mapping[str, bytes]) -> np.ndarray | None:
        """The output rows ``step`` must give on ``version`` (``a`` of a forward, ``g`` of the
        stage's input of a backward), from the stored boundary entries ``inputs`` (``batch``,
        ``a{k}``, ``g{k}``); None when the relay's parameters are another version's."""
        with self.lock:
            stage = self._stage(step.stage, version)
            if stage is None:
                return None
            self.computed += 1
            batch = _batch(inputs["batch"]) if "batch" in inputs else None
            if stage.first:
                x = stage.inputs(batch)
            else:
                x = self._boundary(inputs[f"a{step.stage - 1}"])
            if step.kind in (FIRST, FORWARD):
                out = compute.forward(stage, x, step.microbatch, self.policy)
            else:
                grad_output = self._boundary(inputs[f"g{step.stage}"]) if step.kind == BACKWARD else None
                result = compute.backward(
                    stage,
                    x,
                    step.microbatch,
                    self.policy,
                    grad_output=grad_output,
                    batch=batch if step.kind == LAST else None,
                    samples=self.microbatch_size,
                )
                if result.input is None:
                    return None
                out = result.input
            return out.detach().to(torch.float32).reshape(-1, out.shape[-1]).numpy()

    def stage_gradient(
        self, stage_index: int, version: int, inputs: Sequence[tuple[int, Mapping[str, bytes]]]
    ) -> np.ndarray | None:
        """The stage gradient a worker must upload for the micro-batches ``inputs`` names (each
        with its stored boundary entries, as a backward of the stage reads them): the sum of their
        parameter gradients on ``version``, a tied head's gradient of stage 0's matrix after the
        stage's own, as the worker lays its upload out (:mod:`relay_server.trust.gradient_audit`);
        None when the relay's parameters are another version's."""
        with self.lock:
            stage = self._stage(stage_index, version)
            if stage is None:
                return None
            total: torch.Tensor | None = None
            for microbatch, entries in inputs:
                self.computed += 1
                batch = _batch(entries["batch"]) if "batch" in entries else None
                x = stage.inputs(batch) if stage.first else self._boundary(entries[f"a{stage_index - 1}"])
                result = compute.backward(
                    stage,
                    x,
                    microbatch,
                    self.policy,
                    grad_output=None if stage.last else self._boundary(entries[f"g{stage_index}"]),
                    batch=batch if stage.last else None,
                    samples=self.microbatch_size,
                )
                grads = result.params if result.tied is None else [*result.params, result.tied]
                flat = torch.cat([g.reshape(-1) for g in grads]).to(torch.float32)
                total = flat if total is None else total + flat
            return total.numpy() if total is not None else None

    def _stage(self, k: int, version: int) -> Stage | None:
        held, flat = self.params(k)
        if held != version:
            return None
        if k not in self.stages:
            cut = cut_stages(units_of(self.spec), self.layers)[k]
            self.stages[k] = build_stage(self.spec, cut, "cpu")
        if self.loaded.get(k) != version:
            with torch.no_grad():
                self.stages[k].load_flat(flat)
            tied = self.stages[k].tied
            if tied is not None:  # a tied head reads stage 0's matrix of the same version (stage 0 starts at 0)
                self.stages[k].load_tied(self.params(0)[1][tied[0] : tied[1]])
            self.loaded[k] = version
        return self.stages[k]

    def _boundary(self, entry: bytes) -> torch.Tensor:
        _, tensors = payloads.decode(entry, len(entry))
        rows = payloads.read_rows(tensors, "v", None, self.width, self.codec)
        b = self.microbatch_size
        return torch.from_numpy(rows.copy()).view(b, rows.shape[0] // b, self.width)


def _batch(entry: bytes) -> torch.Tensor | dict[str, torch.Tensor]:
    """The micro-batch's data as the first stage sent it (``batch`` or ``batch.<key>``)."""
    _, tensors = payloads.decode(entry, len(entry))
    if "batch" in tensors:
        return torch.from_numpy(tensors["batch"].copy())
    return {k[len("batch.") :]: torch.from_numpy(v.copy()) for k, v in tensors.items() if k.startswith("batch.")}
