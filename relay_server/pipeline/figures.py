"""What a pipeline run counts about itself for the people around it: each worker's credit, the
bytes its transfers moved, the work it paid for twice, and how far the batch in flight is.

A pipeline step is not a round of samples that peers upload, so the collaboration's own figures
(samples accumulated toward the target, contributions at upload time, the averaging plan) say
nothing true about it: the worker contributing was once shown "0", the round bar "0 of 32"
against a 31 s batch, the bytes per sample "-". These are the relay's own counts instead, kept
where the events happen (an accepted result, a committed batch, a body sent or received) and
read by :mod:`.status` for ``GET /api/pipeline`` and by the collaboration's status
(:meth:`relay_server.pipeline.feature.run_figures`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from toolkit.wire.protocol import PipelineTraffic, WastedWork, WorkerCredit

MAX_CREDITED = 4096
"""Workers whose credit is kept after they left (a volunteer asks for its own when it leaves)."""
RECENT_BATCHES = 20
"""Committed batches whose wasted work ``GET /api/pipeline`` lists."""


@dataclass
class PipelineBytes:
    """The pipeline's bodies through the relay, by what they carry (:class:`PipelineTraffic`)."""

    boundaries_up: int = 0
    boundaries_down: int = 0
    stage_gradients_up: int = 0
    stage_params_down: int = 0

    def report(self) -> PipelineTraffic:
        return PipelineTraffic(
            boundaries_up=self.boundaries_up,
            boundaries_down=self.boundaries_down,
            stage_gradients_up=self.stage_gradients_up,
            stage_params_down=self.stage_params_down,
        )


@dataclass(frozen=True)
class WasteTotals:
    """The run's wasted-work counters at one moment (each owned by whoever counts it)."""

    redispatched: int
    recomputed: int
    refused: int


class PipelineFigures:
    """Credits per worker, bytes by kind, wasted work per batch: counts only, no policy."""

    def __init__(self) -> None:
        self.bytes = PipelineBytes()
        self.credits: OrderedDict[str, list[int]] = OrderedDict()  # worker -> [tasks, samples]
        self.wasted: list[WastedWork] = []
        self.batch_start = WasteTotals(0, 0, 0)

    def resume(self, samples_by_worker: dict[str, int]) -> None:
        """A restarted relay: each worker's samples as the store credited them before (tasks and
        wasted work count from the restart), so a worker's row, its leaderboard entry and its
        ``join()`` result still agree."""
        for worker, samples in samples_by_worker.items():
            if samples > 0:
                self._entry(worker)[1] += samples

    def _entry(self, worker: str) -> list[int]:
        entry = self.credits.get(worker)
        if entry is None:
            entry = self.credits[worker] = [0, 0]
            while len(self.credits) > MAX_CREDITED:
                self.credits.popitem(last=False)
        self.credits.move_to_end(worker)
        return entry

    def task_accepted(self, worker: str) -> None:
        """The first result of a task came from ``worker``."""
        self._entry(worker)[0] += 1

    def batch_committed(self, contributions: dict[str, int]) -> None:
        """A batch's step was published: each worker gains the samples it was credited with (the
        same ``contributions`` the leaderboard and the store credit)."""
        for worker, samples in contributions.items():
            self._entry(worker)[1] += samples

    def credit(self, worker: str, stage: int | None = None) -> WorkerCredit:
        tasks, samples = self.credits.get(worker, (0, 0))
        return WorkerCredit(peer_id=worker, stage=stage, tasks=tasks, samples=samples)

    def wasted_since(self, batch: int, totals: WasteTotals) -> WastedWork:
        """The wasted work of ``batch`` so far: the counters' growth since it started."""
        start = self.batch_start
        return WastedWork(
            batch=batch,
            redispatched=totals.redispatched - start.redispatched,
            recomputed=totals.recomputed - start.recomputed,
            refused=totals.refused - start.refused,
        )

    def batch_over(self, batch: int, totals: WasteTotals) -> None:
        """``batch`` committed: its wasted work is recorded, the next one counts from here."""
        self.wasted = (self.wasted + [self.wasted_since(batch, totals)])[-RECENT_BATCHES:]
        self.batch_start = totals


def tasks_per_batch(microbatches: int, stages: int) -> int:
    """A batch's tasks: per micro-batch a forward on every stage (the last one's ``last`` task
    runs its backward too) and a backward on every stage but the last."""
    return microbatches * (2 * stages - 1)


def batch_eta_s(measured_batch_s: float | None, done: int, total: int, elapsed_s: float | None) -> float | None:
    """Seconds until the batch in flight commits: the measured time per batch scaled by the
    tasks left, and never less than what remains of the measured time since the batch began
    (its round -- every stage's gradient upload -- comes after the last task). None before a
    batch was measured."""
    if measured_batch_s is None:
        return None
    by_tasks = measured_batch_s * (total - done) / total if total else 0.0
    by_time = measured_batch_s - elapsed_s if elapsed_s is not None else measured_batch_s
    return max(by_tasks, by_time, 0.0)
