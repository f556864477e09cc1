"""Tasks posted by callers, pulled by workers, and their results routed back.

Life of a task::

    submit ─► waiting ─► queued ──────────────► leased (by one worker) ──────────► done
    (after)     │          ▲  heap per key,       │  lease deadline passed (tick), ▲  first result wins:
                │          │  (priority, seq)     │  worker left, requeue()        │  the lessee's, or a
                │          └──── back in place ◄──┘                                │  previous lessee's
                │                                                                  │
                └─ a dependency failed ─► failed ◄── task deadline, fail(), cancel(), fail_key, release_group

Rules, and why:

* **Idempotent on the caller's call id.** A caller whose connection broke posts the same call
  again and waits on the same task: a backward call that updates an expert must never run twice.
  Finished tasks stay findable for ``retain_s`` after they end for the same reason
  (:mod:`.task_index`: how long a task is held and how it is found).
* **Backpressure per key.** A key whose queued rows would pass ``max_queued_rows`` refuses the
  call at once (429): Learning@home treats a busy expert as a failed one, and an unbounded queue
  only turns overload into timeouts.
* **Leasing order** (:mod:`.queues`): across the keys it asked for, a worker gets the task with
  the smallest ``(priority, seq)``: oldest first when every priority is ``()`` (DMoE), 1F1B when
  the pipeline passes ``(0 backward / 1 forward, batch, microbatch)``. A task may ``prefer`` a
  worker (the one holding its input); the affinity rule is in :mod:`.queues`: a hint, never a hold.
* **Deadlines**, on the broker's clock (the relay's: a stall of its loop counts toward none). Past
  it the task fails ``task_timeout`` wherever it is; a late result is refused (the caller moved on).
* **Lease deadlines** (:mod:`.timing`), for tasks posted with ``requeue_on_loss``: a lease lasts
  ``lease_deadline(key)``, derived from the key's measured task time (a lease taken before the
  first measurement is cut to it), so a worker alive to the registry but stuck loses its
  micro-batch to another worker. Expert calls have no lease deadline: their task deadline is
  the caller's timeout, and their parameters live with the host.
* **First result wins.** A worker whose lease lapsed (or who left) keeps the right to answer
  while the task is not done: its late result is accepted, and whoever holds the lease by then is
  refused ``task_done`` (409); a result for a done (or cancelled) task is refused ``task_done`` too.
  Why: the pipeline's coordinator counts a worker's parameter gradient for a micro-batch only when
  that worker's result was accepted, so exactly one result per task must be accepted, and
  refusing a correct result that arrived first would waste the slow worker's work for nothing.
* **Workers that leave.** The broker is told (the registry's expiry): their leased tasks are
  either requeued (a pipeline's micro-batch, re-dispatched to another worker) or failed at once
  (an expert's call: its parameters left with the host), per task.
* **Dependencies and groups**: a task may come after others and is leased only when they are done
  (it fails if one fails); tasks of a group keep their payloads and results until
  :meth:`release_group` (a round closed). The pipeline's coordinator keeps boundary tensors in its
  own store and submits the next task itself, so its tasks may carry an empty payload.
* **No scans.** Lease calls wait per key (a new task wakes only the calls that can lease it);
  task deadlines and lease deadlines are heaps; worker, group and key each index their tasks
  (:mod:`.task_index`).
  A tick costs O(log n) per task that expired, a lease O(log n) per key asked and task taken
  (n: the tasks the relay holds), however many tasks sit in other keys or other rounds.

Everything runs on the relay's event loop; no locks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Collection
from typing import Any

from relay_server.core.errors import ApiError
from relay_server.tasks.payload_store import PayloadStore
from relay_server.tasks.queues import LazyHeap, ReadyQueues, Waiters
from relay_server.tasks.task import DONE, FAILED, LEASED, QUEUED, WAITING, BrokerStats, Task, timeout_error
from relay_server.tasks.task_index import TaskIndex
from relay_server.tasks.timing import LeaseBook, LeaseTimer

log = logging.getLogger(__name__)


class TaskBroker:
    def __init__(
        self,
        store: PayloadStore,
        *,
        max_queued_rows: int = 4096,
        retain_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        lease_floor_s: float = 2.0,
        lease_factor: float = 4.0,
        initial_lease_s: float = 30.0,
        lease_window: int = 32,
        affinity_prefix: int = 1,
    ) -> None:
        self.store = store
        self.max_queued_rows = max_queued_rows
        self.clock = clock
        self.timer = LeaseTimer(
            floor_s=lease_floor_s, factor=lease_factor, initial_s=initial_lease_s, window=lease_window
        )
        self._leases = LeaseBook(self.timer)
        self.index = TaskIndex(retain_s)
        self._queues = ReadyQueues(affinity_prefix)
        self._deadlines = LazyHeap(lambda entry: not entry[-1].ended)  # (deadline, seq, task)
        self._dependents: dict[str, list[Task]] = {}
        self._ids = itertools.count(1)
        self._waiters = Waiters()
        self.stats = BrokerStats()

    @property
    def tasks(self) -> dict[str, Task]:
        """The tasks the relay holds, by id (:attr:`TaskIndex.by_id`: read it, never write it)."""
        return self.index.by_id

    # --- callers ------------------------------------------------------------------------------
    def submit(
        self,
        *,
        caller: str,
        call_id: str,
        key: str,
        kind: str,
        rows: int,
        payload: bytes,
        timeout_s: float,
        after: Collection[str] = (),
        group: str = "",
        requeue_on_loss: bool = False,
        priority: tuple[Any, ...] = (),
        prefer: str | None = None,
        exclude: Collection[str] = (),
    ) -> Task:
        """Post a task (or find the one this call id already posted); ``exclude``: workers never
        to lease it (:mod:`.queues`)."""
        existing = self.index.of_call(caller, call_id)
        if existing is not None:
            if existing.key != key or existing.kind != kind or existing.payload.size != len(payload):
                raise ApiError(
                    409,
                    "call_id_reused",
                    f"call id {call_id!r} was used for a different call",
                    "Use a fresh call id for every new call (retries reuse theirs).",
                )
            return existing
        if self._queues.rows(key) + rows > self.max_queued_rows:
            self.stats.refused_busy += 1
            raise ApiError(
                429,
                "queue_busy",
                f"{key} has {self._queues.rows(key)} rows queued (limit {self.max_queued_rows})",
                "Treat it as a failed call; do not retry at once.",
            )
        for dep in after:
            if dep not in self.index.by_id:
                raise ApiError(404, "unknown_task", f"task {dep!r} (a dependency) is unknown or was released")
        seq = next(self._ids)
        task = Task(
            task_id=f"t{seq}",
            seq=seq,
            key=key,
            kind=kind,
            caller=caller,
            call_id=call_id,
            rows=rows,
            payload=self.store.put(payload),
            deadline=self.clock() + timeout_s,
            after=tuple(after),
            group=group,
            requeue_on_loss=requeue_on_loss,
            priority=tuple(priority),
            prefer=prefer,
            excluded=frozenset(exclude),
        )
        self.index.add(task)
        self._deadlines.push((task.deadline, task.seq, task))
        self.stats.submitted += 1
        pending = [self.index.by_id[d] for d in task.after if self.index.by_id[d].state != DONE]
        if any(d.state == FAILED for d in pending):
            self._fail(task, ApiError(424, "dependency_failed", "a task this one comes after failed"))
        elif pending:
            for parent in pending:
                self._dependents.setdefault(parent.task_id, []).append(task)
        else:
            self._enqueue(task)
        return task

    async def wait(self, task: Task) -> Task:
        """Until the task ends: past its deadline on the broker's clock (:meth:`Task.until_ended`)
        it fails ``task_timeout`` (here or in :meth:`tick`), the answer its caller knows."""
        if not await task.until_ended(self.clock):
            self._fail(task, timeout_error(task))
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
        members = self.index.take_group(group)
        for task in members:
            if not task.ended:
                self._fail(task, ApiError(410, "group_released", f"group {group!r} was released"))
            self._remove(task)
        return len(members)

    def requeue(self, task_id: str) -> Task:
        """Put a leased task back in its place in the queue (its lessee becomes a previous lessee,
        whose result is still accepted while the task is not done); a queued task stays as it is."""
        task = self.index.known(task_id)
        if task.state == LEASED:
            self._requeue(task)
        elif task.state != QUEUED:
            raise ApiError(
                409,
                "task_not_leased",
                f"task {task_id!r} is {task.state}, not leased",
                "Only a leased task can be put back.",
            )
        return task

    def cancel(self, task_id: str, error: ApiError) -> Task:
        """End a task that is no longer wanted (its micro-batch was finished by someone else):
        it fails with ``error`` wherever it is, and any result for it is refused ``task_done``.
        Cancelling an ended task changes nothing."""
        task = self.index.known(task_id)
        if not task.ended:
            task.cancelled = True
            self._fail(task, error)
        return task

    # --- workers ------------------------------------------------------------------------------
    async def lease(
        self, worker: str, keys: Collection[str], *, max_rows: int, wait_s: float, skip_lapsed: bool = False
    ) -> list[Task]:
        """The best queued tasks of ``keys`` (at least one, at most ``max_rows`` rows after the
        first), waiting up to ``wait_s`` for one to arrive on one of them (``skip_lapsed``: :mod:`.queues`)."""
        deadline = self.clock() + wait_s
        while True:
            taken = self._take(worker, keys, max_rows, skip_lapsed)
            if taken or self.clock() >= deadline:
                return taken
            arrived = asyncio.get_running_loop().create_future()
            self._waiters.add(keys, arrived)
            try:
                await asyncio.wait_for(arrived, deadline - self.clock())
            except asyncio.TimeoutError:
                pass
            finally:
                self._waiters.remove(keys, arrived)

    def payload(self, task: Task) -> bytes:
        return self.store.get(task.payload)

    def leased(self, worker: str, task_id: str) -> Task:
        """The task whose result ``worker`` may send now, or the error that refuses it: 410
        ``task_expired`` (unknown, released, or past its deadline), else :meth:`Task.check_answer_from`."""
        task = self.index.by_id.get(task_id)
        if task is None or task.state == FAILED and task.error is not None and task.error.code == "task_timeout":
            raise ApiError(
                410,
                "task_expired",
                f"task {task_id!r} ended (deadline passed or released)",
                "Drop this result; take the next task.",
            )
        task.check_answer_from(worker)
        return task

    def complete(self, worker: str, task_id: str, result: bytes) -> Task:
        """Accept ``worker``'s result (first result wins: see the module docstring)."""
        task = self.leased(worker, task_id)
        now = self.clock()
        if task.state == LEASED and task.worker == worker and task.leased_at is not None:  # set with LEASED
            self._leases.record(task.key, now - task.leased_at)  # may cut the key's other leases
        else:  # a previous lessee, first: the task is queued again or leased to another worker
            self.stats.late_accepted += 1
            if task.state == LEASED and task.worker is not None:  # a leased task has its worker
                task.previous_workers.append(task.worker)  # its later result gets task_done
        self._leave_queue_or_lease(task)
        task.previous_workers = [w for w in task.previous_workers if w != worker]
        task.worker = worker
        task.result = self.store.put(result)
        task.state, task.ended_at = DONE, now
        self.stats.completed += 1
        self._closed(task)
        for dependent in self._dependents.pop(task.task_id, []):
            if dependent.state == WAITING and all(self.index.by_id[d].state == DONE for d in dependent.after):
                self._enqueue(dependent)
        return task

    def fail(self, worker: str, task_id: str, error: ApiError) -> Task:
        """The lessee reports (or the relay finds) its task failed. Only the current lessee: a
        previous lessee's failure must not end a task another worker is computing."""
        task = self.leased(worker, task_id)
        if task.state != LEASED or task.worker != worker:
            raise ApiError(
                409,
                "not_your_task",
                f"your lease on task {task_id!r} lapsed; it was re-dispatched",
                "Drop it; take the next task.",
            )
        self._fail(task, error)
        return task

    def worker_left(self, worker: str) -> None:
        """The registry dropped ``worker``: requeue or fail the tasks it held; its affinity goes."""
        for task in self.index.leased_to(worker):
            if task.requeue_on_loss and task.deadline > self.clock():
                self._requeue(task)
            else:
                self._fail(
                    task,
                    ApiError(
                        410, "worker_gone", f"the worker computing {task.key} left", "Treat it as a failed call."
                    ),
                )
        self._queues.forget_worker(worker)

    def fail_key(self, key: str, error: ApiError) -> int:
        """Fail every task of ``key`` not yet done (e.g. its expert left the directory)."""
        doomed = self.index.open_of_key(key)
        for task in doomed:
            self._fail(task, error)
        return len(doomed)

    # --- upkeep -------------------------------------------------------------------------------
    def tick(self) -> None:
        """Fail tasks past their deadline; requeue leases past theirs; forget ended tasks older
        than ``retain_s``. Each from its own index: the work is what expired, not every task."""
        now = self.clock()
        while (entry := self._deadlines.peek()) is not None and entry[0] <= now:
            self._deadlines.pop()
            self._fail(entry[-1], timeout_error(entry[-1]))
        for task in self._leases.expired(now):
            self.stats.lease_expired += 1
            log.info(
                "lease of %s on %s by %s expired after %.1f s; requeued",
                task.task_id,
                task.key,
                (task.worker or "")[:16],
                now - task.leased_at,
            )
            self._requeue(task)
        for task in self.index.retire(now):
            self._drop_bytes(task)

    def lease_deadline(self, key: str) -> float:
        """Seconds a lease of ``key`` lasts now (:mod:`.timing`)."""
        return self.timer.deadline(key)

    def timings(self) -> dict[str, dict[str, float | int]]:
        """Per measured key: ``measured_s`` (median task time), ``samples``, ``lease_deadline_s``."""
        return self.timer.report()

    def queued_rows(self, key: str) -> int:
        return self._queues.rows(key)

    def summary(self) -> dict[str, int]:
        return {
            "tasks": len(self.index),
            "queued": self._queues.total_rows(),
            "memory_bytes": self.store.memory_bytes,
            "spilled_bytes": self.store.spilled_bytes,
            **self.stats.__dict__,
        }

    # --- internals ----------------------------------------------------------------------------
    def _enqueue(self, task: Task) -> None:
        task.state = QUEUED
        self._queues.push(task)
        self._notify(task.key)

    def _take(self, worker: str, keys: Collection[str], max_rows: int, skip_lapsed: bool = False) -> list[Task]:
        taken: list[Task] = []
        rows = 0
        while (task := self._queues.best(worker, keys, skip_lapsed)) is not None:
            now = self.clock()
            if task.deadline <= now:  # past its deadline: fail it here rather than hand it out
                self._fail(task, timeout_error(task))
                continue
            if taken and rows + task.rows > max_rows:
                break
            self._queues.discard(task)
            task.state, task.worker, task.leased_at = LEASED, worker, now
            task.attempts += 1
            self.index.leased(task, worker)
            if task.requeue_on_loss:
                self._leases.start(task, now)
            taken.append(task)
            rows += task.rows
        return taken

    def _requeue(self, task: Task) -> None:
        """A leased task goes back to its place: same priority and seq, so ahead of later ones."""
        if task.worker is not None:  # always, for a leased task
            task.previous_workers.append(task.worker)
        self._leave_queue_or_lease(task)
        task.worker = None
        if task.deadline <= self.clock():
            self._fail(task, timeout_error(task))
            return
        self.stats.requeued += 1
        self._enqueue(task)

    def _leave_queue_or_lease(self, task: Task) -> None:
        if task.state == QUEUED:
            self._queues.discard(task)
        elif task.state == LEASED:
            if task.worker is not None:  # always, for a leased task
                self.index.lease_ended(task, task.worker)
            self._leases.end(task)

    def _fail(self, task: Task, error: ApiError) -> None:
        if task.ended:
            return
        self._leave_queue_or_lease(task)
        task.state, task.error, task.ended_at = FAILED, error, self.clock()
        self.stats.failed += 1
        self._closed(task)
        for dependent in self._dependents.pop(task.task_id, []):
            self._fail(
                dependent,
                ApiError(424, "dependency_failed", f"task {task.task_id} it comes after failed: {error.message}"),
            )

    def _closed(self, task: Task) -> None:
        """Bookkeeping of a task that just ended."""
        self.index.ended(task)
        task.finished.set()

    def _remove(self, task: Task) -> None:
        self.index.remove(task)
        self._drop_bytes(task)

    def _drop_bytes(self, task: Task) -> None:
        self.store.drop(task.payload)
        self.store.drop(task.result)

    def _notify(self, key: str) -> None:
        """Wake the lease calls waiting on ``key`` (only they can lease its new task)."""
        self.stats.wakeups += self._waiters.notify(key)
