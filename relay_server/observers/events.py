"""Things that watch the run step by step without being part of it: W&B logging, Hub checkpoints.

Each observer receives a :class:`StepEvent` once a step is durable and published, on one
background thread in step order, so a slow upload never delays a round. An observer that raises
is logged and the run goes on; if observers fall far behind, events are dropped (with a warning)
rather than held in memory.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from toolkit.wire.protocol import RoundRecord, StatusReport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepEvent:
    step: int
    """The version just published."""
    record: RoundRecord
    """The round that produced it."""
    status: StatusReport
    """The collaboration right after the step."""
    state_path: Path | None
    """The version's safetensors file (parameters + optimizer state). The store prunes old
    versions (``server.keep_checkpoints``): copy or hard-link it before a slow upload. None while
    aggregators own slices of the vector (no single file holds the version)."""


class Observer(Protocol):
    def on_step(self, event: StepEvent) -> None: ...

    def close(self) -> None: ...


class ObserverThread:
    """Delivers events to observers in order on one daemon thread."""

    def __init__(self, observers: list[Observer], max_pending: int = 64) -> None:
        self.observers = observers
        self._queue: queue.Queue[StepEvent | None] = queue.Queue(maxsize=max_pending)
        self._thread = threading.Thread(target=self._run, name="relay-observers", daemon=True)
        self._abandoned = threading.Event()  # close() gave up waiting: stop after the event in hand
        if observers:
            self._thread.start()

    def publish(self, event: StepEvent) -> None:
        if not self.observers:
            return
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            log.warning(
                "observers are %d steps behind; step %d not delivered to them", self._queue.qsize(), event.step
            )

    def close(self, timeout_s: float = 30.0) -> None:
        """Deliver what is queued, then close the observers; ``timeout_s`` bounds the wait in all.
        An observer stuck on its service (a W&B or Hub endpoint that never answers) must not hold
        the relay's shutdown: with the queue full, a plain ``put`` of the end marker waited for it
        forever. Past the bound the thread stops after the event in hand (it is a daemon) and the
        log says how many steps were not delivered."""
        if not self.observers:
            return
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(queue.Full):  # no room: the thread is stuck; the join below says so
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self._abandoned.set()
            log.warning(
                "observers did not finish within %.0f s: %d queued steps not delivered; closing them anyway",
                timeout_s,
                self._queue.qsize(),
            )
        for observer in self.observers:
            try:
                observer.close()
            except Exception:
                log.exception("observer %s failed to close", type(observer).__name__)

    def _run(self) -> None:
        while not self._abandoned.is_set() and (event := self._queue.get()) is not None:
            for observer in self.observers:
                try:
                    observer.on_step(event)
                except Exception:
                    log.exception("observer %s failed on step %d", type(observer).__name__, event.step)
