"""The input pipeline's worker: run a batch iterator on its own thread, a few batches ahead.

Reading shards, tokenizing and collating happen there, never on the training thread; the
training loop only takes finished batches from a bounded queue. An exception in the pipeline is
raised in the training thread at the batch it would have produced; ``close()`` stops the worker
and closes the source on the worker's thread (a streaming source then reports and releases its
shards), so whatever the source holds must be used by that thread only (give a relay-backed
shard source its own :class:`~toolkit.client.RelayClient`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar, cast

T = TypeVar("T")
_END = object()


class Background(Generic[T]):
    """``iter(source)`` on a daemon thread, at most ``depth`` items ahead."""

    def __init__(self, source: Iterator[T], *, depth: int = 4, name: str = "collabtrain-data") -> None:
        self._source = source
        # the source's items, then _END or the exception the source raised
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self._source:
                if not self._put(item):
                    break
            else:
                self._put(_END)
        except BaseException as exc:  # noqa: BLE001 -- handed to the training thread
            self._put(exc)
        finally:
            close = getattr(self._source, "close", None)
            if close is not None:
                close()

    def __iter__(self) -> "Background[T]":
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return cast(T, item)  # neither _END nor an exception: an item the source yielded

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the worker and wait (up to ``timeout_s``) until it closed its source."""
        self._stop.set()
        self._done = True
        while True:  # unblock a worker waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout_s)
