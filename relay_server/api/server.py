"""Run the relay (or an aggregator) until SIGINT/SIGTERM; report its URL once it accepts connections."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from relay_server.api.app import create_app
from relay_server.core.config import RelayConfig

log = logging.getLogger(__name__)

READ_BUFSIZE = 4 << 20  # per-connection receive buffer: whole 4 MiB chunks per read, fewer wake-ups


async def serve(config: RelayConfig, *, ready_file: str | None = None, stop: asyncio.Event | None = None,
                on_ready: Callable[[str], None] | None = None, extra_middlewares: tuple = ()) -> None:
    """Serve until ``stop`` is set (or SIGINT/SIGTERM when run in the main thread)."""
    def ready(url: str) -> None:
        log.info("relay for run %r listening on %s (status: %s/api/status)", config.run.name, url, url)
        if on_ready:
            on_ready(url)

    await serve_app(create_app(config, extra_middlewares), config.server.host, config.server.port,
                    ready_file=ready_file, stop=stop, on_ready=ready)


async def serve_app(app: web.Application, host: str, port: int, *, ready_file: str | None = None,
                    stop: asyncio.Event | None = None, on_ready: Callable[[str], None] | None = None) -> None:
    """Listen on ``host:port`` (0 = any free port), call ``on_ready(url)``, serve until stopped."""
    # shutdown_timeout: long-polling peers must not hold a stopping relay for aiohttp's default 60 s
    runner = web.AppRunner(app, handle_signals=False, access_log=None, read_bufsize=READ_BUFSIZE,
                           shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise SystemExit(f"relay-server: cannot listen on {host}:{port} ({exc.strerror}). "
                         "Pick another port with --port, or stop the process using it.") from None
    bound_host, bound_port = site._server.sockets[0].getsockname()[:2]  # the real port when --port 0
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
        await runner.cleanup()
