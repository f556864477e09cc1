"""The batches in flight: one, or with delayed parameter updates (``run.max_staleness = 1``) two --
the older finishing its last tasks and its round, the newer computing alongside it.

Which version a batch computes on is fixed here, when it is minted, never by timing: batch ``b``
on version ``max(b - staleness, 0)``, so a run with delayed updates is exactly one process that
applies batch ``b``'s gradient, computed at step ``b - 1``'s parameters, to step ``b``'s. Batch
``b``'s micro-batches are ``b * d ..`` (the same ids after a restart).
"""

from __future__ import annotations

from relay_server.pipeline.ledger import Ledger


class InFlight:
    """The ledgers of the batches in flight, by batch (oldest first), and the next ids."""

    def __init__(self, first_batch: int, num_stages: int, per_batch: int, staleness: int) -> None:
        self.num_stages, self.per_batch, self.staleness = num_stages, per_batch, staleness
        self.batch_index = first_batch
        """The newest batch minted (the first one is minted as this one)."""
        self.next_microbatch = first_batch * per_batch
        self.ledgers: dict[int, Ledger] = {}

    def mint(self, batch: int) -> Ledger:
        """Batch ``batch``'s ledger, on the version the staleness says (a batch restarted after a
        ban is minted again, with its own micro-batch ids)."""
        ledger = Ledger(batch, max(batch - self.staleness, 0), self.num_stages, self.next_microbatch, self.per_batch)
        self.next_microbatch += self.per_batch
        self.batch_index = batch
        self.ledgers[batch] = ledger
        return ledger

    def due(self, published: int) -> bool:
        """Whether the next batch may start: fewer than ``1 + staleness`` are in flight and its
        version is published (with staleness 1, batch ``b + 1`` once version ``b`` exists)."""
        return len(self.ledgers) <= self.staleness and max(self.batch_index + 1 - self.staleness, 0) <= published

    def closing(self) -> Ledger:
        """The oldest batch in flight: the one whose round is open, or opens next."""
        return self.ledgers[min(self.ledgers)]

    def close(self) -> Ledger:
        """The oldest batch's round closed: it is no longer in flight."""
        return self.ledgers.pop(min(self.ledgers))

    def versions(self) -> set[int]:
        """The versions some batch in flight computes on (the relay keeps serving them)."""
        return {ledger.version for ledger in self.ledgers.values()}

    def owned(self, worker: str) -> dict[int, list[int]]:
        """stage -> micro-batches whose gradient ``worker`` holds undelivered, of every batch in flight."""
        out: dict[int, list[int]] = {}
        for ledger in self.ledgers.values():
            for stage, ms in ledger.owned(worker).items():
                out.setdefault(stage, []).extend(ms)
        return out
