"""Tasks posted by callers, pulled by workers, and their results routed back.

Life of a task::

    submit ──► waiting (on tasks it comes after) ──► queued ──► leased (by one worker) ──► done
                   │                                   │            │  worker left:        │
                   └─ a dependency failed ─► failed ◄──┴─ deadline ─┘  requeue or fail      └─ forget / release_group

Rules, and why:

* **Idempotent on the caller's call id.** A caller whose connection broke posts the same call
  again and waits on the same task: a backward call that updates an expert must never run twice.
  Finished tasks stay findable for ``retain_s`` after they end for the same reason.
* **Backpressure per key.** A key whose queued rows would pass ``max_queued_rows`` refuses the
  call at once (429): Learning@home treats a busy expert as a failed one, and an unbounded queue
  only turns overload into timeouts.
* **Deadlines.** Every task has one; past it the task fails ``task_timeout`` wherever it is, and
  a late result is refused (the caller has moved on).
* **Workers that leave.** The broker is told (the registry's expiry): their leased tasks are
  either requeued (a pipeline's micro-batch, re-dispatched to another worker) or failed at once
  (an expert's call: its parameters left with the host), per task.
* **Dependencies and groups** (the staged pipeline): a task may come after others and is leased
  only when they are done (it fails if one fails); tasks of a group keep their payloads and
  results until :meth:`release_group` (a round closed), so a backward can read its forward's
  activations.
* Only the worker holding a task's lease may complete or fail it.

Everything runs on the relay's event loop; no locks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Collection
from dataclasses import dataclass, field

from relay_server.core.errors import ApiError
from relay_server.tasks.store import PayloadRef, PayloadStore

log = logging.getLogger(__name__)

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
    """``time.monotonic()`` seconds."""
    after: tuple[str, ...] = ()
    group: str = ""
    requeue_on_loss: bool = False
    state: str = WAITING
    worker: str | None = None
    result: PayloadRef | None = None
    error: ApiError | None = None
    ended_at: float | None = None
    leased_at: float | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def ended(self) -> bool:
        return self.state in (DONE, FAILED)


@dataclass
class BrokerStats:
    submitted: int = 0
    completed: int = 0
    failed: int = 0
    refused_busy: int = 0
    requeued: int = 0


class TaskBroker:
    def __init__(self, store: PayloadStore, *, max_queued_rows: int = 4096, retain_s: float = 30.0,
                 clock=time.monotonic) -> None:
        self.store = store
        self.max_queued_rows = max_queued_rows
        self.retain_s = retain_s
        self.clock = clock
        self.tasks: dict[str, Task] = {}
        self._by_call: dict[tuple[str, str], Task] = {}
        self._queues: dict[str, deque[Task]] = {}
        self._queued_rows: dict[str, int] = {}
        self._dependents: dict[str, list[Task]] = {}
        self._ended: OrderedDict[str, Task] = OrderedDict()  # by end time, for retention
        self._ids = itertools.count(1)
        self._waiters: set[asyncio.Future] = set()  # lease calls waiting for a task to arrive
        self.stats = BrokerStats()

    # --- callers ------------------------------------------------------------------------------
    def submit(self, *, caller: str, call_id: str, key: str, kind: str, rows: int, payload: bytes,
               timeout_s: float, after: Collection[str] = (), group: str = "",
               requeue_on_loss: bool = False) -> Task:
        """Post a task (or find the one this call id already posted)."""
        existing = self._by_call.get((caller, call_id))
        if existing is not None:
            if existing.key != key or existing.kind != kind or existing.payload.size != len(payload):
                raise ApiError(409, "call_id_reused", f"call id {call_id!r} was used for a different call",
                               "Use a fresh call id for every new call (retries reuse theirs).")
            return existing
        if self._queued_rows.get(key, 0) + rows > self.max_queued_rows:
            self.stats.refused_busy += 1
            raise ApiError(429, "queue_busy", f"{key} has {self._queued_rows.get(key, 0)} rows queued "
                           f"(limit {self.max_queued_rows})", "Treat it as a failed call; do not retry at once.")
        for dep in after:
            if dep not in self.tasks:
                raise ApiError(404, "unknown_task", f"task {dep!r} (a dependency) is unknown or was released")
        seq = next(self._ids)
        task = Task(task_id=f"t{seq}", seq=seq, key=key, kind=kind, caller=caller, call_id=call_id, rows=rows,
                    payload=self.store.put(payload), deadline=self.clock() + timeout_s, after=tuple(after),
                    group=group, requeue_on_loss=requeue_on_loss)
        self.tasks[task.task_id] = task
        self._by_call[(caller, call_id)] = task
        self.stats.submitted += 1
        pending = [self.tasks[d] for d in task.after if self.tasks[d].state != DONE]
        if any(d.state == FAILED for d in pending):
            self._fail(task, ApiError(424, "dependency_failed", "a task this one comes after failed"))
        elif pending:
            for dep in pending:
                self._dependents.setdefault(dep.task_id, []).append(task)
        else:
            self._enqueue(task)
        return task

    async def wait(self, task: Task) -> Task:
        """Until the task ends (its deadline bounds this: :meth:`tick` fails it then)."""
        await asyncio.wait_for(task.finished.wait(), max(0.0, task.deadline - self.clock()) + 1.0)
        return task

    def result(self, task: Task) -> bytes:
        if task.state != DONE or task.result is None:
            raise task.error or ApiError(500, "task_not_done", f"task {task.task_id} has no result")
        return self.store.get(task.result)

    def forget(self, task: Task) -> None:
        """Drop the payloads once the caller has its answer (the task stays findable by call id
        for ``retain_s`` so a retried call gets the same answer, without the bytes: a retry after
        the answer was delivered is answered with ``task_forgotten``)."""
        if task.group:
            return  # a group's payloads live until release_group
        self.store.drop(task.payload)

    def release_group(self, group: str) -> int:
        """End a group (a pipeline round): its tasks and their bytes go."""
        members = [t for t in self.tasks.values() if t.group == group]
        for task in members:
            if not task.ended:
                self._fail(task, ApiError(410, "group_released", f"group {group!r} was released"))
            self._remove(task)
        return len(members)

    # --- workers ------------------------------------------------------------------------------
    async def lease(self, worker: str, keys: Collection[str], *, max_rows: int, wait_s: float) -> list[Task]:
        """The oldest queued tasks of ``keys`` (at least one, at most ``max_rows`` rows after the
        first), waiting up to ``wait_s`` for one to arrive."""
        deadline = self.clock() + wait_s
        while True:
            taken = self._take(worker, keys, max_rows)
            if taken or self.clock() >= deadline:
                return taken
            arrived = asyncio.get_running_loop().create_future()
            self._waiters.add(arrived)
            try:
                await asyncio.wait_for(arrived, deadline - self.clock())
            except asyncio.TimeoutError:
                pass
            finally:
                self._waiters.discard(arrived)

    def payload(self, task: Task) -> bytes:
        return self.store.get(task.payload)

    def leased(self, worker: str, task_id: str) -> Task:
        task = self.tasks.get(task_id)
        if task is None or task.state == FAILED and task.error is not None and task.error.code == "task_timeout":
            raise ApiError(410, "task_expired", f"task {task_id!r} ended (deadline passed or released)",
                           "Drop this result; take the next task.")
        if task.worker != worker or task.state != LEASED:
            raise ApiError(409, "not_your_task", f"task {task_id!r} is not leased to this worker",
                           "Only send results for tasks your own lease returned.")
        return task

    def complete(self, worker: str, task_id: str, result: bytes) -> Task:
        task = self.leased(worker, task_id)
        task.result = self.store.put(result)
        task.state, task.ended_at = DONE, self.clock()
        self.stats.completed += 1
        self._ended[task.task_id] = task
        task.finished.set()
        for dependent in self._dependents.pop(task.task_id, []):
            if dependent.state == WAITING and all(self.tasks[d].state == DONE for d in dependent.after):
                self._enqueue(dependent)
        return task

    def fail(self, worker: str, task_id: str, error: ApiError) -> Task:
        task = self.leased(worker, task_id)
        self._fail(task, error)
        return task

    def worker_left(self, worker: str) -> None:
        """The registry dropped ``worker``: requeue or fail the tasks it held."""
        for task in [t for t in self.tasks.values() if t.worker == worker and t.state == LEASED]:
            if task.requeue_on_loss and task.deadline > self.clock():
                task.state, task.worker = QUEUED, None
                self._queues.setdefault(task.key, deque()).appendleft(task)  # first in line again
                self._queued_rows[task.key] = self._queued_rows.get(task.key, 0) + task.rows
                self.stats.requeued += 1
            else:
                self._fail(task, ApiError(410, "worker_gone", f"the worker computing {task.key} left",
                                          "Treat it as a failed call."))
        self._notify()

    def fail_key(self, key: str, error: ApiError) -> int:
        """Fail every task of ``key`` not yet done (e.g. its expert left the directory)."""
        doomed = [t for t in self.tasks.values() if t.key == key and not t.ended]
        for task in doomed:
            self._fail(task, error)
        return len(doomed)

    # --- upkeep -------------------------------------------------------------------------------
    def tick(self) -> None:
        """Fail tasks past their deadline; forget ended tasks older than ``retain_s``."""
        now = self.clock()
        for task in [t for t in self.tasks.values() if not t.ended and t.deadline <= now]:
            self._fail(task, _timeout(task))
        while self._ended:
            task = next(iter(self._ended.values()))
            if task.ended_at is None or now - task.ended_at < self.retain_s:
                break
            self._ended.popitem(last=False)
            if not task.group:
                self._remove(task)

    def queued_rows(self, key: str) -> int:
        return self._queued_rows.get(key, 0)

    def summary(self) -> dict[str, int]:
        return {"tasks": len(self.tasks), "queued": sum(self._queued_rows.values()),
                "memory_bytes": self.store.memory_bytes, "spilled_bytes": self.store.spilled_bytes,
                **self.stats.__dict__}

    # --- internals ----------------------------------------------------------------------------
    def _enqueue(self, task: Task) -> None:
        task.state = QUEUED
        self._queues.setdefault(task.key, deque()).append(task)
        self._queued_rows[task.key] = self._queued_rows.get(task.key, 0) + task.rows
        self._notify()

    def _take(self, worker: str, keys: Collection[str], max_rows: int) -> list[Task]:
        taken: list[Task] = []
        rows = 0
        while True:
            heads = [q[0] for k in keys if (q := self._queues.get(k))]
            if not heads:
                return taken
            task = min(heads, key=lambda t: t.seq)  # oldest first, across the worker's keys
            oldest_key = task.key
            if task.deadline <= self.clock():  # past its deadline: fail it here rather than scan every task per poll
                self._fail(task, _timeout(task))
                continue
            if taken and rows + task.rows > max_rows:
                return taken
            self._queues[oldest_key].popleft()
            self._queued_rows[oldest_key] -= task.rows
            task.state, task.worker, task.leased_at = LEASED, worker, self.clock()
            taken.append(task)
            rows += task.rows

    def _fail(self, task: Task, error: ApiError) -> None:
        if task.ended:
            return
        if task.state == QUEUED:
            queue = self._queues.get(task.key)
            if queue is not None and task in queue:
                queue.remove(task)
                self._queued_rows[task.key] -= task.rows
        task.state, task.error, task.ended_at = FAILED, error, self.clock()
        self.stats.failed += 1
        self._ended[task.task_id] = task
        task.finished.set()
        for dependent in self._dependents.pop(task.task_id, []):
            self._fail(dependent, ApiError(424, "dependency_failed", f"task {task.task_id} it comes after failed: "
                                           f"{error.message}"))

    def _remove(self, task: Task) -> None:
        self.tasks.pop(task.task_id, None)
        self._ended.pop(task.task_id, None)
        if self._by_call.get((task.caller, task.call_id)) is task:
            del self._by_call[(task.caller, task.call_id)]
        self.store.drop(task.payload)
        self.store.drop(task.result)

    def _notify(self) -> None:
        """Wake every waiting lease call (each looks for its own keys)."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)


def _timeout(task: Task) -> ApiError:
    return ApiError(504, "task_timeout", f"no result for {task.key} within its deadline", "Treat it as a failed call.")
