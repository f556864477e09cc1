"""How a trainer calls experts: the :class:`ExpertCaller` interface and :class:`LoopbackCaller`.

A mixture layer never knows where an expert runs. It asks a caller for the directory snapshot
(:meth:`ExpertCaller.live`) and sends one forward call per chosen expert with the rows routed to
it, later one backward call with ``grad_y`` for the same rows. A call's future either yields a
tensor or raises :class:`ExpertFailed`; the layer treats that (or a future still pending at its
deadline) as a failed expert, never as an error of the training step. The HTTP implementation
through the relay's broker lives in ``toolkit.moe.remote``; :class:`LoopbackCaller` runs the
experts in this process, with the same semantics as an expert host (Learning@home s3.3):

* forward runs under ``no_grad`` and keeps nothing (no side effects);
* backward recomputes the forward with gradients enabled (gradient checkpointing, App. D),
  returns ``d(x)`` and then applies the expert's optimizer -- one step per backward call, in call
  order, as hivemind's ``ModuleBackend.on_backward`` does.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from toolkit.errors import CollabError

FAIL_CODES = ("expert_timeout", "expert_gone", "expert_busy", "bad_result")


class ExpertFailed(CollabError):
    """One expert call did not give a usable answer (timed out, host gone, queue full, bad tensor).

    A mixture layer catches it and averages the surviving experts; it reaches user code only
    from a direct call."""

    default_hint = (
        "Nothing to do for one failure: the mixture averages the experts that answered. If most calls "
        "fail, check that expert hosts are running and that the relay's directory lists them."
    )


@runtime_checkable
class ExpertCaller(Protocol):
    """What a mixture layer needs from the world: live uids, and asynchronous forward/backward."""

    def forward(self, uid: str, x: torch.Tensor) -> concurrent.futures.Future[torch.Tensor]:
        """``x [rows, in] -> y [rows, out]``, computed by the expert ``uid`` without side effects."""
        ...

    def backward(self, uid: str, x: torch.Tensor, grad_y: torch.Tensor) -> concurrent.futures.Future[torch.Tensor]:
        """``(x, dL/dy) -> dL/dx``; the expert's host also updates its parameters from this call."""
        ...

    def live(self) -> frozenset[str]:
        """The current directory snapshot: uids of the experts that may be called."""
        ...


FailRule = Collection[str] | Callable[[str, str, torch.Tensor], bool]
"""Which calls a :class:`LoopbackCaller` fails: a set of uids (every call to them), or
``rule(uid, kind, x) -> bool`` with ``kind`` "forward" or "backward"."""


@dataclass(frozen=True)
class CallRecord:
    """One call a :class:`LoopbackCaller` served, in the order it ran (tests check grouping)."""

    kind: str
    uid: str
    rows: int
    failed: bool


class LoopbackCaller:
    """Experts in this process behind the :class:`ExpertCaller` interface: the unit tests' and
    the in-process reference's caller.

    ``optimizer_factory(module) -> torch.optim.Optimizer`` makes an expert trainable the way a
    host trains it (one optimizer per expert, created on its first backward, one ``step`` per
    backward call). ``on_backward(uid, module)`` runs after each successful backward (and its
    step). Calls run one at a time on one worker thread in submission order, like a host's single
    runtime thread; ``max_workers > 1`` runs them concurrently. ``gone`` holds uids to leave out
    of :meth:`live` (a host that left). Calls matching ``hang`` get a future that never completes
    (a host that went silent: the layer's deadline must end the wait).
    """

    def __init__(
        self,
        experts: Mapping[str, nn.Module],
        fail: FailRule = frozenset(),
        on_backward: Callable[[str, nn.Module], None] | None = None,
        optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
        max_workers: int = 1,
        hang: FailRule = frozenset(),
    ) -> None:
        self.experts = dict(experts)
        self.fail, self.hang = fail, hang
        self.on_backward = on_backward
        self.optimizer_factory = optimizer_factory
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.gone: set[str] = set()
        self.log: list[CallRecord] = []
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="loopback-expert")

    def live(self) -> frozenset[str]:
        return frozenset(self.experts) - frozenset(self.gone)

    def forward(self, uid: str, x: torch.Tensor) -> concurrent.futures.Future[torch.Tensor]:
        return self._submit("forward", uid, x, None)

    def backward(self, uid: str, x: torch.Tensor, grad_y: torch.Tensor) -> concurrent.futures.Future[torch.Tensor]:
        return self._submit("backward", uid, x, grad_y)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> LoopbackCaller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(
        self, kind: str, uid: str, x: torch.Tensor, grad_y: torch.Tensor | None
    ) -> concurrent.futures.Future[torch.Tensor]:
        # Copies: what a host receives is bytes, never a view of the trainer's tensors.
        x = x.detach().clone()
        grad_y = None if grad_y is None else grad_y.detach().clone()
        if _matches(self.hang, uid, kind, x):
            with self._lock:
                self.log.append(CallRecord(kind, uid, x.shape[0], True))
            return concurrent.futures.Future()
        return self._pool.submit(self._run, kind, uid, x, grad_y)

    def _run(self, kind: str, uid: str, x: torch.Tensor, grad_y: torch.Tensor | None) -> torch.Tensor:
        failed = uid not in self.live() or _matches(self.fail, uid, kind, x)
        with self._lock:
            self.log.append(CallRecord(kind, uid, x.shape[0], failed))
        if uid not in self.live():
            raise ExpertFailed("expert_gone", f"expert {uid} is not in this caller's directory")
        if failed:
            raise ExpertFailed("expert_timeout", f"expert {uid} was told to fail this {kind} call (test rule)")
        module = self.experts[uid]
        if grad_y is None:
            with torch.no_grad():
                return module(x)
        return self._backward(uid, module, x, grad_y)

    def _backward(self, uid: str, module: nn.Module, x: torch.Tensor, grad_y: torch.Tensor) -> torch.Tensor:
        opt = self.optimizers.get(uid)
        if opt is None and self.optimizer_factory is not None:
            opt = self.optimizers[uid] = self.optimizer_factory(module)
        module.zero_grad(set_to_none=True)
        with torch.enable_grad():
            x = x.requires_grad_(True)
            y = module(x)  # recomputed: the forward kept no activations (App. D)
            torch.autograd.backward(y, grad_y)
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if self.on_backward is not None:
            self.on_backward(uid, module)
        return x.grad if x.grad is not None else torch.zeros_like(x)  # None: the output ignores its input


def _matches(rule: FailRule, uid: str, kind: str, x: torch.Tensor) -> bool:
    return rule(uid, kind, x) if callable(rule) else uid in rule
