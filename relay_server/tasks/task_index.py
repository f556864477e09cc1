"""The tasks the broker holds and every way it finds one, from submit until they are let go.

Why apart from :mod:`.broker`: the broker decides how a task moves (queued, leased, done,
failed); this decides how long the relay remembers it and by what it is looked up, a lifecycle of
its own that outlasts the task's. A task enters at submit and is found by its id, by its caller's
call id (a retried call finds the task its first try posted: idempotence), among its key's open
tasks (``fail_key``), in its group (``release_group``) and, while leased, under its worker
(``worker_left``). Once ended it leaves its key's open tasks but stays findable for ``retain_s``
(a retry after the answer gets the same answer), then goes, unless a group holds it: a group's
tasks go together when the group is released (a pipeline round closed). Each index is a dict of
dicts, so no lookup scans the tasks of other keys, workers or rounds.

The index holds no bytes: whoever drops a task here drops its payloads from the store.
"""

from __future__ import annotations

from collections import OrderedDict

from relay_server.core.errors import ApiError
from relay_server.tasks.task import Task


class TaskIndex:
    def __init__(self, retain_s: float) -> None:
        self.retain_s = retain_s
        self.by_id: dict[str, Task] = {}
        """Every task held, by id (read it; :meth:`add` and :meth:`remove` change it)."""
        self._by_call: dict[tuple[str, str], Task] = {}
        self._open_by_key: dict[str, dict[str, Task]] = {}  # tasks not ended
        self._by_group: dict[str, dict[str, Task]] = {}
        self._by_worker: dict[str, dict[str, Task]] = {}  # leased tasks
        self._ended: OrderedDict[str, Task] = OrderedDict()  # by end time, for retention

    def add(self, task: Task) -> None:
        """A task just submitted: findable by id and call id, open in its key, in its group."""
        self.by_id[task.task_id] = task
        self._by_call[(task.caller, task.call_id)] = task
        self._open_by_key.setdefault(task.key, {})[task.task_id] = task
        if task.group:
            self._by_group.setdefault(task.group, {})[task.task_id] = task

    def known(self, task_id: str) -> Task:
        """The task, or the 404 that says it is unknown or was let go."""
        task = self.by_id.get(task_id)
        if task is None:
            raise ApiError(404, "unknown_task", f"task {task_id!r} is unknown or was released")
        return task

    def of_call(self, caller: str, call_id: str) -> Task | None:
        """The task this caller's call id posted, while it is held."""
        return self._by_call.get((caller, call_id))

    def open_of_key(self, key: str) -> list[Task]:
        """The tasks of ``key`` not yet ended."""
        return list(self._open_by_key.get(key, {}).values())

    def leased_to(self, worker: str) -> list[Task]:
        """The tasks ``worker`` holds a lease on now."""
        return list(self._by_worker.get(worker, {}).values())

    def leased(self, task: Task, worker: str) -> None:
        """``task`` was just leased to ``worker``."""
        self._by_worker.setdefault(worker, {})[task.task_id] = task

    def lease_ended(self, task: Task, worker: str) -> None:
        """``worker``'s lease on ``task`` ended (a result, a requeue, a failure)."""
        held = self._by_worker.get(worker)
        if held is not None:
            held.pop(task.task_id, None)
            if not held:
                del self._by_worker[worker]

    def ended(self, task: Task) -> None:
        """``task`` just ended: out of its key's open tasks; retained from now for ``retain_s``."""
        self._ended[task.task_id] = task
        open_tasks = self._open_by_key.get(task.key)
        if open_tasks is not None:
            open_tasks.pop(task.task_id, None)
            if not open_tasks:
                del self._open_by_key[task.key]

    def retire(self, now: float) -> list[Task]:
        """Let go of the tasks that ended ``retain_s`` or more before ``now`` (a group's stay
        until :meth:`take_group`); returns those removed, whose bytes the caller drops. The
        oldest first, stopping at the first still retained: the work is what expired."""
        removed = []
        while self._ended:
            task = next(iter(self._ended.values()))
            if task.ended_at is None or now - task.ended_at < self.retain_s:
                break
            self._ended.popitem(last=False)
            if not task.group:
                self.remove(task)
                removed.append(task)
        return removed

    def take_group(self, group: str) -> list[Task]:
        """The tasks of ``group``, which is forgotten (its tasks are still held: :meth:`remove`)."""
        return list(self._by_group.pop(group, {}).values())

    def remove(self, task: Task) -> None:
        """Let go of ``task``: no index finds it any more."""
        self.by_id.pop(task.task_id, None)
        self._ended.pop(task.task_id, None)
        if self._by_call.get((task.caller, task.call_id)) is task:
            del self._by_call[(task.caller, task.call_id)]
        members = self._by_group.get(task.group)
        if members is not None:
            members.pop(task.task_id, None)
            if not members:
                del self._by_group[task.group]

    def __len__(self) -> int:
        return len(self.by_id)
