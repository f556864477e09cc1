"""Task payloads: kept in memory up to a byte budget, spilled to disk beyond it.

Why a budget: the relay runs on a small VM, and a burst of expert calls (or a pipeline's held
activations) must not take its memory. Payloads are opaque bytes (tensor containers); a spilled
one is read back when a worker leases its task. The spill directory is emptied at start: tasks do
not survive a relay restart (their callers time out and retry, as after any relay failure).
"""

from __future__ import annotations

import itertools
import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PayloadRef:
    """A stored payload: ``size`` bytes, in memory or in ``path``."""

    key: int
    size: int
    path: Path | None = None


class PayloadStore:
    def __init__(self, budget_bytes: int, spill_dir: Path | None) -> None:
        if budget_bytes < 0:
            raise ValueError("the task payload budget must be >= 0 bytes")
        self.budget_bytes = budget_bytes
        self.spill_dir = spill_dir
        if spill_dir is not None:
            shutil.rmtree(spill_dir, ignore_errors=True)
            spill_dir.mkdir(parents=True, exist_ok=True)
        self._memory: dict[int, bytes] = {}
        self._ids = itertools.count(1)
        self.memory_bytes = 0
        self.spilled_bytes = 0

    def put(self, data: bytes) -> PayloadRef:
        key = next(self._ids)
        if self.memory_bytes + len(data) <= self.budget_bytes or self.spill_dir is None:
            if self.spill_dir is None and self.memory_bytes + len(data) > self.budget_bytes:
                raise MemoryError(f"task payloads would exceed their {self.budget_bytes}-byte budget")
            self._memory[key] = data
            self.memory_bytes += len(data)
            return PayloadRef(key, len(data))
        path = self.spill_dir / f"{key}.bin"
        path.write_bytes(data)
        self.spilled_bytes += len(data)
        return PayloadRef(key, len(data), path)

    def get(self, ref: PayloadRef) -> bytes:
        if ref.path is None:
            return self._memory[ref.key]
        return ref.path.read_bytes()

    def drop(self, ref: PayloadRef | None) -> None:
        if ref is None:
            return
        if ref.path is None:
            if self._memory.pop(ref.key, None) is not None:
                self.memory_bytes -= ref.size
        else:
            if ref.path.exists():
                self.spilled_bytes -= ref.size
            ref.path.unlink(missing_ok=True)
