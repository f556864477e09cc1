"""What crosses a stage boundary, held on the relay until the batch's round closes.

The relay is every boundary's owner (one hop each way: a stage's output becomes the next stage's
input here, never travelling back to the worker that asked for it), and it keeps what a backward
needs to be recomputed by *any* worker: the stage's input and the gradient of its output. That is
what makes a departed worker's micro-batches re-dispatchable instead of lost, so nothing is
dropped before the round that counts them closed. Entries are opaque tensor containers as the
worker sent them (already validated, :mod:`.results`), so nothing is decoded or re-encoded on the
way through. Memory first up to a byte budget, then disk (:class:`~relay_server.tasks.payload_store.PayloadStore`).

Names: ``batch`` (the micro-batch's data, from the first stage), ``a{k}`` (stage ``k``'s output,
``k < K - 1``), ``g{k}`` (the gradient of ``a{k}``).
"""

from __future__ import annotations

from pathlib import Path

from relay_server.tasks.payload_store import PayloadRef, PayloadStore


class Boundaries:
    def __init__(self, budget_bytes: int, spill_dir: Path | None) -> None:
        self.store = PayloadStore(budget_bytes, spill_dir)
        self._refs: dict[int, dict[str, PayloadRef]] = {}
        self.bytes_in = 0
        """Every byte stored since start (the relay's boundary traffic in; out is at least as much)."""

    def put(self, microbatch: int, name: str, body: bytes) -> None:
        refs = self._refs.setdefault(microbatch, {})
        if name in refs:  # a redone task's boundary: the first one stays (it is what downstream used)
            return
        refs[name] = self.store.put(body)
        self.bytes_in += len(body)

    def has(self, microbatch: int, name: str) -> bool:
        return name in self._refs.get(microbatch, {})

    def get(self, microbatch: int, name: str) -> bytes:
        return self.store.get(self._refs[microbatch][name])

    def drop(self, microbatch: int) -> None:
        for ref in self._refs.pop(microbatch, {}).values():
            self.store.drop(ref)

    @property
    def memory_bytes(self) -> int:
        return self.store.memory_bytes

    @property
    def spilled_bytes(self) -> int:
        return self.store.spilled_bytes
