"""The broker's queued tasks in leasing order: a heap per key, and a heap per (worker, key) of the
tasks that prefer that worker.

Why heaps: a lease picks the best task across the worker's keys, and the staged pipeline's order
is not arrival order (1F1B: backward before forward, oldest batch first, and a task that was
requeued goes back to its place, not to the tail). A heap per key gives each key's best task in
O(log n); a lease looks at one head per key it asked for.

Why lazy deletion: a queued task also leaves its queue when it fails, is cancelled, times out or
is completed by a worker whose lease had lapsed. Removing it from the middle of a heap would cost
O(n); instead every queued task carries a token, an entry is live only while its task still holds
that token, and stale entries are dropped when they reach the top (or when a heap has grown to
twice its live size, so a key that nobody leases does not keep dead entries forever).

The affinity rule (one rule, simple): for a worker, let ``best`` be the best queued task of its
keys and ``mine`` the best of those that prefer it. It gets ``mine`` when ``mine`` is in the same
priority class as ``best`` (class = the first ``affinity_prefix`` elements of the priority tuple),
else ``best``. (The same as: ``mine`` when its class is equal to or better than that of the best
task not preferring it.) With the pipeline's priority ``(0 backward / 1 forward, batch, microbatch)`` and the
default prefix 1, a worker takes the backward of a forward it ran (its input still cached) before
another backward, but never a forward of its own before somebody's backward. A preference is a
hint, never a hold: every task stays in its key's heap, so anyone can lease it, and a task that
prefers a departed worker is simply nobody's preferred task.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Collection
from typing import Any

Entry = tuple[
    Any, ...
]  # (order..., token or seq, task): the last element is never compared (the one before it is unique)


class LazyHeap:
    """A binary heap whose entries go stale (``valid`` says which) instead of being removed."""

    def __init__(self, valid: Callable[[Entry], bool]) -> None:
        self.items: list[Entry] = []
        self.valid = valid
        self._compact_at = 64

    def push(self, entry: Entry) -> None:
        heapq.heappush(self.items, entry)
        if len(self.items) > self._compact_at:  # amortized O(1): half the entries came since the last compaction
            self.items = [e for e in self.items if self.valid(e)]
            heapq.heapify(self.items)
            self._compact_at = max(64, 2 * len(self.items))

    def peek(self) -> Entry | None:
        """The best live entry (stale ones above it are dropped on the way)."""
        while self.items and not self.valid(self.items[0]):
            heapq.heappop(self.items)
        return self.items[0] if self.items else None

    def pop(self) -> Entry:
        return heapq.heappop(self.items)

    def __len__(self) -> int:
        return len(self.items)


class ReadyQueues:
    """Queued tasks by key in ``(priority, seq)`` order, with per-worker affinity.

    A task here needs ``key``, ``rows``, ``priority``, ``seq``, ``prefer``, ``excluded``, ``lapsed_by`` and a writable
    ``queue_token`` (``None`` while it is not queued)."""

    def __init__(self, affinity_prefix: int = 1) -> None:
        if affinity_prefix < 0:
            raise ValueError("affinity_prefix must be >= 0 (the leading priority elements that form a class)")
        self.affinity_prefix = affinity_prefix
        self._by_key: dict[str, LazyHeap] = {}
        self._preferred: dict[str, dict[str, LazyHeap]] = {}  # worker -> key -> tasks of key preferring it
        self._rows: dict[str, int] = {}
        self._tokens = itertools.count(1)

    @staticmethod
    def _live(entry: Entry) -> bool:
        return entry[-1].queue_token == entry[-2]

    def push(self, task: Any) -> None:
        task.queue_token = token = next(self._tokens)
        entry = (task.priority, task.seq, token, task)
        self._heap(self._by_key, task.key).push(entry)
        if task.prefer is not None:
            self._heap(self._preferred.setdefault(task.prefer, {}), task.key).push(entry)
        self._rows[task.key] = self._rows.get(task.key, 0) + task.rows

    def discard(self, task: Any) -> None:
        """Take ``task`` out of the queue (its entries go stale); a task not queued is left alone."""
        if task.queue_token is not None:
            task.queue_token = None
            self._rows[task.key] -= task.rows

    def best(self, worker: str, keys: Collection[str], skip_lapsed: bool = False) -> Any | None:
        """The task ``worker`` should lease next among ``keys`` (the rule in the module docstring).

        ``skip_lapsed``: never one whose lease ``worker`` let lapse (``task.lapsed_by``): a worker
        that sits on its leases would take each task again as it comes back, and hold the batch
        for a lease deadline each time. The caller asks it only when another worker can take it.
        A task never goes to a worker in its ``excluded`` (whatever ``skip_lapsed`` says)."""
        aside = []
        while (task := self._best(worker, keys)) is not None and (
            worker in task.excluded or skip_lapsed and worker in task.lapsed_by
        ):
            self.discard(task)
            aside.append(task)
        for other in aside:  # back in their places: (priority, seq) keeps the order
            self.push(other)
        return task

    def _best(self, worker: str, keys: Collection[str]) -> Any | None:
        best = _min_head(self._by_key, keys)
        if best is None:
            return None
        mine = _min_head(self._preferred.get(worker, {}), keys)
        if mine is not None and mine[0][: self.affinity_prefix] <= best[0][: self.affinity_prefix]:
            return mine[-1]
        return best[-1]

    def forget_worker(self, worker: str) -> None:
        """A departed worker's affinity goes: the queued tasks that preferred it become nobody's
        (``prefer = None``; they were leasable by anyone all along), and its index is dropped."""
        for heap in self._preferred.pop(worker, {}).values():
            for entry in heap.items:
                if self._live(entry):
                    entry[-1].prefer = None

    def rows(self, key: str) -> int:
        return self._rows.get(key, 0)

    def total_rows(self) -> int:
        return sum(self._rows.values())

    def _heap(self, heaps: dict[str, LazyHeap], key: str) -> LazyHeap:
        heap = heaps.get(key)
        if heap is None:
            heap = heaps[key] = LazyHeap(self._live)
        return heap


def _min_head(heaps: dict[str, LazyHeap], keys: Collection[str]) -> Entry | None:
    heads = [head for key in keys if (heap := heaps.get(key)) is not None and (head := heap.peek()) is not None]
    return min(heads, default=None)


class Waiters:
    """Lease calls waiting for a task, by key: a new task wakes only the calls that can lease it
    (a worker serving stage 3 is not woken, to find nothing, by every task of stage 0)."""

    def __init__(self) -> None:
        self._by_key: dict[str, set[asyncio.Future[None]]] = {}

    def add(self, keys: Collection[str], waiter: asyncio.Future[None]) -> None:
        for key in keys:
            self._by_key.setdefault(key, set()).add(waiter)

    def remove(self, keys: Collection[str], waiter: asyncio.Future[None]) -> None:
        for key in keys:
            waiting = self._by_key.get(key)
            if waiting is not None:
                waiting.discard(waiter)
                if not waiting:
                    del self._by_key[key]

    def waiting(self, key: str) -> int:
        return sum(1 for waiter in self._by_key.get(key, ()) if not waiter.done())

    def notify(self, key: str) -> int:
        """Wake the calls waiting on ``key``; returns how many were woken."""
        woken = 0
        for waiter in self._by_key.get(key, ()):
            if not waiter.done():
                waiter.set_result(None)
                woken += 1
        return woken
