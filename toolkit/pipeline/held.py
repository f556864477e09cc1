"""What a stage worker holds between tasks: its stage's parameters of up to two versions, and a
stage-gradient sum per batch until that batch's round.

With delayed parameter updates (``run.max_staleness = 1``) two batches are in flight: batch ``b``
computes on version ``b - 1`` while batch ``b + 1`` computes on version ``b``, and batch ``b``'s
gradient waits for its round while batch ``b + 1``'s accumulates. With staleness 0 there is one
of each, and these hold one.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

log = logging.getLogger(__name__)


class StageVersions:
    """The stage's flat parameters by version, the ``KEEP`` most recently used."""

    KEEP = 2

    def __init__(self) -> None:
        self.flats: OrderedDict[int, np.ndarray] = OrderedDict()

    def get(self, version: int) -> np.ndarray | None:
        flat = self.flats.get(version)
        if flat is not None:
            self.flats.move_to_end(version)
        return flat

    def keep(self, version: int, flat: np.ndarray) -> None:
        self.flats[version] = flat
        self.flats.move_to_end(version)
        while len(self.flats) > self.KEEP:
            self.flats.popitem(last=False)


@dataclass
class GradientSum:
    """A batch's stage gradient: the sum over the micro-batches whose result the relay accepted."""

    grads: list[torch.Tensor] | None = None
    microbatches: list[int] = field(default_factory=list)
    loss_sum: float = 0.0


class BatchSums:
    """batch -> :class:`GradientSum`, until the batch's round takes it (:meth:`pop`)."""

    def __init__(self, staleness: int) -> None:
        self.staleness = staleness
        self.sums: dict[int, GradientSum] = {}

    @property
    def held(self) -> list[int]:
        """The micro-batches whose stage gradient is held (of every batch)."""
        return [m for s in self.sums.values() for m in s.microbatches]

    def add(self, batch: int, microbatch: int, grads: list[torch.Tensor], loss_sum: float) -> None:
        """An accepted stage gradient joins its batch's sum. A sum of a batch older than the relay
        keeps in flight is dropped: its round closed without this worker's upload (it was silent,
        and the relay recomputed those micro-batches)."""
        for old in [b for b in self.sums if b < batch - self.staleness]:
            log.debug(
                "dropping the stage gradient of micro-batches %s: their batch is over", self.sums[old].microbatches
            )
            del self.sums[old]
        held = self.sums.setdefault(batch, GradientSum())
        if held.grads is None:
            held.grads = [g.detach().clone() for g in grads]
        else:
            for total, g in zip(held.grads, grads):
                total.add_(g)
        held.microbatches.append(microbatch)
        held.loss_sum += loss_sum

    def pop(self, batch: int) -> GradientSum:
        """Batch ``batch``'s sum (empty when none is held), no longer held: it is sent once."""
        return self.sums.pop(batch, GradientSum())
