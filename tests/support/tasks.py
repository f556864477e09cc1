"""What the task broker tests share: a broker on a fake clock with its payload store in the test's
folder, an expert call submitted with defaults, and a coroutine run to completion."""

from __future__ import annotations

import asyncio
from pathlib import Path

from relay_server.tasks.broker import TaskBroker
from relay_server.tasks.payload_store import PayloadStore
from tests.support.clock import Clock


def broker(tmp_path: Path, clock: Clock | None = None, **kwargs) -> TaskBroker:
    return TaskBroker(
        PayloadStore(kwargs.pop("budget", 1 << 20), tmp_path / "spill"), clock=clock or Clock(1000.0), **kwargs
    )


def submit(b: TaskBroker, call_id: str, key: str = "e.0", rows: int = 4, caller: str = "alice", **kwargs):
    return b.submit(
        caller=caller,
        call_id=call_id,
        key=key,
        kind="forward",
        rows=rows,
        payload=kwargs.pop("payload", call_id.encode() * 3),
        timeout_s=kwargs.pop("timeout_s", 5.0),
        **kwargs,
    )


def run(coro):
    return asyncio.run(coro)
