"""How long a key's tasks take, measured, and the lease deadline derived from it.

A stuck worker (alive to the registry, never answering: SIGSTOP, a hung driver) would hold a
pipeline's micro-batch forever if only departures requeued work, and a fixed timeout is wrong for
every stage but one: a stage of 2 layers on a fast GPU and one of 12 on a laptop differ by 100x.
So the broker measures, per key, the time from lease to accepted result of the tasks leased to
the worker that answered, and a lease lasts ``max(floor_s, factor x measured)``.

Why the median of a window (the last ``window`` tasks) and not a mean or an EWMA: the tasks a
deadline exists for are the outliers, and a stuck worker's result that arrives a minute late
(accepted under first-result-wins, but not measured) or one slow straggler must not stretch the
deadline of everyone after it; the median ignores up to half of the window, and the window
follows a stage whose speed changes (a rebalance, a slower worker joining). ``factor`` covers
the spread between workers of one stage (the paper's slow "2080" workers are ~1.6x). Before a
key has any measurement its leases last ``initial_s``, but only until one exists: a lease never
outlives ``leased at + the key's deadline now`` (:meth:`LeaseBook.record`). Why: the leases taken
before the first result are the first batch's, and a worker that sits on them (a lease hog, a
hung driver) would otherwise hold that batch for ``initial_s`` (30 s) against a measured deadline
of a few seconds.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from typing import Any

from relay_server.tasks.queues import LazyHeap


class LeaseTimer:
    def __init__(
        self, *, floor_s: float = 2.0, factor: float = 4.0, initial_s: float = 30.0, window: int = 32
    ) -> None:
        if not floor_s > 0:
            raise ValueError("lease_floor_s must be > 0 seconds (the shortest lease a measured key gets)")
        if not factor >= 1:
            raise ValueError("lease_factor must be >= 1 (a lease lasts factor x the measured task time)")
        if not initial_s > 0:
            raise ValueError("initial_lease_s must be > 0 seconds (the lease before a key has a measurement)")
        if window < 1:
            raise ValueError("lease_window must be >= 1 task (how many recent task times the median covers)")
        self.floor_s, self.factor, self.initial_s, self.window = floor_s, factor, initial_s, window
        self._samples: dict[str, deque[float]] = {}
        self._median: dict[str, float] = {}

    def record(self, key: str, seconds: float) -> None:
        samples = self._samples.setdefault(key, deque(maxlen=self.window))
        samples.append(max(0.0, seconds))
        self._median[key] = statistics.median(samples)

    def measured(self, key: str) -> float | None:
        """The median lease-to-result time of ``key``'s last ``window`` tasks (``None``: none yet)."""
        return self._median.get(key)

    def deadline(self, key: str) -> float:
        """How long a lease of ``key`` lasts: ``max(floor_s, factor x measured)``, or ``initial_s``."""
        measured = self._median.get(key)
        return self.initial_s if measured is None else max(self.floor_s, self.factor * measured)

    def report(self) -> dict[str, dict[str, float | int]]:
        """Per measured key: ``measured_s``, ``samples`` and ``lease_deadline_s`` (for the dashboard)."""
        return {
            key: {"measured_s": self._median[key], "samples": len(samples), "lease_deadline_s": self.deadline(key)}
            for key, samples in self._samples.items()
        }


class LeaseBook:
    """The leases that have a deadline, by expiry: a heap, so the relay's tick looks only at the
    leases that expired, never at every task. A lease that ends earlier (a result, a requeue) or
    gets a new expiry (:meth:`record`) leaves a stale entry, skipped by its token. A task here
    needs ``key``, ``worker``, ``lapsed_by`` and writable ``lease_token`` and ``lease_expires_at``."""

    def __init__(self, timer: LeaseTimer) -> None:
        self.timer = timer
        self._heap = LazyHeap(lambda entry: entry[-1].lease_token == entry[-2])  # (expires, token, task)
        self._tokens = itertools.count(1)
        self._live: dict[str, dict[int, tuple[Any, float]]] = {}  # key -> id(task) -> (task, leased at)

    def start(self, task: Any, now: float) -> None:
        self._live.setdefault(task.key, {})[id(task)] = (task, now)
        self._expire_at(task, now + self.timer.deadline(task.key))

    def end(self, task: Any) -> None:
        self._forget(task)
        task.lease_token = task.lease_expires_at = None

    def record(self, key: str, seconds: float) -> None:
        """A measured task time of ``key`` (:meth:`LeaseTimer.record`). If it shortens the key's
        deadline (its first measurement ends the ``initial_s`` leases), every live lease of ``key``
        is cut to ``leased at + the new deadline`` (never lengthened): a lease taken before the
        measurement lasts no longer than one taken after it. O(live leases of ``key``), and only
        when the deadline shrinks."""
        before = self.timer.deadline(key)
        self.timer.record(key, seconds)
        deadline = self.timer.deadline(key)
        if deadline >= before:
            return
        for task, leased_at in list(self._live.get(key, {}).values()):
            if leased_at + deadline < task.lease_expires_at:
                self._expire_at(task, leased_at + deadline)

    def expired(self, now: float) -> list[Any]:
        """The tasks whose lease passed its deadline by ``now`` (their leases end here, and their
        ``lapsed_by`` names the lessee that let it: see :meth:`.queues.ReadyQueues.best`)."""
        out = []
        while (entry := self._heap.peek()) is not None and entry[0] <= now:
            self._heap.pop()
            entry[-1].lapsed_by.append(entry[-1].worker)
            self._forget(entry[-1])
            out.append(entry[-1])
        return out

    def _expire_at(self, task: Any, expires_at: float) -> None:
        """A new expiry for ``task``'s lease: a fresh token, so its earlier heap entry goes stale."""
        task.lease_token = next(self._tokens)
        task.lease_expires_at = expires_at
        self._heap.push((expires_at, task.lease_token, task))

    def _forget(self, task: Any) -> None:
        """``task``'s lease leaves the per-key index (a later measurement cuts it no more)."""
        live = self._live.get(task.key)
        if live is not None and live.pop(id(task), None) is not None and not live:
            del self._live[task.key]
