"""Run the relay (or an aggregator) until SIGINT/SIGTERM; report its URL once it accepts connections."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Middleware

from relay_server.api.app import create_app
from relay_server.core.config import RelayConfig
from relay_server.core.connections import ConnectionGuard, ConnectionsSection
from relay_server.core.data_lock import DataDirLock

log = logging.getLogger(__name__)

READ_BUFSIZE = 4 << 20  # per-connection receive buffer: whole 4 MiB chunks per read, fewer wake-ups


async def serve(
    config: RelayConfig,
    *,
    ready_file: str | None = None,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[str], None] | None = None,
    extra_middlewares: tuple[Middleware, ...] = (),
    app: web.Application | None = None,
) -> None:
    """Serve until ``stop`` is set (or SIGINT/SIGTERM when run in the main thread). ``app``: the
    run's app already built (``create_app(config)``), for a caller that looks into it while it
    runs (:class:`relay_server.harness.RelayThread`).

    The data dir's lock comes first (:mod:`relay_server.core.data_lock`): a second relay on the
    same state raises :class:`~relay_server.core.data_lock.DataDirInUse` before it reads or
    writes anything there; the address goes into the lock file once bound."""
    with DataDirLock.acquire(config.server.data_dir, "relay") as lock:

        def ready(url: str) -> None:
            lock.announce(url)
            log.info("relay for run %r listening on %s (status: %s/api/status)", config.run.name, url, url)
            if on_ready:
                on_ready(url)

        await serve_app(
            app if app is not None else create_app(config, extra_middlewares),
            config.server.host,
            config.server.port,
            ready_file=ready_file,
            stop=stop,
            on_ready=ready,
            connections=config.connections,
            trust_forwarded_for=config.limits.trust_forwarded_for,
        )


async def serve_app(
    app: web.Application,
    host: str,
    port: int,
    *,
    ready_file: str | None = None,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[str], None] | None = None,
    connections: ConnectionsSection | None = None,
    trust_forwarded_for: bool = True,
) -> None:
    """Listen on ``host:port`` (0 = any free port), call ``on_ready(url)``, serve until stopped.
    Every connection passes a :class:`ConnectionGuard` (``connections``, defaults when None),
    which finds a request's client as the rate limits do (``trust_forwarded_for``)."""
    guard = ConnectionGuard(connections or ConnectionsSection(), trust_forwarded_for=trust_forwarded_for)
    app.middlewares.insert(0, guard.middleware)  # outermost: knows when a connection is busy
    # shutdown_timeout: long-polling peers must not hold a stopping relay for aiohttp's default 60 s
    runner = web.AppRunner(
        app,
        handle_signals=False,
        access_log=None,
        read_bufsize=READ_BUFSIZE,
        shutdown_timeout=5.0,
        keepalive_timeout=guard.config.idle_timeout_s,
    )
    await runner.setup()
    log.info("%s", guard.start())  # after the app's startup: it counts what the app holds open
    try:  # aiohttp's own server behind the guard (admission, timeouts, accounting)
        # the real port when --port 0; runner.server is set by setup()
        bound_host, bound_port = guard.listen(host, port, runner.server)  # type: ignore[arg-type]  # setup() set it
    except OSError as exc:
        await runner.cleanup()
        raise SystemExit(
            f"relay-server: cannot listen on {host}:{port} ({exc.strerror}). "
            "Pick another port with --port, or stop the process using it."
        ) from None
    sweeper = asyncio.create_task(guard.run())
    url = f"http://{bound_host}:{bound_port}"
    if on_ready:
        on_ready(url)
    if ready_file:
        tmp = Path(ready_file).with_suffix(".tmp")
        tmp.write_text(url)
        tmp.replace(ready_file)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            pass
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        sweeper.cancel()
        guard.close()
        await runner.cleanup()
