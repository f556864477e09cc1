"""Spot checks of pipeline results, and what a failed one costs its worker.

**Which tasks** (:mod:`.shares`): a share per worker, chosen by an HMAC of the task's id under a
secret drawn when the relay starts, so a worker cannot predict which of its results are checked:
a new worker's first result in each of its first batches (probation), a worker the monitors find odd
(:mod:`.monitor`) every result, everyone else the run's base share (``[pipeline] check_share``).
Only results that hold a boundary are checked (a forward's activations,
a backward's gradient of its stage's input); a redo and stage 0's backward send none (their
parameter gradient goes up summed at the round, out of reach of a per-task check).

**How.** A checked task is submitted again to its stage's queue, excluding its worker: another
worker leases it as it leases any task (same kind, stage, micro-batch, inputs, version; nothing
in the task says "check"), and its result is compared with the first within the run's tolerance
(:mod:`.compare`). A check's result is never used: a forward's goes nowhere, a backward's is
answered ``accepted: false`` (what a duplicate result gets), so the checker drops its parameter
gradient and nothing is counted twice. A first-stage task reads the worker's own data, so it
cannot be re-issued unnoticed: the relay's own copy of the stage (:mod:`.referee`) computes it on
the data the result carries. When two workers disagree the referee computes the task too, and
every result beyond the tolerance from the referee's is a lie.

**Consequences.** A liar is banned (:meth:`PipelineTrust.ban`: the coordinator restarts the open
batch, so every result it delivered there is recomputed by others, and the relay's moderation
records the ban). A round opens only once every check of its batch settled, so no lie found in a
batch is ever counted. Every accepted result no check covers (not chosen, no one could serve its
check, or one that holds no boundary: its parameter gradient is out of reach) is reported
(``unchecked``): a ban
that comes after such results were counted rolls every stage back to the version before them
(:mod:`relay_server.pipeline.rollback`). A check nobody can serve (no other worker of the stage, the referee on
another version) is dropped as *unserved*, never left blocking the round.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from relay_server.core.errors import ApiError
from relay_server.trust.compare import distance, rows
from relay_server.trust.monitor import ResultMonitor
from relay_server.trust.shares import PROBATION, CheckShares
from relay_server.trust.task_kinds import FIRST, StepLike, output_name
from toolkit.wire.compression import Codec
from toolkit.wire.protocol import TrustBan, TrustStatus

if TYPE_CHECKING:
    from relay_server.trust.referee import Referee  # torch: built only on a relay that checks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrustDeps:
    """What the checks work through, each owned by the pipeline's coordinator."""

    share: float
    tolerance: float
    width: int
    codec: Codec
    submit_check: Callable[[StepLike, frozenset[str]], str]
    """Queue ``step`` again for any worker of its stage but ``exclude``; the check task's id."""
    cancel: Callable[[str], None]
    can_serve: Callable[[int, frozenset[str]], bool]
    """Whether a worker of the stage, not excluded, serves it now."""
    inputs: Callable[[StepLike], dict[str, bytes]]
    """The stored boundary entries a task of ``step`` reads."""
    version: Callable[[], int]
    batch: Callable[[], int]
    banned: Callable[[str, str], None]
    """The coordinator: ``worker`` was banned (the reason): restart the batch, drop the worker."""
    settled: Callable[[], None]
    """The coordinator: no check is pending any more (the round may open)."""
    referee: Referee | None = None
    probation: int = PROBATION
    """Batches whose first result of a new worker is always checked (:mod:`.shares`)."""
    unchecked: Callable[[int, str], None] = lambda batch, worker: None
    """An accepted result of ``worker`` in ``batch`` that no check covers (a late ban may undo it:
    :mod:`relay_server.pipeline.rollback`)."""


@dataclass
class Check:
    step: StepLike
    worker: str
    output: str
    expected: np.ndarray
    """The original result's boundary."""
    version: int
    inputs: dict[str, bytes] = field(default_factory=dict)
    """What the referee reads (a first-stage task: the data its result carried)."""
    answers: dict[str, np.ndarray] = field(default_factory=dict)
    """checker -> its result."""
    task_id: str | None = None


@dataclass
class TrustCounters:
    checks: int = 0
    agreed: int = 0
    disagreed: int = 0
    refereed: int = 0
    unserved: int = 0
    max_agreeing_distance: float = 0.0
    batches_restarted: int = 0


class PipelineTrust:
    def __init__(self, deps: TrustDeps) -> None:
        self.deps = deps
        self.monitor = ResultMonitor()
        self.shares = CheckShares(deps.share, self.monitor, deps.probation)
        self.pending: dict[str, Check] = {}  # check task id (or "ref:<task id>" while refereed) -> check
        self.banned: dict[str, str] = {}  # worker -> reason
        self.bans: list[TrustBan] = []
        self.failed: dict[str, int] = {}  # worker -> checks it lost
        self.reset: set[str] = set()  # workers that must drop what they hold before their next task
        self.counters = TrustCounters()
        self.referee_tasks: set[asyncio.Task[None]] = set()

    # --- admission ------------------------------------------------------------------------------
    def admit(self, worker: str, *, work: bool = False) -> None:
        """Refuse a banned worker (403); on its next work request, tell a worker whose batch was
        restarted to take its stage again (409 ``batch_restarted``: it drops the stage gradients it
        held, which belonged to the restarted batch)."""
        if worker in self.banned:
            raise ApiError(
                403,
                "banned",
                f"this worker was banned from the pipeline: {self.banned[worker]}",
                "A worker's results are checked against other workers' and the relay's own; run the "
                "unmodified toolkit.",
            )
        if work and worker in self.reset:
            self.reset.discard(worker)
            raise ApiError(
                409,
                "batch_restarted",
                "the batch in flight restarted after a dishonest worker was banned",
                "Drop the stage gradients you hold and take your stage again (the toolkit does this).",
            )

    def must_reset(self, workers: list[str]) -> None:
        self.reset.update(workers)

    # --- results --------------------------------------------------------------------------------
    def chosen(self, task_id: str, worker: str, batch: int) -> bool:
        """Whether ``worker``'s result of ``task_id`` would be checked now (:mod:`.shares`)."""
        return self.shares.chosen(task_id, worker, batch)

    def accepted(
        self,
        task_id: str,
        step: StepLike,
        worker: str,
        entries: Mapping[str, bytes],
        norms: Mapping[str, tuple[float, int]],
    ) -> None:
        """A result of ``step`` was accepted: score it; maybe check it."""
        for name, (norm, size) in norms.items():
            self.monitor.observe(f"{name}{step.stage}", worker, norm, size)
        output = output_name(step)
        if output is None or output not in entries or not self.shares.choose(task_id, worker, step.batch):
            self.deps.unchecked(step.batch, worker)  # not chosen, or out of any check's reach
            return
        self.counters.checks += 1
        check = Check(
            step=step,
            worker=worker,
            output=output,
            expected=rows(entries[output], self.deps.width, self.deps.codec),
            version=self.deps.version(),
        )
        if step.kind == FIRST:  # its data is the worker's own: only the relay can compute it again
            check.inputs = {"batch": entries["batch"]}
            self._referee(f"ref:{task_id}", check)
        elif self.deps.can_serve(step.stage, frozenset({worker})):
            check.task_id = self.deps.submit_check(step, frozenset({worker}))
            self.pending[check.task_id] = check
        elif self.deps.referee is not None:
            self._referee(f"ref:{task_id}", check)
        else:
            self._unserved(check)

    def is_check(self, task_id: str) -> bool:
        return task_id in self.pending

    def check_result(self, task_id: str, worker: str, entries: Mapping[str, bytes]) -> None:
        """A checker's result for check ``task_id``: agree, or referee the two."""
        check = self.pending.pop(task_id)
        answer = rows(entries[check.output], self.deps.width, self.deps.codec) if check.output in entries else None
        d = distance(check.expected, answer) if answer is not None else 2.0
        if d <= self.deps.tolerance:
            self.counters.agreed += 1
            self.counters.max_agreeing_distance = max(self.counters.max_agreeing_distance, d)
            self._settle()
            return
        self.counters.disagreed += 1
        log.warning(
            "pipeline check: %s task of stage %d, micro-batch %d: worker %s and worker %s differ by %.3g "
            "(tolerance %.3g); the relay referees",
            check.step.kind,
            check.step.stage,
            check.step.microbatch,
            check.worker[:16],
            worker[:16],
            d,
            self.deps.tolerance,
        )
        check.answers[worker] = answer if answer is not None else np.zeros((0, self.deps.width), np.float32)
        if self.deps.referee is None:
            self._unserved(check)
            self._settle()
            return
        self._referee(f"ref:{task_id}", check)

    # --- the referee ----------------------------------------------------------------------------
    def _unserved(self, check: Check) -> None:
        """Nobody could compute ``check``: its result stays unchecked."""
        self.counters.unserved += 1
        self.deps.unchecked(check.step.batch, check.worker)

    def _referee(self, key: str, check: Check) -> None:
        if self.deps.referee is None:
            self._unserved(check)
            return
        check.inputs = {**self.deps.inputs(check.step), **check.inputs}
        self.pending[key] = check
        task = asyncio.get_running_loop().create_task(self._run_referee(key, check))
        self.referee_tasks.add(task)
        task.add_done_callback(self.referee_tasks.discard)

    async def _run_referee(self, key: str, check: Check) -> None:
        try:
            truth = await asyncio.to_thread(
                self.deps.referee.compute,  # type: ignore[union-attr]  # _referee starts this only with a referee
                check.step,
                check.version,
                check.inputs,
            )
        except Exception:  # a referee that cannot compute decides nothing
            log.exception("the relay could not referee a %s task of stage %d", check.step.kind, check.step.stage)
            truth = None
        if self.pending.get(key) is not check:
            return  # the batch ended or restarted meanwhile
        del self.pending[key]
        self.counters.refereed += 1
        if truth is None:
            self._unserved(check)
            self._settle()
            return
        liars = [
            (w, d)
            for w, result in [(check.worker, check.expected), *check.answers.items()]
            if (d := distance(truth, result)) > self.deps.tolerance
        ]
        honest = [distance(truth, r) for w, r in [(check.worker, check.expected), *check.answers.items()]]
        self.counters.max_agreeing_distance = max(
            [self.counters.max_agreeing_distance, *(d for d in honest if d <= self.deps.tolerance)]
        )
        for worker, d in liars:
            self.ban(
                worker,
                f"its {check.step.kind} result for stage {check.step.stage}, micro-batch {check.step.microbatch} "
                f"is {d:.3g} (relative L2) from the relay's own computation, tolerance {self.deps.tolerance:.3g}",
            )
        self._settle()

    # --- consequences ---------------------------------------------------------------------------
    def ban(self, worker: str, reason: str) -> None:
        if worker in self.banned:
            return
        self.record_ban(worker, reason)
        self.counters.batches_restarted += 1
        self.deps.banned(worker, reason)

    def record_ban(self, worker: str, reason: str) -> None:
        """``worker`` is refused from now on (:meth:`admit`) and listed; what the ban does to the
        pipeline is the caller's (:meth:`ban`: the batch restarts)."""
        self.banned[worker] = reason
        self.failed[worker] = self.failed.get(worker, 0) + 1
        self.bans.append(TrustBan(worker=worker, reason=reason, batch=self.deps.batch()))
        log.warning("pipeline worker %s banned: %s", worker[:16], reason)

    def batch_over(self) -> None:
        """The batch ended or restarted: its checks go (their tasks are cancelled by the coordinator)."""
        self.pending.clear()

    def expire(self) -> None:
        """Drop every check no worker can serve now (its stage has no worker but the excluded ones)."""
        for task_id, check in list(self.pending.items()):
            if task_id.startswith("ref:"):
                continue  # at the referee
            excluded = frozenset({check.worker, *check.answers})
            if not self.deps.can_serve(check.step.stage, excluded):
                del self.pending[task_id]
                self.deps.cancel(task_id)
                if self.deps.referee is not None:
                    self._referee(f"ref:{task_id}", check)
                else:
                    self._unserved(check)
        self._settle()

    def _settle(self) -> None:
        if not self.pending:
            self.deps.settled()

    @property
    def settled(self) -> bool:
        return not self.pending

    def status(self) -> TrustStatus:
        c = self.counters
        return TrustStatus(
            check_share=self.deps.share,
            tolerance=self.deps.tolerance,
            probation=self.shares.probation if self.deps.share > 0 else 0,
            probation_checks=self.shares.probation_checks,
            on_probation=self.shares.on_probation(),
            checks=c.checks,
            agreed=c.agreed,
            disagreed=c.disagreed,
            refereed=c.refereed,
            unserved=c.unserved,
            pending=len(self.pending),
            max_agreeing_distance=c.max_agreeing_distance,
            batches_restarted=c.batches_restarted,
            bans=list(self.bans),
            monitored=self.monitor.observed,
            outliers=self.monitor.outliers,
            suspects=sorted(w for w in self.monitor.suspicion if self.monitor.suspect(w)),
        )
