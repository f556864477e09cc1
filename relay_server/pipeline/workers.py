"""Which worker runs which stage.

In our star every worker reaches every boundary through the same link (the relay's), so the
paper's "pick the stage with the best bandwidth" reduces to compute balance under memory: a
worker goes to the stage whose measured task rate is lowest (the sum of its workers' tasks per
second as the relay timed them; a worker not measured yet counts as its stage's median; worker
counts while some stage has no measurement), among the stages its memory can hold (the
planner's accounting, :func:`.star_model.stage_memory`). A worker's self-reported speed is kept
for the dashboard but never places anyone: any number can be claimed, and one idle worker
claiming a huge one would draw every joiner away from its stage.
A worker that can hold no stage is told so at once, with what it would need.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from relay_server.core.errors import ApiError


@dataclass
class Worker:
    peer_id: str
    stage: int
    memory_bytes: int
    samples_per_s: float


class Workers:
    def __init__(self, stage_params: list[int], stage_bytes: list[int], *, sticky: bool = False) -> None:
        """``sticky``: a worker that left and comes back gets its former stage again (the static
        pipeline baseline, whose micro-batches wait for their worker)."""
        self.stage_params = stage_params
        self.stage_bytes = stage_bytes
        self.sticky = sticky
        self.former: dict[str, int] = {}
        self.by_id: dict[str, Worker] = {}

    def need_bytes(self, stage: int) -> int:
        return self.stage_bytes[stage]

    def placement(self) -> dict[str, tuple[int, int]]:
        """worker -> (stage, memory bytes): what the planner re-times."""
        return {w.peer_id: (w.stage, w.memory_bytes) for w in self.by_id.values()}

    def move(self, peer_id: str, stage: int) -> None:
        self.by_id[peer_id].stage = stage

    def assign(
        self,
        peer_id: str,
        memory_bytes: int,
        samples_per_s: float,
        task_s: Callable[[str], float | None] = lambda worker: None,
    ) -> Worker:
        """Keep a worker's stage across polls and rejoins; place a new one at the weakest stage it
        fits (``task_s``: a worker's measured seconds per task, None until measured)."""
        known = self.by_id.get(peer_id)
        if known is not None:
            known.memory_bytes, known.samples_per_s = memory_bytes, samples_per_s
            return known
        fits = [k for k in range(len(self.stage_params)) if not memory_bytes or self.need_bytes(k) <= memory_bytes]
        if not fits:
            smallest = min(range(len(self.stage_params)), key=self.need_bytes)
            raise ApiError(
                409,
                "stage_too_large",
                f"this worker offers {memory_bytes / 2**20:.0f} MiB; the smallest "
                f"stage needs {self.need_bytes(smallest) / 2**20:.0f} MiB",
                "Join from a machine with more accelerator memory, or ask the organizer for more pipeline.stages.",
            )
        former = self.former.get(peer_id) if self.sticky else None
        rates = {k: self._rate(k, task_s) for k in fits}
        if all(rate is not None for rate in rates.values()):
            weakest = min(fits, key=lambda k: (rates[k], len(self.on_stage(k))))
        else:  # some stage unmeasured: fewest workers first
            weakest = min(fits, key=lambda k: len(self.on_stage(k)))
        stage = former if former in fits else weakest
        worker = Worker(peer_id, stage, memory_bytes, samples_per_s)
        self.by_id[peer_id] = worker
        return worker

    def _rate(self, stage: int, task_s: Callable[[str], float | None]) -> float | None:
        """Tasks per second ``stage``'s workers do, measured (None: none of them measured; 0: none)."""
        members = self.on_stage(stage)
        measured = [1.0 / t for w in members if (t := task_s(w))]  # inf (serves nobody): 0 tasks/s
        if not members:
            return 0.0
        if not measured:
            return None
        return sum(measured) + (len(members) - len(measured)) * statistics.median(measured)

    def stage_of(self, peer_id: str) -> int:
        worker = self.by_id.get(peer_id)
        if worker is None:
            raise ApiError(
                409,
                "no_stage",
                "this worker has no stage (it left, or the relay restarted)",
                "Ask for a stage again (the toolkit does this on its own).",
            )
        return worker.stage

    def remove(self, peer_id: str) -> None:
        worker = self.by_id.pop(peer_id, None)
        if worker is not None and self.sticky:
            self.former[peer_id] = worker.stage

    def on_stage(self, stage: int) -> list[str]:
        return sorted(w.peer_id for w in self.by_id.values() if w.stage == stage)
