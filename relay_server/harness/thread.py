"""A relay served from an event loop on a thread of this process: the demo's relay, and the tests'.

:class:`RelayThread` runs the relay's own :func:`~relay_server.api.server.serve` (its data-dir
lock, its connection guard, port 0 and the port it bound read back), or any aiohttp app through
:func:`~relay_server.api.server.serve_app`: real HTTP on 127.0.0.1 without a second process and a
second torch import. :meth:`RelayThread.call` runs a function on the relay's loop, between its own
tasks, so a look at the relay's state never races them. A relay that must be restarted, killed or
read from its log is a process: :mod:`relay_server.harness.process`.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests
from aiohttp import web

from relay_server.api.app import create_app
from relay_server.api.moderation import ADMIN_PREFIX, TOKEN_FILE
from relay_server.api.server import serve, serve_app
from relay_server.core.config import RelayConfig
from relay_server.core.data_lock import DataDirInUse
from relay_server.harness.process import wait_until

log = logging.getLogger(__name__)


class RelayThread:
    """``RelayThread(config).start()``: the relay of that run; ``RelayThread(app=app).start()``:
    any aiohttp app, served the same way on 127.0.0.1. Also a context manager that stops it."""

    def __init__(self, config: RelayConfig | None = None, *, app: web.Application | None = None) -> None:
        assert (config is None) != (app is None), "a run's config or an app, one of the two"
        self.config, self.url = config, ""
        self.error: BaseException | None = None
        self.app = app  # the run's app is built on the relay's thread: its errors are start()'s
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="relay", daemon=True)

    def start(self, timeout_s: float = 60) -> "RelayThread":
        """Return once it listens (:attr:`url`); the relay's own error if it could not (a data dir
        another relay holds: its :class:`DataDirInUse`, in one line)."""
        self._thread.start()
        if not self._ready.wait(timeout_s) or self.error:
            if isinstance(self.error, DataDirInUse):
                raise self.error
            raise RuntimeError(f"the relay did not start: {self.error}")
        return self

    def _main(self) -> None:
        async def run() -> None:
            self.loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            if self.config is not None:
                self.app = create_app(self.config)
                await serve(self.config, app=self.app, stop=self._stop, on_ready=self._on_ready)
            else:
                await serve_app(
                    self.app,  # type: ignore[arg-type]  # an app when no config (__init__ holds one of the two)
                    "127.0.0.1",
                    0,
                    stop=self._stop,
                    on_ready=self._on_ready,
                )

        try:
            asyncio.run(run())  # the loop closed (and its executor shut down) once stopped
        except BaseException as exc:  # surfaced by start()
            self.error = exc
            self._ready.set()

    def _on_ready(self, url: str) -> None:
        self.url = url
        self._ready.set()

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def data_dir(self) -> Path:
        return Path(self.config.server.data_dir)  # type: ignore[union-attr]  # a run's relay (config) has one

    def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run on the relay's event loop (between its tasks), its result returned here."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)  # type: ignore[arg-type]  # started

    def status(self) -> dict[str, Any]:
        return requests.get(self.url + "/api/status", timeout=10).json()

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], Any], timeout_s: float = 60, what: str = "condition"
    ) -> dict[str, Any]:
        """The first ``/api/status`` that ``predicate`` accepts; on timeout the last one says why."""
        last: list[dict[str, Any]] = []

        def accepted() -> dict[str, Any] | None:
            last[:] = [self.status()]
            return last[0] if predicate(last[0]) else None

        try:
            return wait_until(accepted, timeout_s, what)
        except TimeoutError:
            raise TimeoutError(f"timed out waiting for {what}; last status: {last}") from None

    def admin(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        """An organizer's request (the admin token from the data dir) to ``/api/admin`` + ``path``."""
        token = (self.data_dir / TOKEN_FILE).read_text().strip()
        return requests.request(
            method, self.url + ADMIN_PREFIX + path, timeout=30, headers={"Authorization": f"Bearer {token}"}, **kwargs
        )

    def stop(self, timeout_s: float = 30) -> None:
        """Stop serving; wait up to ``timeout_s`` for the relay's thread to end. One that does not
        (a shutdown step that never returns) is left behind, a daemon, and the log shows where
        every thread of this process was: what a report of the hang needs."""
        if self.loop is not None and self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            names = {t.ident: t.name for t in threading.enumerate()}
            stacks = "".join(
                f"\nthread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame))
                for ident, frame in sys._current_frames().items()
            )
            log.error("the relay did not stop within %g s; where each thread is:%s", timeout_s, stacks)

    def __enter__(self) -> "RelayThread":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
