"""Which worker runs which stage.

In our star every worker reaches every boundary through the same link (the relay's), so the
paper's "pick the stage with the best bandwidth" reduces to compute balance under memory: a
worker goes to the stage whose compute per unit of work is lowest (its workers' measured speeds
over the stage's share of the model's parameters; worker counts before anything was measured),
among the stages its memory can hold (the planner's accounting, :func:`.star_model.stage_memory`).
A worker that can hold no stage is told so at once, with what it would need.
"""

from __future__ import annotations

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

    def assign(self, peer_id: str, memory_bytes: int, samples_per_s: float) -> Worker:
        """Keep a worker's stage across polls and rejoins; place a new one at the weakest stage it fits."""
        known = self.by_id.get(peer_id)
        if known is not None:
            known.memory_bytes, known.samples_per_s = memory_bytes, samples_per_s
            return known
        fits = [k for k in range(len(self.stage_params)) if not memory_bytes or self.need_bytes(k) <= memory_bytes]
        if not fits:
            smallest = min(range(len(self.stage_params)), key=self.need_bytes)
            raise ApiError(409, "stage_too_large", f"this worker offers {memory_bytes / 2**20:.0f} MiB; the smallest "
                           f"stage needs {self.need_bytes(smallest) / 2**20:.0f} MiB",
                           "Join from a machine with more accelerator memory, or ask the organizer for more "
                           "pipeline.stages.")
        former = self.former.get(peer_id) if self.sticky else None
        stage = former if former in fits else min(fits, key=self._strength)
        worker = Worker(peer_id, stage, memory_bytes, samples_per_s)
        self.by_id[peer_id] = worker
        return worker

    def _strength(self, stage: int) -> tuple[float, int]:
        members = [w for w in self.by_id.values() if w.stage == stage]
        speed = sum(w.samples_per_s for w in members)
        return (speed / max(1, self.stage_params[stage]), len(members))

    def stage_of(self, peer_id: str) -> int:
        worker = self.by_id.get(peer_id)
        if worker is None:
            raise ApiError(409, "no_stage", "this worker has no stage (it left, or the relay restarted)",
                           "Ask for a stage again (the toolkit does this on its own).")
        return worker.stage

    def remove(self, peer_id: str) -> None:
        worker = self.by_id.pop(peer_id, None)
        if worker is not None and self.sticky:
            self.former[peer_id] = worker.stage

    def on_stage(self, stage: int) -> list[str]:
        return sorted(w.peer_id for w in self.by_id.values() if w.stage == stage)
