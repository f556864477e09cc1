"""Expert calls as one autograd node: grouped by expert, issued concurrently, failures masked.

``_CallExperts`` is the remote layer's bridge between autograd and an :class:`ExpertCaller`.
Forward gathers, for every chosen expert, the rows routed to it and sends ONE call per expert
(not one per (row, expert) pair as hivemind's gRPC client does: on HTTP each call is a request);
all calls are in flight at once and the layer waits at most ``timeout_s`` for all of them.
Backward sends each expert that answered its rows' ``grad_y`` and sums the returned ``grad_x``;
an expert whose backward fails is a constant (it adds nothing to ``grad_x``, while the gate
still gets its gradient through the mixture weights, which autograd computes outside this node).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from toolkit.moe.calls import ExpertCaller, ExpertFailed

log = logging.getLogger(__name__)
Result = torch.Tensor | ExpertFailed


_STATS_LOCK = threading.Lock()  # module-wide, so stats stay plain data (copyable, picklable)


@dataclass
class MoEStats:
    """A layer's counters since it was built; read them to see how the experts behave (the
    dashboard's failure %)."""

    calls: int = 0
    """Forward calls issued (one per chosen expert per micro-batch)."""
    failures: int = 0
    """Forward calls that failed or timed out."""
    backward_calls: int = 0
    backward_failures: int = 0
    masked_pairs: int = 0
    """(row, expert) pairs excluded from the average because their forward call failed."""
    dropped_rows: int = 0
    """Rows with fewer than ``k_min`` surviving experts: their mixture output is zero."""
    failure_codes: Counter[str] = field(default_factory=Counter)

    def add(self, code: str | None = None, **counts: int) -> None:
        """Add to counters (and count one failure ``code``) atomically: trainer threads share a layer."""
        with _STATS_LOCK:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)
            if code is not None:
                self.failure_codes[code] += 1


class WaitMeter:
    """Seconds one trainer thread's micro-batches spent waiting for expert calls (forward and
    backward). A trainer sizes how many micro-batches it keeps in flight from it
    (:mod:`toolkit.moe.inflight`): compute is a micro-batch's wall time minus this.

    Per thread, captured by the plan at forward time: on CUDA autograd runs a backward on its own
    device thread, and that wait still belongs to the thread whose micro-batch it is."""

    def __init__(self) -> None:
        self.seconds = 0.0


_METERS = threading.local()


def wait_meter() -> WaitMeter:
    """This thread's :class:`WaitMeter` (made on first use)."""
    meter = getattr(_METERS, "meter", None)
    if meter is None:
        meter = _METERS.meter = WaitMeter()
    return meter


@dataclass(frozen=True)
class Group:
    """The rows of one micro-batch routed to one expert: ``rows [r]`` and their top-k ``slots [r]``."""

    uid: str
    rows: torch.Tensor
    slots: torch.Tensor


def group_by_expert(flat: torch.Tensor, valid: torch.Tensor, uid_of: dict[int, str]) -> list[Group]:
    """``flat [n, k]`` expert indices (``valid [n, k]`` marks real choices) -> one group per
    distinct expert, rows ascending, experts in index order (a deterministic call order)."""
    rows, slots = valid.nonzero(as_tuple=True)
    experts = flat[rows, slots]
    order = torch.argsort(experts * flat.shape[0] + rows)  # by expert, then row
    rows, slots, experts = rows[order], slots[order], experts[order]
    uniq, counts = torch.unique_consecutive(experts, return_counts=True)
    groups, start = [], 0
    for e, c in zip(uniq.tolist(), counts.tolist()):
        groups.append(Group(uid_of[e], rows[start : start + c], slots[start : start + c]))
        start += c
    return groups


@dataclass
class CallPlan:
    """What ``_CallExperts`` needs besides the input tensor (autograd passes it through as is)."""

    caller: ExpertCaller
    groups: list[Group]
    k: int
    out_features: int
    timeout_s: float
    backward_timeout_s: float
    stats: MoEStats
    k_min: int = 1
    timeout_after_k_min_s: float | None = None
    answered: list[bool] = field(default_factory=list)
    meter: WaitMeter = field(default_factory=wait_meter)


def wait_all(
    futures: list[concurrent.futures.Future[torch.Tensor]],
    timeout_s: float,
    shapes: list[tuple[int, int]],
    dtype: torch.dtype,
    device: torch.device,
    enough: Callable[[int, bool], bool] | None = None,
    grace_s: float | None = None,
) -> list[Result]:
    """Each future's tensor, or the :class:`ExpertFailed` it stands for: raised by the caller,
    still pending at the deadline (``expert_timeout``; it is cancelled), or a result of the wrong
    shape or with NaN/Inf (``bad_result``: one broken host must not poison the batch).
    Other exceptions are bugs of the caller and propagate.

    ``enough(i, ok)`` is told of each finished call (by position; ``ok`` for a good answer) and
    says when the answers so far suffice; from then on the wait lasts at most ``grace_s`` more (hivemind's
    ``timeout_after_k_min``), so one straggler does not hold the whole micro-batch."""
    start = time.monotonic()
    deadline = start + timeout_s
    results: dict[int, Result] = {}
    pending = {fut: i for i, fut in enumerate(futures)}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        done, _ = concurrent.futures.wait(pending, timeout=left, return_when=concurrent.futures.FIRST_COMPLETED)
        for fut in done:
            i = pending.pop(fut)
            results[i] = _outcome(fut, shapes[i], dtype, device)
            if enough is not None and grace_s is not None and enough(i, isinstance(results[i], torch.Tensor)):
                deadline = min(deadline, time.monotonic() + grace_s)
                enough = None
    waited = time.monotonic() - start
    for fut, i in pending.items():
        fut.cancel()
        results[i] = ExpertFailed(
            "expert_timeout",
            f"no answer after {waited:.2f} s (timeout {timeout_s} s"
            + (f", or {grace_s} s once k_min experts answered)" if grace_s is not None else ")"),
        )
    return [results[i] for i in range(len(futures))]


def _outcome(
    fut: concurrent.futures.Future[torch.Tensor], shape: tuple[int, int], dtype: torch.dtype, device: torch.device
) -> Result:
    try:
        value = fut.result(timeout=0)
    except ExpertFailed as exc:
        return exc
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape or not torch.isfinite(value).all():
        what = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        return ExpertFailed("bad_result", f"expected a finite tensor of shape {shape}, got {what}")
    return value.to(dtype=dtype, device=device)


def k_min_reached(groups: list[Group], n: int, k_min: int) -> Callable[[int, bool], bool]:
    """``enough`` for a forward: every row has ``k_min`` good answers, or no call of it is left."""
    chosen = torch.zeros(n, dtype=torch.long)
    for g in groups:
        chosen[g.rows] += 1
    good, finished = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)

    def answered(i: int, ok: bool) -> bool:
        finished[groups[i].rows] += 1
        if ok:
            good[groups[i].rows] += 1
        return bool(((good >= k_min) | (finished == chosen)).all())

    return answered


class _CallExperts(torch.autograd.Function):
    """``x [n, in] -> (y [n, k, out], answered [n, k])``; ``y`` is zero where the call failed.

    ``ctx`` is ``Any``, as in torch's own Functions: its stub type (``FunctionCtx``) lacks
    ``saved_tensors``, ``needs_input_grad`` and the ``plan`` stored on it."""

    @staticmethod
    def forward(ctx: Any, _dummy: torch.Tensor, x: torch.Tensor, plan: CallPlan) -> tuple[torch.Tensor, torch.Tensor]:
        futures = [plan.caller.forward(g.uid, x[g.rows]) for g in plan.groups]
        plan.stats.add(calls=len(futures))
        shapes = [(len(g.rows), plan.out_features) for g in plan.groups]
        started = time.monotonic()
        results = wait_all(
            futures,
            plan.timeout_s,
            shapes,
            x.dtype,
            x.device,
            k_min_reached(plan.groups, x.shape[0], plan.k_min),
            plan.timeout_after_k_min_s,
        )
        plan.meter.seconds += time.monotonic() - started
        y = x.new_zeros(x.shape[0], plan.k, plan.out_features)
        answered = torch.zeros(x.shape[0], plan.k, dtype=torch.bool, device=x.device)
        plan.answered = []
        for g, res in zip(plan.groups, results):
            plan.answered.append(isinstance(res, torch.Tensor))
            if isinstance(res, torch.Tensor):
                y[g.rows, g.slots] = res
                answered[g.rows, g.slots] = True
            else:
                plan.stats.add(res.code, failures=1)
                log.debug("expert %s failed its forward: %s", g.uid, res)
        ctx.plan = plan
        ctx.save_for_backward(x)
        ctx.mark_non_differentiable(answered)
        return y, answered

    @staticmethod
    def backward(
        ctx: Any, grad_y: torch.Tensor, _grad_answered: torch.Tensor | None
    ) -> tuple[None, torch.Tensor | None, None]:
        (x,) = ctx.saved_tensors
        plan: CallPlan = ctx.plan
        todo = [g for g, ok in zip(plan.groups, plan.answered) if ok]
        futures = [plan.caller.backward(g.uid, x[g.rows], grad_y[g.rows, g.slots]) for g in todo]
        plan.stats.add(backward_calls=len(futures))
        started = time.monotonic()
        results = wait_all(
            futures, plan.backward_timeout_s, [(len(g.rows), x.shape[1]) for g in todo], x.dtype, x.device
        )
        plan.meter.seconds += time.monotonic() - started
        grad_x = torch.zeros_like(x)
        for g, res in zip(todo, results):
            if isinstance(res, torch.Tensor):
                grad_x.index_add_(0, g.rows, res)
            else:
                plan.stats.add(res.code, backward_failures=1)
                log.debug("expert %s failed its backward (treated as a constant): %s", g.uid, res)
        return None, (grad_x if ctx.needs_input_grad[1] else None), None


# Makes autograd call _CallExperts.backward even when x needs no gradient (the mixture's input is
# the data itself): the experts' hosts learn from the backward calls, not from this process.
_ALWAYS_BACKWARD = torch.empty(0, requires_grad=True)


def call_experts(x: torch.Tensor, plan: CallPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the plan's forward calls as one autograd node: ``(y [n, k, out], answered [n, k])``."""
    return _CallExperts.apply(_ALWAYS_BACKWARD, x, plan)
