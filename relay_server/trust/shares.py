"""Which results are checked: a per-worker share, chosen by a secret the workers never see.

A flat share spends its checks evenly, and a liar that corrupts a tenth of its results at a 10%
share is caught once per hundred of its tasks. The checks go where a lie is likelier instead:

* **New workers are on probation**, counted in batches: the first checkable result a worker
  delivers in each of its first :data:`PROBATION` batches is always checked; from then on the run's
  base share (``[pipeline] check_share``). A liar that corrupts from its first results -- as a
  bought or broken worker does -- is caught in its first batch, and one banned on an open run that
  rejoins under a new name starts on probation again. Batches, not results, because the cheapest
  lie is honest in the first batch: a worker that never downloads another version computes its
  first batch right and every later one on stale parameters, so probation looks again in its
  second batch. The cost is a fixed :data:`PROBATION` checks per worker that joins, whatever the
  run's length.
* **Workers the monitors flag** (:mod:`.monitor`) have every result checked, for as long as
  their suspicion lasts.
* **Everyone else**: the base share, low (a few percent): it bounds how long a patient liar (one
  that waits out its probation, then corrupts a fraction ``p`` of its results) survives: about
  ``1 / (p * share)`` of its tasks, and none of its lies found in a batch is counted.

Which results: an HMAC of the task's id under a secret drawn when the relay starts, compared with
the worker's share. The worker does not know the secret, and a check is an ordinary task to the
worker that computes it (:mod:`.checks`), so it cannot tell which of its results are checked; it
can know it is new, and that new workers are checked more -- which is the point.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from relay_server.trust.monitor import ResultMonitor

PROBATION = 2
"""Batches in which a new worker's first checkable result is always checked before its share falls
to the run's base share: its first, and its second (the first computed after a version change)."""


class CheckShares:
    def __init__(self, base: float, monitor: ResultMonitor, probation: int = PROBATION) -> None:
        self.base, self.monitor, self.probation = base, monitor, probation
        self.secret = secrets.token_bytes(32)  # which tasks are checked: unknowable outside this process
        self.chosen_for: dict[str, int] = {}  # worker -> its results chosen for a check so far
        self.probed: dict[str, set[int]] = {}  # worker -> batches its probation checked a result of
        self.probation_checks = 0
        """Checks chosen above the base share because their worker was new: probation's cost."""

    def probing(self, worker: str, batch: int) -> bool:
        """Whether ``worker``'s next result in ``batch`` is a probation check: the first of one of
        its first :attr:`probation` batches."""
        probed = self.probed.get(worker, set())
        return self.base > 0 and len(probed) < self.probation and batch not in probed

    def share(self, worker: str, batch: int) -> float:
        """The probability that a result of ``worker`` in ``batch`` is checked now (0 when checks are off)."""
        if not self.base > 0:
            return 0.0
        if self.monitor.suspect(worker) or self.probing(worker, batch):
            return 1.0
        return self.base

    def chosen(self, task_id: str, worker: str, batch: int) -> bool:
        """Whether the result of ``task_id`` from ``worker`` in ``batch`` is checked (no state changes)."""
        share = self.share(worker, batch)
        if share >= 1.0:
            return True
        digest = hmac.new(self.secret, task_id.encode(), hashlib.sha256).digest()
        return int.from_bytes(digest[:8], "big") < share * 2**64

    def choose(self, task_id: str, worker: str, batch: int) -> bool:
        """:meth:`chosen`, counting the choice toward the worker's probation."""
        if not self.chosen(task_id, worker, batch):
            return False
        if self.probing(worker, batch):
            self.probed.setdefault(worker, set()).add(batch)
            if not self.monitor.suspect(worker):
                self.probation_checks += 1
        self.chosen_for[worker] = self.chosen_for.get(worker, 0) + 1
        return True

    def on_probation(self) -> list[str]:
        """Workers seen so far whose probation has batches left."""
        if not self.base > 0:
            return []
        return sorted(w for w, probed in self.probed.items() if len(probed) < self.probation)
