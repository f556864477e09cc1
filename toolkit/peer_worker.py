"""The peer's one background thread: heartbeats while the training loop is busy (a long forward
pass must not look like a dead peer), and rounds run in the background with delayed updates.

It holds only a weak reference to its optimizer, so a notebook cell that drops the optimizer
lets it be collected; :func:`shutdown` (the optimizer's finalizer) stops the thread before the
peer says goodbye, so no heartbeat can follow the leave.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from toolkit.client import RelayClient

if TYPE_CHECKING:
    from toolkit.optimizer import CollaborativeOptimizer
    from toolkit.run_membership import Membership


class PeerWorker(threading.Thread):
    """The one background thread: heartbeats when the loop is busy, and delayed rounds."""

    def __init__(self, owner: "weakref.ref[CollaborativeOptimizer]", client: RelayClient, interval_s: float) -> None:
        super().__init__(name="collab-peer", daemon=True)
        self.owner, self.client, self.interval_s = owner, client, interval_s
        self.jobs: queue.Queue = queue.Queue()
        self.stopping = threading.Event()

    def submit(self, job: Callable[[RelayClient], Any]) -> Future:
        future: Future = Future()
        self.jobs.put((job, future))
        return future

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                job, future = self.jobs.get(timeout=self.interval_s / 2)
            except queue.Empty:
                self._heartbeat()
                continue
            try:
                future.set_result(job(self.client))
            except BaseException as exc:  # handed to the main thread
                future.set_exception(exc)

    def _heartbeat(self) -> None:
        """The owner reports if it has been quiet for ``interval_s`` (its :meth:`keep_alive
        <toolkit.optimizer.CollaborativeOptimizer.keep_alive>` decides and keeps what it heard)."""
        owner = self.owner()
        if owner is None:
            return
        try:
            owner.keep_alive(self.client, self.interval_s)
        finally:
            del owner


def shutdown(worker: PeerWorker, client: RelayClient, membership: Membership) -> None:
    worker.stopping.set()
    worker.join(timeout=5)  # no heartbeat may follow the leave
    membership.leave()
    worker.client.close()
    client.close()
