"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2): Adam's
moments with bias correction, weight decay inside the update, and each tensor's step scaled by a
trust ratio ``phi(||w||) / ||update||`` -- the optimizer sahajBERT trained with.

Per tensor ``w`` with gradient ``g`` at step ``t``::

    m = b1 m + (1 - b1) g                 v = b2 v + (1 - b2) g^2
    r = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
    u = r + weight_decay * w
    w -= lr * trust * u,   trust = phi(||w||) / ||u||,  1 when either norm is 0

``phi(z) = min(z, clamp)`` (``clamp = 0``: no clamp), torch_optimizer's ``clamp_value`` (its
default 10; sahajBERT's run used 10000). Unlike torch_optimizer's ``debias=True``, the bias
corrections sit inside ``r`` as in the paper, so they only matter through ``eps`` and weight
decay: the trust ratio normalizes the step's length to ``lr * phi(||w||)``.

The trust ratio is a per-tensor quantity: every parameter handed to this optimizer must be a
whole model tensor (:class:`relay_server.rounds.master.MasterState` refuses a slice that cuts one).
A group's tensors step together with ``torch._foreach_*`` ops; the only P-sized temporary is the
update itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.optim.optimizer import ParamsT


class Lamb(torch.optim.Optimizer):
    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        clamp: float = 10.0,
    ) -> None:
        if lr <= 0 or eps <= 0 or weight_decay < 0 or clamp < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"invalid LAMB settings: lr={lr} betas={betas} eps={eps} weight_decay={weight_decay} clamp={clamp}"
            )
        super().__init__(
            params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "clamp": clamp}
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One LAMB step; the closure's loss, if given. (torch types ``step`` as two overloads,
        a loss iff a closure: this one signature says the same, hence the ignore.)"""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._step_group(group, params)
        return loss

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        eps, wd, clamp, lr = group["eps"], group["weight_decay"], group["clamp"], group["lr"]
        grads: list[torch.Tensor] = []
        exp_avgs: list[torch.Tensor] = []
        exp_avg_sqs: list[torch.Tensor] = []
        steps: list[float] = []
        for p in params:
            grad = cast(torch.Tensor, p.grad)  # step() hands over only parameters with a gradient
            if grad.is_sparse:
                raise RuntimeError("LAMB does not support sparse gradients")
            state = self.state[p]
            if not state:  # the same keys as torch.optim.Adam's (checkpoints, slice moves)
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            grads.append(grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(float(state["step"]))
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        # update = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps), built in one buffer
        update = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(update, [math.sqrt(1.0 - beta2**t) for t in steps])
        torch._foreach_add_(update, eps)
        torch._foreach_reciprocal_(update)
        torch._foreach_mul_(update, exp_avgs)
        torch._foreach_div_(update, [1.0 - beta1**t for t in steps])
        if wd:
            torch._foreach_add_(update, params, alpha=wd)
        w_norm = torch.stack(torch._foreach_norm(params)).double()
        u_norm = torch.stack(torch._foreach_norm(update)).double()
        if clamp > 0:
            w_norm = w_norm.clamp(max=clamp)
        trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm.clamp(min=1e-300), 1.0)
        torch._foreach_mul_(update, [-lr * t for t in trust.tolist()])
        torch._foreach_add_(params, update)
