"""A trainer that hides the experts' latency: J micro-batches in flight, each on its own replica.

A micro-batch of a model with ``L`` mixture layers waits for ``2 x L`` sequential rounds of expert
calls (each layer's forward, then each layer's backward), every one a round trip through the
relay. One micro-batch at a time, a trainer at 200 ms of latency idles for most of each
micro-batch: Learning@home's answer (s3.3, Figure 4) is to keep many micro-batches in flight,
so the compute of one overlaps the others' waits. :class:`InFlightTrainer` does that for
:func:`toolkit.join`:

* **J workers, each with its own replica** of the model (``copy.deepcopy`` of the dense parts; the
  expert caller and the mixtures' :class:`~toolkit.moe.dispatch.MoEStats` are shared, so the panel
  counts every call). Own replicas, because the collaborative optimizer sums each micro-batch's
  gradient into its accumulator: threads sharing one model would mix their ``.grad``.
* **Snapshots by version.** The main thread publishes the parameters it loaded (one copy per
  version); a micro-batch is computed on the snapshot current when it was *issued*, and its result
  names that version, so :meth:`~toolkit.optimizer.CollaborativeOptimizer.contribute` can tell a
  gradient too stale for the run (dropped and counted, never silently) from a fresh one.
* **In submission order.** Results are handed to the optimizer in the order the micro-batches
  were drawn from the data, whatever order they finish in: the sum, and the run, are those of the
  same micro-batches trained one at a time.
* **Never overshoot a round.** No micro-batch is issued while the samples in flight would take
  the collaboration past ``target_batch`` (:meth:`~toolkit.optimizer.CollaborativeOptimizer.room`):
  they would be computed on parameters about to be replaced. With one trainer and
  ``max_staleness = 0`` this makes J > 1 exactly large-batch training (tests/test_moe_relay.py).
* **J from measurements.** A micro-batch's critical path is its local compute ``c`` plus its waits
  ``w`` for expert calls (:class:`~toolkit.moe.dispatch.WaitMeter`). While one micro-batch waits,
  ``w / c`` others can compute, so ``J = clamp(ceil((c + w) / c), 1, J_max)`` keeps the device busy.
  ``c`` is the worker thread's CPU time for the micro-batch, or its wall time less ``w`` if that
  is smaller: wall time alone also counts the time other threads held the CPU, and on a loaded
  machine it sized J at 13 where 32 kept 0.91 of the throughput (benchmarks/moe_latency.py);
  ``c`` and ``w`` are running averages, so J follows the network as it changes. J starts at 1 and
  replicas are built as J grows (each holds a copy of the dense parameters and its activations).
  Where the hosts, not the trainer, are the bottleneck, their queues count as waits too and J
  climbs to ``J_max`` without raising throughput (the benchmark's 0 ms case): harmless but for
  the replicas' memory, which ``join(moe_in_flight=J)`` bounds.

Workers are daemon threads: :meth:`InFlightTrainer.close` stops them without waiting for a call
still in flight (it ends by its own timeout, its result unused). An exception in a worker (a
``DeviceOutOfMemory`` the compute function raised, a bug) is raised in the main thread when its
micro-batch's turn comes.
"""

from __future__ import annotations

import concurrent.futures
import copy
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from toolkit.moe.dispatch import MoEStats, wait_meter

if TYPE_CHECKING:
    from toolkit.optimizer import CollaborativeOptimizer

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 32
"""J_max: the most micro-batches in flight when J is sized from measurements. At 200 ms of latency
and 4 mixture layers a micro-batch waits about 1.6 s; 32 keeps a trainer busy down to about 50 ms
of compute per micro-batch, and bounds the replicas' memory (32 copies of the dense parameters)."""
POLL_S = 0.1
"""While every micro-batch is held back for a round: how often the collaboration is asked."""

CALLS_PER_MICRO_BATCH = 4
"""Expert calls one micro-batch has in flight at once, for sizing the caller's threads: a layer
sends one call per distinct expert its rows chose (k for one row, up to the grid for many)."""


def call_threads(jobs: int | None) -> int:
    """Threads (and connections) the expert caller needs for ``jobs`` micro-batches in flight
    (None: sized from measurements, up to :data:`MAX_IN_FLIGHT`): fewer would queue the calls
    of micro-batches in flight behind each other, the latency J exists to hide."""
    return max(16, CALLS_PER_MICRO_BATCH * (jobs or MAX_IN_FLIGHT))


Compute = Callable[[nn.Module, Any, Any], tuple[float, bool]]
"""``compute(replica, policy, batch) -> (loss, finite)``: forward and backward of one micro-batch
on ``replica`` under ``policy``; ``finite`` False when the gradients must be skipped (fp16
overflow). The caller's, so it keeps its precision handling and its out-of-memory error."""


@dataclass(frozen=True)
class Snapshot:
    """The parameters loaded at one version, in ``model.parameters()`` order (never written)."""

    version: int
    tensors: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Result:
    """One micro-batch: its gradients (per-sample means, ``model.parameters()`` order)."""

    grads: list[torch.Tensor]
    samples: int
    loss: float
    finite: bool
    version: int
    compute_s: float
    wait_s: float


@dataclass(frozen=True)
class _Job:
    batch: Any
    samples: int
    snapshot: Snapshot
    future: concurrent.futures.Future[Result]


class InFlightTrainer:
    """J worker threads computing micro-batches of ``model`` on replicas (module docstring).

    ``shared``: objects every replica references instead of copying (the expert caller);
    ``policy``: the precision policy, one copy per worker (an fp16 loss scaler is per replica:
    one worker's overflow must not change the scale another's loss was multiplied by);
    ``jobs``: J fixed (1: one micro-batch at a time, as a plain loop); None sizes it from
    measurements, up to :data:`MAX_IN_FLIGHT`.
    """

    def __init__(
        self, model: nn.Module, compute: Compute, policy: Any, *, shared: tuple[Any, ...] = (), jobs: int | None = None
    ) -> None:
        if jobs is not None and jobs < 1:
            raise ValueError(f"moe_in_flight must be >= 1 (or None: sized from measurements), got {jobs}")
        self.model, self.compute, self.policy = model, compute, policy
        self.fixed = jobs is not None
        self._shared = (
            *shared,
            *(m.stats for m in model.modules() if isinstance(getattr(m, "stats", None), MoEStats)),
        )
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._snapshot: Snapshot | None = None
        self._compute_s: float | None = None
        self._wait_s = 0.0
        self.jobs = jobs or 1
        """J now: the micro-batches to keep in flight (unless fixed, re-estimated after each result)."""
        self.most_jobs = self.jobs
        self._closed = False

    # --- the main thread ----------------------------------------------------------------------
    def run(
        self,
        opt: CollaborativeOptimizer,
        batches: Iterator[Any],
        size_of: Callable[[Any], int],
        on_result: Callable[[Result], bool],
        should_stop: Callable[[], bool],
    ) -> None:
        """Train on ``batches`` until they end, ``opt`` finishes, ``on_result`` (called after each
        result was contributed) or ``should_stop`` (asked while waiting for a round) says stop."""
        pending: deque[tuple[concurrent.futures.Future[Result], int]] = deque()
        exhausted = False
        try:
            while True:
                if self._snapshot is None or self._snapshot.version != opt.version:
                    self.publish(opt.version)
                in_flight = sum(n for _, n in pending)
                while not exhausted and not opt.finished and len(pending) < self.jobs and in_flight < opt.room():
                    try:
                        batch = next(batches)
                    except StopIteration:
                        exhausted = True
                        break
                    n = size_of(batch)
                    pending.append((self.submit(batch, n), n))
                    in_flight += n
                if not pending:
                    if exhausted or opt.finished or should_stop():
                        return
                    opt.sync()  # held back for a round: report, contribute, load what it produced
                    if self._snapshot is not None and opt.version == self._snapshot.version:
                        time.sleep(POLL_S)
                    continue
                result = pending.popleft()[0].result()
                self._observe(result)
                opt.contribute(
                    result.grads,
                    batch_size=result.samples,
                    loss=result.loss,
                    version=result.version,
                    skip=not result.finite,
                )
                if on_result(result):
                    return
        finally:
            for future, _ in pending:
                future.cancel()

    def publish(self, version: int) -> None:
        """Make the model's parameters (just loaded at ``version``) what new micro-batches compute on."""
        with torch.no_grad():
            self._snapshot = Snapshot(version, tuple(p.detach().clone() for p in self.model.parameters()))

    def submit(self, batch: Any, samples: int) -> concurrent.futures.Future[Result]:
        """Queue one micro-batch on the current snapshot; its :class:`Result` comes in the future."""
        if self._snapshot is None:
            raise RuntimeError("publish() the parameters before the first submit()")
        while len(self._threads) < self.jobs:
            self._start_worker()
        future: concurrent.futures.Future[Result] = concurrent.futures.Future()
        self._jobs.put(_Job(batch, samples, self._snapshot, future))
        return future

    def close(self) -> None:
        """Stop the workers (idempotent); a micro-batch still computing is abandoned."""
        if self._closed:
            return
        self._closed = True
        while True:  # micro-batches no worker took: nobody will
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.future.cancel()
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout=0.5)

    def _observe(self, result: Result) -> None:
        """Re-estimate J from one micro-batch's compute and waits (running averages)."""
        if self._compute_s is None:
            self._compute_s, self._wait_s = result.compute_s, result.wait_s
        else:
            self._compute_s = 0.8 * self._compute_s + 0.2 * result.compute_s
            self._wait_s = 0.8 * self._wait_s + 0.2 * result.wait_s
        if self.fixed:
            return
        c = max(self._compute_s, 1e-4)
        jobs = max(1, min(MAX_IN_FLIGHT, math.ceil((c + self._wait_s) / c)))
        if jobs != self.jobs:
            log.info(
                "%d micro-batches in flight (compute %.0f ms, expert waits %.0f ms per micro-batch)",
                jobs,
                1000 * self._compute_s,
                1000 * self._wait_s,
            )
        self.jobs = jobs
        self.most_jobs = max(self.most_jobs, jobs)

    # --- the workers --------------------------------------------------------------------------
    def _start_worker(self) -> None:
        memo = {id(obj): obj for obj in self._shared}
        replica = copy.deepcopy(self.model, memo)
        for p in replica.parameters():
            p.grad = None
        t = threading.Thread(
            target=self._work,
            args=(replica, copy.deepcopy(self.policy)),
            daemon=True,
            name=f"collab-micro-batch-{len(self._threads)}",
        )
        self._threads.append(t)
        t.start()

    def _work(self, replica: nn.Module, policy: Any) -> None:
        params = list(replica.parameters())
        version: int | None = None
        meter = wait_meter()
        while True:
            job = self._jobs.get()
            if job is None or self._closed:
                return
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                if version != job.snapshot.version:
                    with torch.no_grad():
                        for p, value in zip(params, job.snapshot.tensors):
                            p.copy_(value)
                    version = job.snapshot.version
                started, cpu, waited = time.monotonic(), time.thread_time(), meter.seconds
                loss, finite = self.compute(replica, policy, job.batch)
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                for p in params:
                    p.grad = None
                wall, cpu, waited = time.monotonic() - started, time.thread_time() - cpu, meter.seconds - waited
                job.future.set_result(
                    Result(
                        grads,
                        job.samples,
                        loss,
                        finite,
                        job.snapshot.version,
                        max(min(wall - waited, cpu), 0.0),
                        waited,
                    )
                )
            except BaseException as exc:  # raised in the main thread when this micro-batch's turn comes
                job.future.set_exception(exc)
