"""Which arithmetic a peer trains in, and the loss scaling fp16 needs.

The local choice (DESIGN.md s8), from a :class:`~toolkit.runtime.environment.DeviceInfo`:

* **bf16** on TPU and on CUDA GPUs of compute capability >= 8.0 (A100, L4, H100, RTX 30xx+):
  fp32's exponent range, so no loss scaling.
* **fp16 with loss scaling** on CUDA 6.0 (P100) and 7.x (V100, T4): they have fast fp16 but no
  bf16 (torch disables bf16 autocast there).
* **fp32** everywhere else: CPU (bf16 autocast works there but is slower than fp32 on CPUs without
  AMX), MPS (autocast support on Apple GPUs depends on the macOS and torch versions, and a laptop
  contributes little), and CUDA GPUs without fast fp16 (compute capability < 6.0, or 6.1/6.2 such
  as the P4/P40/GTX 10xx, which run fp16 at a fraction of fp32 speed).

A run can **pin** one policy for every peer (``run.precision`` in the relay's config): DeDLOC saw
divergence when fp16 GPUs and bf16 TPUs trained together (Appendix I.7). A pin overrides the
local choice where the hardware executes that arithmetic; where it does not,
:func:`choose_precision` raises :class:`PrecisionUnsupported` rather than silently training in
something else, because a silent substitute is exactly the mix the pin exists to prevent:

============  ======  ======  ======
pin ->        bf16    fp16    fp32
============  ======  ======  ======
tpu           yes     NO      yes
cuda >= 8.0   yes     yes     yes
cuda 6.x-7.x  NO      yes     yes
cuda < 6.0    NO      yes*    yes
mps           NO      NO      yes
cpu           yes*    yes*    yes
============  ======  ======  ======

``*`` correct but slow (no fast units for that type): allowed, with a warning in the log.

fp16's loss scaler is local to each peer and never shared (DESIGN.md s11): an overflow makes
:meth:`PrecisionPolicy.unscale_and_check` return False and the peer drops that one micro-batch;
the collaboration never sees the bad gradient, and no other peer's scale changes.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch

from toolkit.errors import PrecisionUnsupported
from toolkit.runtime.environment import DeviceInfo

log = logging.getLogger(__name__)

PolicyName = Literal["bf16", "fp16", "fp32"]
POLICIES: tuple[str, ...] = ("bf16", "fp16", "fp32")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_AUTOCAST_DEVICE = {"cuda": "cuda", "tpu": "xla", "mps": "mps", "cpu": "cpu"}
_FAST_FP16 = {(6, 0)}  # P100; every 7.x (V100 7.0, Xavier 7.2, T4 7.5) has tensor cores


class LossScaler:
    """A dynamic loss scaler for one peer, written for our split of the step.

    Why not ``torch.amp.GradScaler``: it couples the overflow decision to ``scaler.step(opt)``,
    which skips ``opt.step()`` and must be followed by ``update()``; it refuses a second
    ``unscale_`` before ``update``; it leaves non-finite values in ``.grad``; and its moves
    (``torch.cuda.amp`` -> ``torch.amp``, with changing signatures) are among the install breakers
    DESIGN.md s11 lists. Here the caller needs one answer -- "are these gradients, unscaled in
    place, usable?" -- before :class:`~toolkit.optimizer.CollaborativeOptimizer` adds them to its
    accumulator, and the scaler that gives it is a few dozen lines.

    Scale dynamics are GradScaler's: start at ``init_scale``, halve on overflow, double after
    ``growth_interval`` clean steps, never below ``min_scale``.
    """

    def __init__(
        self,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
    ) -> None:
        if not (
            growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval > 0 and init_scale >= min_scale > 0
        ):
            raise ValueError(
                "need growth_factor > 1, 0 < backoff_factor < 1, growth_interval > 0 and init_scale >= min_scale > 0"
            )
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.clean_steps = 0  # since the last overflow or growth
        self.overflows = 0  # total, for the panel
        self.consecutive_overflows = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    @torch.no_grad()
    def unscale_and_check(self, params: Iterable[torch.Tensor]) -> bool:
        """Unscale every ``.grad`` in place; on inf/NaN zero them instead and return False."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return True
        # One reduction and one host sync for the whole model: a non-finite element makes its
        # tensor's norm non-finite, and so the sum. Norms in fp32 so fp16 grads cannot overflow
        # in the norm itself.
        total = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).sum()
        if not math.isfinite(float(total)):
            torch._foreach_zero_(grads)  # nothing non-finite may reach the accumulator
            self._overflowed()
            return False
        torch._foreach_mul_(grads, 1.0 / self.scale)
        self.consecutive_overflows = 0
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0
        return True

    def _overflowed(self) -> None:
        self.overflows += 1
        self.consecutive_overflows += 1
        self.clean_steps = 0
        self.scale = max(self.min_scale, self.scale * self.backoff_factor)
        log.info("fp16 overflow: micro-batch skipped, loss scale now %g", self.scale)
        if self.scale == self.min_scale and self.consecutive_overflows >= 10:
            log.warning(
                "fp16: %d overflows in a row at the minimum loss scale: the loss itself is not "
                "finite. Check the data and learning rate, or ask the organizer to pin bf16/fp32.",
                self.consecutive_overflows,
            )

    def state(self) -> dict[str, Any]:
        return {"scale": self.scale, "overflows": self.overflows}


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """The arithmetic of the forward/backward pass; parameters and gradients stay fp32.

    Use it around the usual loop::

        with policy.autocast():
            loss = model.loss(batch)
        policy.scale_loss(loss).backward()
        if policy.unscale_and_check(model.parameters()):
            opt.step(...)            # else: fp16 overflow, skip only this micro-batch
    """

    name: PolicyName
    device_type: str
    """``torch.autocast`` device type: "cuda", "xla", "mps" or "cpu"."""
    pinned: bool = False
    """True when the run's pin decided, not this peer's hardware."""
    reason: str = ""
    scaler: LossScaler | None = field(default=None, compare=False)
    """fp16 only; local to this peer, never sent anywhere but as statistics."""

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.name]

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Wrap the forward pass (and the loss); a no-op for fp32."""
        if self.name == "fp32":
            yield
            return
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            yield

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward()`` on (multiplied by the loss scale under fp16)."""
        return self.scaler.scale_loss(loss) if self.scaler is not None else loss

    def unscale_and_check(self, params: Iterable[torch.Tensor]) -> bool:
        """fp16: unscale grads in place; False (grads zeroed) if they overflowed. Else True, free."""
        return self.scaler.unscale_and_check(params) if self.scaler is not None else True

    def to_json(self) -> dict[str, Any]:
        """What the relay shows for this peer: the policy, why, and (fp16) the scaler's state."""
        data: dict[str, Any] = {
            "name": self.name,
            "device_type": self.device_type,
            "pinned": self.pinned,
            "reason": self.reason,
            "loss_scaling": self.scaler is not None,
        }
        if self.scaler is not None:
            data.update(self.scaler.state())
        return data


def local_choice(info: DeviceInfo) -> tuple[PolicyName, str]:
    """The policy this hardware trains best in, and why (module docstring)."""
    if info.kind == "tpu":
        return "bf16", "TPUs compute natively in bf16"
    if info.kind == "cuda":
        cc = info.compute_capability or (0, 0)
        if cc >= (8, 0):
            return "bf16", f"compute capability {cc[0]}.{cc[1]} >= 8.0 has bf16 tensor cores"
        if cc in _FAST_FP16 or (7, 0) <= cc < (8, 0):
            return "fp16", f"compute capability {cc[0]}.{cc[1]} has fast fp16 but no bf16"
        return "fp32", f"compute capability {cc[0]}.{cc[1]} has no fast fp16 or bf16"
    if info.kind == "mps":
        return "fp32", "Apple MPS: autocast support varies by macOS/torch version"
    return "fp32", "CPU: fp32 is the fast, exact path"


def _support(info: DeviceInfo, name: str) -> Literal["yes", "slow", "no"]:
    """Can this hardware execute ``name``? (the table in the module docstring)"""
    if name == "fp32":
        return "yes"
    cc = info.compute_capability or (0, 0)
    table: dict[str, dict[str, Literal["yes", "slow", "no"]]] = {
        "tpu": {"bf16": "yes", "fp16": "no"},
        "mps": {"bf16": "no", "fp16": "no"},
        "cpu": {"bf16": "slow", "fp16": "slow"},
        "cuda": {
            "bf16": "yes" if cc >= (8, 0) else "no",
            "fp16": "yes" if cc >= (7, 0) or cc in _FAST_FP16 else "slow",
        },
    }
    return table[info.kind][name]


def choose_precision(
    info: DeviceInfo, pinned: str | None = None, *, scaler: LossScaler | None = None
) -> PrecisionPolicy:
    """The policy this peer trains in: the run's ``pinned`` one ("bf16"/"fp16"/"fp32") if set,
    else :func:`local_choice`. Raises :class:`PrecisionUnsupported` if the pin cannot run here.

    ``scaler`` overrides the default fp16 :class:`LossScaler` (tests, tuning).
    """
    device_type = _AUTOCAST_DEVICE[info.kind]
    if pinned:
        if pinned not in POLICIES:
            raise PrecisionUnsupported(
                "bad_precision",
                f"unknown precision {pinned!r}",
                "Pin one of bf16, fp16, fp32 (or leave run.precision empty).",
            )
        support = _support(info, pinned)
        if support == "no":
            raise PrecisionUnsupported(
                "precision_unsupported",
                f"this run pins {pinned}, which {info.label} cannot execute",
                _unsupported_hint(info, pinned),
            )
        if support == "slow":
            log.warning("this run pins %s; %s runs it correctly but slowly", pinned, info.label)
        reason = "pinned by the run" + (f" (correct but slow on {info.name})" if support == "slow" else "")
        name, is_pinned = cast(PolicyName, pinned), True
    else:
        name, reason = local_choice(info)
        is_pinned = False
    policy = PrecisionPolicy(
        name=name,
        device_type=device_type,
        pinned=is_pinned,
        reason=reason,
        scaler=(scaler or LossScaler()) if name == "fp16" else None,
    )
    log.info("precision %s on %s: %s", name, info.label, reason)
    return policy


def _unsupported_hint(info: DeviceInfo, pinned: str) -> str:
    where = {
        "bf16": "a GPU of compute capability >= 8.0 (A100, L4, H100, RTX 30xx+), a TPU or a CPU",
        "fp16": "a CUDA GPU (T4, P100, V100 or newer) or a CPU",
    }[pinned]
    platform_fix = {
        "colab": " On Colab pick Runtime -> Change runtime type.",
        "kaggle": " On Kaggle pick Settings -> Accelerator.",
    }.get(info.platform or "", "")
    return f"Join from {where}, or ask the organizer to pin fp32 or leave the precision unpinned.{platform_fix}"
