"""How far honest recomputations of one task actually differ, per precision: the measurement the
comparison's tolerance (:mod:`.compare`) is derived from.

A check compares a worker's result with another worker's, or with the relay's own copy
(:mod:`.referee`), on the same inputs and version: every difference is float rounding, and its
size depends on the precision. Two honest sources of it are measured here, on the run's own stage
code (:mod:`toolkit.pipeline.compute`, what workers and the referee run):

* **another machine's summation order**: the same task computed as one micro-batch and sample by
  sample (other matrix shapes: the BLAS blocks its sums differently, as another CPU's or a GPU's
  kernels do; exact for a model without dropout or batch statistics, as measured here);
* **the rounding itself**: the same task against an fp64 computation of it (the exact result, for
  this purpose). Every honest computation in a precision is within its rounding error ``e`` of the
  exact one, so two honest computations -- whatever hardware computed them -- are within ``2 e``
  (the triangle inequality): the bound that holds for hardware this machine does not have.

Per micro-batch: a forward of every stage but the last (its boundary activations) and a backward
of every stage but the first (the gradient of its input) -- the results a check compares -- each
from the boundaries the first computation gave, as a check reads the stored ones. :func:`derived_tolerance` is :data:`MARGIN` times the largest
``2 e`` (or pairwise distance) measured: ``benchmarks/trust.py --tolerance`` prints the
measurement over thousands of tasks and the table in :mod:`.compare` comes from it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from relay_server.trust.compare import distance
from toolkit.pipeline import compute
from toolkit.pipeline.cuts import StageCut, cut_stages
from toolkit.pipeline.stage import Stage
from toolkit.pipeline.stages import build_stage, units_of
from toolkit.runtime.precision import PrecisionPolicy
from toolkit.wire.protocol import ModelSpec

MARGIN = 4.0
"""The tolerance over the largest honest distance measured: rounding's tail grows with depth,
width and training (weights grow), which one measurement does not cover; every attack the checks
must catch stays far above (a 1.3x scale is 0.23, noise at 10% of the norm 0.1, a sign flip 2.0)."""


@dataclass
class HonestDistances:
    """Honest distances of one precision, over ``tasks`` tasks (each several boundaries)."""

    precision: str
    tasks: int = 0
    pairwise: list[float] = field(default_factory=list)
    """One micro-batch against sample by sample, the same precision."""
    to_exact: list[float] = field(default_factory=list)
    """Each of the two against fp64."""

    @property
    def bound(self) -> float:
        """The largest distance two honest computations may have, from this measurement."""
        return max([*self.pairwise, 2 * max(self.to_exact, default=0.0)])

    def beyond(self, tolerance: float) -> int:
        """Honest results a check at ``tolerance`` would have called lies (each compared with the
        other computation and with the exact one): the false bans this measurement predicts."""
        return sum(d > tolerance for d in self.pairwise) + sum(d > tolerance / 2 for d in self.to_exact)

    def summary(self) -> dict[str, float | int | str]:
        def q(values: list[float], p: float) -> float:
            return float(np.quantile(values, p)) if values else 0.0

        return {
            "precision": self.precision,
            "microbatches": self.tasks,
            "checked_results": len(self.pairwise),
            "pairwise_median": q(self.pairwise, 0.5),
            "pairwise_p99": q(self.pairwise, 0.99),
            "pairwise_max": max(self.pairwise, default=0.0),
            "to_exact_median": q(self.to_exact, 0.5),
            "to_exact_max": max(self.to_exact, default=0.0),
            "bound": self.bound,
            "derived_tolerance": derived_tolerance(self.bound),
        }


def derived_tolerance(bound: float) -> float:
    """:data:`MARGIN` times the measured bound, rounded up to one significant digit."""
    value = MARGIN * bound
    if value <= 0:
        return 0.0
    digits = math.floor(math.log10(value))
    return math.ceil(value / 10**digits) * 10**digits


def measure(
    spec: ModelSpec,
    layers: list[int],
    precision: str,
    tasks: int,
    *,
    microbatch_size: int = 2,
    seed: int = 0,
) -> HonestDistances:
    """Compute ``tasks`` micro-batches through every stage of ``spec`` cut into ``layers`` in
    ``precision`` ("fp32", "fp16", "bf16"; CPU autocast) twice -- as one micro-batch and sample by
    sample -- and in fp64, and measure the distances (:func:`relay_server.trust.compare.distance`, the
    checks' own) between them."""
    policy = compute.stage_precision(precision if precision != "fp32" else None, "cpu")
    cuts = cut_stages(units_of(spec), layers)
    g = torch.Generator().manual_seed(seed)
    stages, exact = [], []
    for cut in cuts:
        flat = torch.randn(cut.end - cut.start, generator=g) * 0.02
        stages.append(_loaded(spec, cut, flat, torch.float32))
        exact.append(_loaded(spec, cut, flat, torch.float64))
    seq_len, vocab = _tokens(spec)
    out = HonestDistances(precision)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core: a loaded machine's other threads never stall a measurement
    try:
        for m in range(tasks):
            batch = torch.randint(0, vocab, (microbatch_size, seq_len + 1), generator=g)
            for ours, theirs, truth in _boundaries(stages, exact, batch, m, policy):
                out.pairwise.append(distance(ours, theirs))
                out.to_exact.extend([distance(ours, truth), distance(theirs, truth)])
            out.tasks += 1
    finally:
        torch.set_num_threads(threads)
    return out


def _boundaries(
    stages: list[Stage], exact: list[Stage], batch: torch.Tensor, m: int, policy: PrecisionPolicy
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(whole micro-batch, sample by sample, fp64) for each boundary a task of micro-batch ``m``
    gives, each from the same stored (fp32) inputs."""
    fp32 = compute.stage_precision(None, "cpu")
    x: torch.Tensor = stages[0].inputs(batch)
    inputs = []
    for k, stage in enumerate(stages):
        inputs.append(x)
        if stage.last:
            break
        whole = compute.forward(stage, x, m, policy)
        split = torch.cat([compute.forward(stage, x[i : i + 1], m, policy) for i in range(len(x))])
        truth = compute.forward(exact[k], x if k == 0 else x.double(), m, fp32)
        yield _rows(whole), _rows(split), _rows(truth)
        x = whole.to(torch.float32)  # the boundary the relay stores (fp32 rows), as a check reads it
    grad: torch.Tensor | None = None
    for k in range(len(stages) - 1, 0, -1):
        stage, x = stages[k], inputs[k]
        samples = len(x)

        def input_grad(s: Stage, rows: slice, dtype: torch.dtype, policy: PrecisionPolicy) -> torch.Tensor:
            part = batch[rows] if s.last else None
            g = grad[rows].to(dtype) if grad is not None else None
            r = compute.backward(s, x[rows].to(dtype), m, policy, grad_output=g, batch=part, samples=len(x[rows]))
            assert r.input is not None  # k > 0: a stage's input has a gradient
            return r.input

        whole = input_grad(stage, slice(0, samples), torch.float32, policy)
        split = torch.cat([input_grad(stage, slice(i, i + 1), torch.float32, policy) for i in range(samples)])
        truth = input_grad(exact[k], slice(0, samples), torch.float64, fp32)
        yield _rows(whole), _rows(split), _rows(truth)
        grad = whole.to(torch.float32)


def _loaded(spec: ModelSpec, cut: StageCut, flat: torch.Tensor, dtype: torch.dtype) -> Stage:
    stage = build_stage(spec, cut, "cpu")
    with torch.no_grad():
        stage.load_flat(flat)
    return stage.to(dtype)


def _rows(t: torch.Tensor | None) -> np.ndarray:
    assert t is not None
    return t.detach().to(torch.float64).reshape(-1, t.shape[-1]).numpy()


def _tokens(spec: ModelSpec) -> tuple[int, int]:
    """(sequence length, vocabulary) of a ByteTransformer or transformers decoder spec."""
    if spec.kind == "transformers":
        config = spec.config or {}
        positions = config.get("n_positions") or config.get("max_position_embeddings") or 0
        return int(positions) - 1, int(config["vocab_size"])
    return int(spec.kwargs["seq_len"]), 256
