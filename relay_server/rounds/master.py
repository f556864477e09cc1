"""Master parameters and optimizer state: the backbone's single source of truth (DESIGN.md s3).

The parameters live in one flat float32 vector ``flat`` (P,). The optimizer sees 1-D views into
it, one per model tensor, so a slice ``[start, end)`` of the vector -- what an aggregator owns
under the LP plan -- is just the views that intersect it. The averaged gradient is reduced
straight into ``grad`` (P,), whose views are the parameters' ``.grad``: no copies at step time.

Weight decay applies to matrices and embeddings (ndim >= 2), not to biases and norms.

Per-tensor quantities need whole tensors: LAMB's trust ratio (:mod:`.lamb`) is refused on a slice
that cuts a tensor (the plan's cuts fall on tensor boundaries, :meth:`Plan.slices`). Global
quantities need every slice: ``clip_grad_norm`` clips a proper slice by the global norm its caller
passes (:meth:`MasterState.apply_gradient`), which the relay sums from every owner's
:meth:`MasterState.grad_sq_norm` before any of them steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from relay_server.core.config import OptimizerSection
from relay_server.core.typed import ConfigError
from toolkit.wire.protocol import ParamSpec
from toolkit.wire.schedule import lr_at as schedule_lr


def layout_of(model: torch.nn.Module) -> list[ParamSpec]:
    """The flat layout of a model's parameters, in ``named_parameters`` order."""
    specs, offset = [], 0
    for name, p in model.named_parameters():
        specs.append(ParamSpec(name=name, shape=list(p.shape), offset=offset))
        offset += p.numel()
    return specs


def lr_at(step: int, cfg: OptimizerSection, total_steps: int) -> float:
    """Learning rate for the update that produces version ``step + 1`` (:func:`toolkit.wire.schedule.lr_at`)."""
    return schedule_lr(step, lr=cfg.lr, schedule=cfg.schedule, warmup_steps=cfg.warmup_steps, total_steps=total_steps)


@dataclass
class StepReport:
    step: int  # the new version
    lr: float
    grad_norm: float
    refused: bool = False  # a slice's step refused: the version holds the slice unchanged


class NonFiniteStep(Exception):
    """The step would have made the parameters or the optimizer state non-finite.

    ``touched``: the optimizer had already stepped, so the master's state is no longer the one
    before the step and the caller must reload it (:meth:`Publisher.apply_step
    <relay_server.rounds.publisher.Publisher.apply_step>` does, from the version's state file).
    False: refused before the optimizer ran, nothing changed."""

    def __init__(self, message: str, *, touched: bool) -> None:
        super().__init__(message)
        self.touched = touched


class MasterState:
    """Parameters ``[start, end)`` of the flat vector plus the optimizer that updates them.
    ``params`` is the whole vector (P,) or just the slice (end - start,)."""

    def __init__(
        self,
        layout: list[ParamSpec],
        params: np.ndarray,
        cfg: OptimizerSection,
        total_steps: int,
        step: int = 0,
        start: int = 0,
        end: int | None = None,
        *,
        adopt: bool = False,
        grad: np.ndarray | None = None,
    ) -> None:
        """``grad``: a float32 buffer of the slice's length to reduce the gradient into (a view of
        a longer one whose tail the owner hands on: :class:`~relay_server.backbone.slice_owner.SliceOwner`'s
        ``carry``); zeros of its own by default."""
        self.cfg, self.total_steps, self.step = cfg, total_steps, step
        self.start, self.end = start, params.size if end is None else end
        whole = (self.start, self.end) == (0, params.size) and params.dtype == np.float32 and params.flags.c_contiguous
        values = params if params.size == self.end - self.start else params[self.start : self.end]  # slice or whole
        # adopt=True: the caller hands over a fresh float32 vector (no third copy of P floats at startup)
        self.flat = torch.from_numpy(params if adopt and whole else np.array(values, dtype=np.float32))
        self.grad = torch.zeros_like(self.flat) if grad is None else torch.from_numpy(grad)
        if self.grad.shape != self.flat.shape or self.grad.dtype != torch.float32:
            raise ValueError(f"the gradient buffer must be float32 of {self.flat.numel()} values")
        _check_slice(layout, self.start, self.end, cfg)
        decay: list[tuple[torch.nn.Parameter, int]] = []  # (parameter, offset in the slice)
        no_decay: list[tuple[torch.nn.Parameter, int]] = []
        for spec in layout:
            lo, hi = max(spec.offset, self.start), min(spec.offset + math.prod(spec.shape), self.end)
            if lo >= hi:
                continue
            p = torch.nn.Parameter(self.flat[lo - self.start : hi - self.start])  # shares storage
            p.grad = self.grad[lo - self.start : hi - self.start]
            (decay if len(spec.shape) >= 2 else no_decay).append((p, lo - self.start))
        self.params = [p for p, _ in decay + no_decay]
        self.positions = [at for _, at in decay + no_decay]  # where each param starts within the slice
        groups: list[dict[str, Any]] = [
            {"params": [p for p, _ in decay], "weight_decay": cfg.weight_decay},
            {"params": [p for p, _ in no_decay], "weight_decay": 0.0},
        ]
        self.optimizer = _make_optimizer(groups, cfg)

    @property
    def numel(self) -> int:
        return self.end - self.start

    def grad_sq_norm(self) -> float:
        """Squared L2 norm of ``self.grad`` (owners' squares are summed into the global norm):
        :func:`overflow_safe_norm`'s ~8 ms per 100 MB, not a float64 ``vector_norm``'s ~80 ms, on
        the sliced round's critical path."""
        return overflow_safe_norm(self.grad) ** 2

    def apply_gradient(self, global_norm: float | None = None) -> StepReport:
        """One optimizer step with the mean gradient already in ``self.grad``. ``clip_grad_norm``
        clips by ``global_norm`` -- the whole mean gradient's norm, when this is a proper slice --
        or else by this gradient's own norm. The report carries the own (unclipped) norm.

        Raises :class:`NonFiniteStep` instead of making anything non-finite: before
        the step when the gradient's norm is not finite (nothing changed), after it when the
        parameters or the optimizer state are (``touched``: the caller reloads the state; the
        step counter has not moved). The norm is overflow-safe (:func:`overflow_safe_norm`): in
        float32 the squares of a finite gradient overflowed (1e22 per value made the round's
        grad_norm inf, and the status that stored it unserializable)."""
        lr = lr_at(self.step, self.cfg, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        grad_norm = overflow_safe_norm(self.grad)
        clip_by = grad_norm if global_norm is None else global_norm
        if not (math.isfinite(grad_norm) and math.isfinite(clip_by)):
            raise NonFiniteStep(f"the mean gradient's norm is {clip_by:g}", touched=False)
        if self.cfg.clip_grad_norm > 0 and clip_by > self.cfg.clip_grad_norm:
            self.grad.mul_(self.cfg.clip_grad_norm / (clip_by + 1e-6))
        self.optimizer.step()
        broken = self.non_finite()
        if broken:
            raise NonFiniteStep(f"the optimizer step made {broken} non-finite", touched=True)
        self.step += 1
        return StepReport(self.step, lr, grad_norm)

    def non_finite(self) -> str:
        """The first of the parameters (NaN, Inf or beyond :data:`PARAM_LIMIT`) and the
        optimizer's floating-point state (NaN or Inf) that is not fit to publish; "" if none.
        One ``aminmax`` per tensor: a read pass, multithreaded, no temporary (NaN propagates to
        both ends, an infinity is one of them) -- 4 ms per 100 MB where ``isfinite().all()`` took
        180 ms and allocated a bool per value. Adam's ``exp_avg_sq`` (g * g) can overflow while
        the parameters stay finite, hence the state too."""
        if self.flat.numel() and not _extent(self.flat) <= PARAM_LIMIT:  # NaN compares False
            return "the parameters"
        for p, state in self.optimizer.state.items():
            for key, value in state.items():
                if (
                    torch.is_tensor(value)
                    and value.is_floating_point()
                    and value.numel()
                    and not math.isfinite(_extent(value))
                ):
                    return f"the optimizer state {key!r}"
        return ""

    def optimizer_tensors(self) -> dict[str, torch.Tensor]:
        """The optimizer state as named tensors ``opt.<param index>.<key>`` (checkpoint content)."""
        tensors = {}
        index = {id(p): i for i, p in enumerate(self.params)}
        for p, state in self.optimizer.state.items():
            for key, value in state.items():
                tensor = value if torch.is_tensor(value) else torch.tensor(float(value))
                tensors[f"opt.{index[id(p)]}.{key}"] = tensor
        return tensors

    def export_state(self) -> dict[str, np.ndarray]:
        """Parameters and optimizer state as flat arrays over the slice, independent of how the
        vector was cut: ``params`` (n,), ``opt.<key>`` (n,) for per-element state (Adam moments,
        SGD momentum) and ``opt_scalar.<key>`` () for per-tensor counters (Adam's step). Any
        ``[a, b)`` of it is a valid state for the slice ``[start + a, start + b)`` -- this is what
        moves when the plan re-slices the vector (:meth:`import_state`)."""
        out = {"params": self.flat.numpy().copy()}
        for p, at in zip(self.params, self.positions):
            for key, value in self.optimizer.state.get(p, {}).items():
                value = value if torch.is_tensor(value) else torch.tensor(float(value))
                if value.numel() == p.numel() and value.ndim == 1:
                    flat = out.setdefault(f"opt.{key}", np.zeros(self.numel, dtype=np.float32))
                    flat[at : at + p.numel()] = value.detach().float().numpy()
                elif value.numel() == 1:
                    out.setdefault(f"opt_scalar.{key}", np.asarray(float(value), dtype=np.float64))
                else:  # e.g. blockwise-quantized state, whose blocks do not survive re-slicing
                    raise ValueError(
                        f"optimizer state {key!r} of shape {tuple(value.shape)} cannot be "
                        "moved between slices; use 32-bit optimizer state with aggregators"
                    )
        return out

    def import_state(self, state: dict[str, np.ndarray], step: int) -> None:
        """Load :meth:`export_state`'s arrays (cut to this slice) and set the step counter."""
        self.flat.copy_(torch.from_numpy(np.require(state["params"], np.float32, ["W"])))
        self.optimizer.state.clear()
        for p, at in zip(self.params, self.positions):
            values: dict[str, torch.Tensor] = {}
            for name, array in state.items():
                if name.startswith("opt."):
                    values[name[4:]] = torch.from_numpy(np.array(array[at : at + p.numel()], dtype=np.float32))
                elif name.startswith("opt_scalar."):
                    # one value; () as exported, (1,) once it crossed the wire (containers are flat)
                    values[name[11:]] = torch.tensor(float(np.asarray(array).reshape(-1)[0]), dtype=torch.float32)
            if values:
                self.optimizer.state[p] = values
        self.step = step

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], step: int, *, adopt: bool = False) -> None:
        """Load parameters and optimizer state. ``adopt=True``: the tensors were freshly loaded for
        this master alone (a restart), so the optimizer keeps them instead of a copy."""
        self.flat.copy_(tensors["params"])
        state: dict[int, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            if name.startswith("opt."):
                _, index, key = name.split(".", 2)
                state.setdefault(int(index), {})[key] = tensor if adopt else tensor.clone()
        self.optimizer.state.clear()
        for i, values in state.items():
            if self.cfg.state_bits != 8 and "state1" in values:  # an 8-bit checkpoint, resumed in 32-bit
                from relay_server.rounds.optim8bit import fp32_state

                values = fp32_state(values)
            self.optimizer.state[self.params[i]] = values
        self.step = step


def overflow_safe_norm(tensor: torch.Tensor, chunk: int = 1 << 14) -> float:
    """The L2 norm of a float32 tensor, finite for any finite one (NaN if it holds NaN or Inf).

    Float32 dot products (BLAS) of 16K-value chunks, added in float64; a chunk whose float32
    squares overflowed is redone in float64. Per 100 MB here: ~8 ms, relative error <= 1.2e-6
    (equal values, the worst case); ``vector_norm`` took 4 ms in float32 but erred by 1.5e-3 (and
    overflowed to inf past 1.8e19), 73 ms with ``dtype=float64`` -- too slow for every
    round's critical path."""
    flat = tensor.detach().reshape(-1).numpy()
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is retried below, not a warning
        for start in range(0, flat.size, chunk):
            part = flat[start : start + chunk]
            square = float(np.dot(part, part))
            if not math.isfinite(square):
                wide = part.astype(np.float64)
                square = float(np.dot(wide, wide))
            total += square
    return math.sqrt(total)


PARAM_LIMIT = float(np.finfo(np.float32).max) / 2
"""The largest parameter magnitude a step may publish: the difference of two parameters (a lossy
codec's delta between versions) then stays finite too."""


def _extent(tensor: torch.Tensor) -> float:
    """``max |x|`` of a non-empty tensor, NaN if it holds one (one pass: min and max together)."""
    smallest, largest = torch.aminmax(tensor.detach().reshape(-1))
    low, high = float(smallest), float(largest)
    return math.nan if math.isnan(low) or math.isnan(high) else max(-low, high)


def tensor_boundaries(layout: list[ParamSpec]) -> list[int]:
    """Every offset where a tensor starts or ends, ``0`` and ``P`` included, ascending."""
    ends = {spec.offset + math.prod(spec.shape) for spec in layout}
    return sorted({0} | {spec.offset for spec in layout} | ends)


def slice_boundaries(layout: list[ParamSpec], cfg: OptimizerSection) -> list[int] | None:
    """Where the plan may cut the vector for this optimizer (:meth:`Plan.slices`): tensor
    boundaries for LAMB, whose trust ratio is per tensor; anywhere (None) for the elementwise
    ones (adamw, adam, sgd), which keep element-exact shares -- a one-tensor model still slices."""
    return tensor_boundaries(layout) if cfg.name == "lamb" else None


def _check_slice(layout: list[ParamSpec], start: int, end: int, cfg: OptimizerSection) -> None:
    total = max((spec.offset + math.prod(spec.shape) for spec in layout), default=end)
    if (start, end) == (0, total):
        return
    if cfg.name == "lamb":
        bounds = set(tensor_boundaries(layout))
        if start not in bounds or end not in bounds:
            raise ConfigError(
                f"optimizer.name = 'lamb' needs slices on tensor boundaries; [{start}, {end}) cuts a "
                "tensor (its trust ratio is per tensor)"
            )


def _make_optimizer(groups: list[dict[str, Any]], cfg: OptimizerSection) -> torch.optim.Optimizer:
    if cfg.state_bits == 8:
        from relay_server.rounds.optim8bit import make_adamw8bit  # bitsandbytes only where asked for

        return make_adamw8bit(groups, cfg)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
    betas = (float(cfg.betas[0]), float(cfg.betas[1]))
    if cfg.name == "lamb":
        from relay_server.rounds.lamb import Lamb

        return Lamb(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, clamp=cfg.lamb_clamp)
    if cfg.name == "adam":
        return torch.optim.Adam(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
