"""A task and the broker's counters: what the broker, its routes and the pipeline's coordinator
read. The states and how a task moves between them are in :mod:`.broker`'s docstring.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from relay_server.core.errors import ApiError
from relay_server.tasks.payload_store import PayloadRef

WAITING, QUEUED, LEASED, DONE, FAILED = "waiting", "queued", "leased", "done", "failed"


@dataclass(eq=False)
class Task:
    task_id: str
    seq: int
    key: str
    kind: str
    caller: str
    call_id: str
    rows: int
    payload: PayloadRef
    deadline: float
    """On the broker's clock (the relay's: :mod:`relay_server.core.loop_clock`)."""
    after: tuple[str, ...] = ()
    group: str = ""
    requeue_on_loss: bool = False
    priority: tuple[Any, ...] = ()
    """Leasing order within and across keys: smaller first, then older (``seq``)."""
    prefer: str | None = None
    """The worker that should lease it if it asks (see :mod:`.queues`); anyone may."""
    excluded: frozenset[str] = frozenset()
    """Workers that may never lease it (a spot check is never its own original's worker's)."""
    state: str = WAITING
    worker: str | None = None
    """The lessee while leased; once done, the worker whose result was accepted."""
    result: PayloadRef | None = None
    error: ApiError | None = None
    ended_at: float | None = None
    leased_at: float | None = None
    lease_expires_at: float | None = None
    """While leased with ``requeue_on_loss``: when :meth:`TaskBroker.tick` requeues it."""
    attempts: int = 0
    """Times leased."""
    previous_workers: list[str] = field(default_factory=list)
    """Lessees whose lease ended without their result (lapsed, left, requeued, superseded), in order."""
    lapsed_by: list[str] = field(default_factory=list)
    """Lessees whose lease on it passed its deadline (a ``skip_lapsed`` lease never gives it back to them)."""
    cancelled: bool = False
    queue_token: int | None = None
    """Internal: which queue entry is live (:mod:`.queues` deletes lazily); ``None`` unless queued."""
    lease_token: int | None = None
    """Internal: which lease-deadline entry is live (:mod:`.timing`); ``None`` without a lease deadline."""
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def ended(self) -> bool:
        return self.state in (DONE, FAILED)

    def held_by(self, worker: str) -> bool:
        return worker == self.worker or worker in self.previous_workers

    def check_answer_from(self, worker: str) -> None:
        """Refuse a result ``worker`` may not send now: 409 ``not_your_task`` (never leased to this
        worker, or failed), 409 ``task_done`` (a result was accepted, or it was cancelled). The
        lessee and, while the task is not done, its previous lessees may (first result wins:
        :mod:`.broker`)."""
        if not self.held_by(worker):
            raise ApiError(
                409,
                "not_your_task",
                f"task {self.task_id!r} is not leased to this worker",
                "Only send results for tasks your own lease returned.",
            )
        if self.state == DONE or self.cancelled:
            raise ApiError(
                409,
                "task_done",
                f"task {self.task_id!r} already has its result (or was cancelled)",
                "Drop this result (it was not counted); take the next task.",
            )
        if self.state not in (LEASED, QUEUED):
            raise ApiError(
                409,
                "not_your_task",
                f"task {self.task_id!r} is {self.state}",
                "Only send results for tasks your own lease returned.",
            )

    async def until_ended(self, clock: Callable[[], float]) -> bool:
        """Wait until the task ended (True) or its deadline passed on ``clock`` (False), never
        raising on time. A wake-up after a stall of the relay's event loop first asks ``clock``
        (the relay's, stopped during the stall) whether time is left: the result may be waiting
        unread in a socket, and a timer that fires before it is read must not fail the task."""
        while not self.ended:
            remaining = self.deadline - clock()
            if remaining <= 0:
                return False
            finished = asyncio.ensure_future(self.finished.wait())
            try:
                await asyncio.wait({finished}, timeout=remaining)
            finally:
                finished.cancel()
        return True


@dataclass
class BrokerStats:
    submitted: int = 0
    completed: int = 0
    failed: int = 0
    refused_busy: int = 0
    requeued: int = 0
    """Leased tasks put back in their queue (lease expired, worker left, :meth:`TaskBroker.requeue`)."""
    lease_expired: int = 0
    late_accepted: int = 0
    """Results accepted from a previous lessee (first result wins)."""
    wakeups: int = 0
    """Waiting lease calls woken by a task arriving on one of their keys."""


def timeout_error(task: Task) -> ApiError:
    return ApiError(504, "task_timeout", f"no result for {task.key} within its deadline", "Treat it as a failed call.")
