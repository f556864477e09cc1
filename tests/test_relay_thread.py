"""``relay_server.harness.thread.RelayThread`` (the demo's relay, and the tests'): stopping it is
bounded, and a relay whose shutdown never returns is reported with where each thread was, instead
of holding whoever stops it (the demo's Ctrl-C) for ever."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
import requests
from aiohttp import web

from relay_server.harness.thread import RelayThread

pytestmark = pytest.mark.integration  # serves HTTP


def test_a_relay_whose_shutdown_hangs_is_left_and_reported_with_its_stacks(caplog: pytest.LogCaptureFixture) -> None:
    release, entered = threading.Event(), threading.Event()

    def a_cleanup_step_that_never_returns() -> None:
        entered.set()
        release.wait()

    async def cleanup(app: web.Application) -> None:
        await asyncio.to_thread(a_cleanup_step_that_never_returns)

    app = web.Application()
    app.router.add_get("/", lambda request: web.Response(text="up"))
    app.on_cleanup.append(cleanup)
    relay = RelayThread(app=app).start()
    assert requests.get(relay.url + "/", timeout=10).text == "up"
    relay.stop(timeout_s=0.5)  # returns: the relay's thread is left behind, shutting down
    assert entered.wait(60)  # its shutdown reached the step that never returns (on a loaded machine, later)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="relay_server.harness.thread"):
        relay.stop(timeout_s=0.5)
    assert "the relay did not stop within 0.5 s" in caplog.text, caplog.text
    assert "in a_cleanup_step_that_never_returns" in caplog.text, caplog.text
    release.set()  # the step returns at last: the relay's thread ends, and stopping it again is quiet
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="relay_server.harness.thread"):
        relay.stop()
    assert [r.getMessage() for r in caplog.records if r.name == "relay_server.harness.thread"] == []
