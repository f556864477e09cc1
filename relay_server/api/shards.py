"""HTTP face of the shard-lease pool (:mod:`relay_server.data.pool`), and its lifespan.

Routes (paths from :data:`toolkit.wire.protocol.ROUTES`):

* ``POST /api/peers/{peer_id}/shards/lease``  ``ShardLeaseRequest -> ShardLease``
* ``POST /api/peers/{peer_id}/shards/report`` ``ShardReport -> ShardReportAck`` (progress + releases)
* ``GET  /api/shards[?source=name]``          ``ShardsReport`` (coverage per dataset and per shard)

:mod:`relay_server.api.app` puts :data:`ROUTES` in its route table and appends :func:`lifespan` to
``app.cleanup_ctx`` *after* the app's own lifespan (it needs the Collaboration). The lifespan builds the pool from the
run's ``[dataset]`` section, expires the leases of peers that left the registry, and flushes
counts and the lease log to SQLite every second (and at shutdown).

The app's keys and the peer-ownership check come from :mod:`relay_server.api.context`, so this
module never imports the app that gathers its routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Collection
from typing import TypeVar

from aiohttp import web

from relay_server.api.context import COLLAB, own_peer
from relay_server.api.context import collab as _collab
from relay_server.core.config import ConfigError
from relay_server.core.errors import ApiError
from relay_server.data.pool import ShardLedger, ShardPool
from toolkit.errors import DataConfigError
from toolkit.wire.protocol import MAX_JSON_BODY, ShardLeaseRequest, ShardReport, ShardsReport, SourceCoverage
from toolkit.wire.protocol import ROUTES as PATHS
from toolkit.wire.schema import Schema

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Schema)

SHARD_POOL = web.AppKey("shard_pool", ShardPool)
"""Present only when the run streams shards with leases on."""
EXPIRE_EVERY_S = 0.25
FLUSH_EVERY_S = 1.0


async def _read(request: web.Request, schema: type[M]) -> M:
    if request.content_length is not None and request.content_length > MAX_JSON_BODY:
        raise ApiError(413, "body_too_large", f"JSON bodies are limited to {MAX_JSON_BODY} bytes")
    return schema.loads(await request.read())


def _pool(request: web.Request) -> ShardPool:
    pool = request.app.get(SHARD_POOL)
    if pool is None:
        raise ApiError(
            404,
            "no_shard_pool",
            "this run leases no shards",
            'Leases need [dataset] kind = "stream" (and leases not set to false) in the relay config; '
            "peers then read shards in their own order.",
        )
    return pool


def _own_peer(request: web.Request) -> str:
    """The path's peer id, refused if it belongs to another user (signed runs)."""
    return own_peer(request, request.match_info["peer_id"])


async def post_lease(request: web.Request) -> web.Response:
    pool = _pool(request)
    req = await _read(request, ShardLeaseRequest)
    peer = _collab(request).peer(_own_peer(request))  # 404 if unknown; a lease request is a sign of life
    return web.json_response(pool.lease(peer.peer_id, req.source, req.request_id).to_json())


async def post_report(request: web.Request) -> web.Response:
    """Progress means the peer is streaming (alive: re-admit it, as a heartbeat would); a report of
    releases only may come after it left (a closing notebook), and must not bring it back."""
    pool = _pool(request)
    report = await _read(request, ShardReport)
    collab, peer_id = _collab(request), _own_peer(request)  # departed peers too: 404 unknown, 403 another user's
    alive = any(not u.release for u in report.updates) or collab.registry.get(peer_id) is not None
    if alive:
        collab.peer(peer_id)
    return web.json_response(pool.report(peer_id, report.updates, report.request_id, alive=alive).to_json())


async def get_shards(request: web.Request) -> web.Response:
    pool = request.app.get(SHARD_POOL)
    report = pool.coverage(request.query.get("source")) if pool else ShardsReport(sources=[], shards=[])
    return web.json_response(report.to_json())


ROUTES = [
    ("POST", PATHS["shard_lease"], post_lease),
    ("POST", PATHS["shard_report"], post_report),
    ("GET", PATHS["shards"], get_shards),
]


def status_summary(app: web.Application) -> list[SourceCoverage]:
    """The compact coverage for ``/api/status`` (empty when the run leases no shards)."""
    pool = app.get(SHARD_POOL)
    return pool.summary() if pool is not None else []


async def flush(pool: ShardPool, ledger: ShardLedger) -> None:
    """Write the pool's changes in a worker thread (an fsync must not stall the event loop)."""
    rows, events = pool.take_changes()
    if not rows and not events:
        return
    try:
        await asyncio.to_thread(ledger.write, rows, events)
    except sqlite3.Error as exc:  # disk full, locked too long: keep the changes for the next try
        pool.restore_changes(rows, events)
        log.warning("could not save shard coverage (%s); retrying", exc)


async def housekeeping(pool: ShardPool, ledger: ShardLedger, live_peers: Collection[str], stop: asyncio.Event) -> None:
    """Until ``stop``: expire the leases of peers gone from ``live_peers`` (the registry's dict,
    which the collaboration's ticker prunes by heartbeat TTL), flush every second, and once more
    at the end. Stopped by the event, never cancelled, so no write is cut in half."""
    last_flush = time.monotonic()
    while not stop.is_set():
        pool.expire(live_peers)
        if time.monotonic() - last_flush >= FLUSH_EVERY_S:
            await flush(pool, ledger)
            last_flush = time.monotonic()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), EXPIRE_EVERY_S)
    await flush(pool, ledger)


async def lifespan(app: web.Application) -> AsyncIterator[None]:
    """Own the pool, its ledger and its housekeeping task (a no-op for runs without leases)."""
    collab = app[COLLAB]
    ledger = ShardLedger(collab.store.dir / "relay.sqlite")
    try:
        pool = await asyncio.to_thread(ShardPool.from_dataset, collab.config.dataset, ledger)  # may glob the Hub
    except DataConfigError as exc:
        ledger.close()
        raise ConfigError(f"[dataset]: {exc}") from None
    if pool is None:
        ledger.close()
        yield
        return
    app[SHARD_POOL] = pool
    log.info(
        "shard leases: %s", ", ".join(f"{c.source}: {c.shards} shards, {c.finished} finished" for c in pool.summary())
    )
    stop = asyncio.Event()
    task = asyncio.create_task(housekeeping(pool, ledger, collab.registry.peers, stop))
    try:
        yield
    finally:
        stop.set()
        await task
        ledger.close()
