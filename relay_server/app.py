"""The relay's HTTP API: routes as data, one lifespan that owns the store and the ticker.

Bodies stream: a gradient upload is reduced chunk by chunk as it arrives, parameters are written
from an immutable snapshot in chunks with back-pressure. Every error, ours or aiohttp's, leaves as
``{"error": code, "message": ..., "hint": ...}`` with a 4xx/5xx status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from collections.abc import AsyncIterator, Callable
from importlib import resources

from aiohttp import web

from relay_server.collaboration import Collaboration
from relay_server.config import RelayConfig
from relay_server import shards_api
from relay_server.access import LoginService, PassIssuer
from relay_server.auth import BODY_STREAM_KEY, IDENTITY_KEY, RequestVerifier, auth_middleware
from relay_server.errors import ApiError
from relay_server.identity import AllowList, HfIdentityVerifier
from relay_server.moderation import build_admin
from relay_server.ratelimit import build_rate_limits
from relay_server.relay_key import RelayKey
from relay_server.observers import ObserverThread, build_observers
from relay_server.store import Store
from toolkit.errors import ProtocolError
from toolkit.protocol import MAX_JSON_BODY, ROUTES, ErrorBody, Heartbeat, JoinRequest
from toolkit.schema import Schema
from toolkit.tensor_container import MAX_HEADER, AsyncContainerReader

log = logging.getLogger(__name__)

COLLAB = web.AppKey("collaboration", Collaboration)
CONFIG = web.AppKey("config", RelayConfig)
MAX_LONG_POLL_S = 60.0
_DRAIN_LIMIT = 8 << 20  # after rejecting an upload, read at most this much so the peer sees the answer
_QUERY_INT = re.compile(r"-?[0-9]{1,12}")


_HTTP_HINTS = {  # aiohttp's own refusals get a next step too
    404: "Check the URL: the relay's API lives under /api/ (GET /api/status lists the run).",
    405: "This route exists but not with that HTTP method.",
    413: "The body is larger than the relay accepts for this route.",
}


def error_response(status: int, code: str, message: str, hint: str = "") -> web.Response:
    return web.json_response(ErrorBody(error=code, message=message, hint=hint).to_json(), status=status)


def json_ok(message: Schema | dict) -> web.Response:
    return web.json_response(message.to_json() if isinstance(message, Schema) else message)


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc.status, exc.code, exc.message, exc.hint)
    except ProtocolError as exc:
        return error_response(413 if exc.code == "body_too_large" else 400, exc.code, exc.message, exc.hint)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = re.sub(r"[^a-z0-9]+", "_", (exc.reason or "error").lower()).strip("_")
        return error_response(exc.status, code, exc.text or exc.reason or "", _HTTP_HINTS.get(exc.status, ""))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:  # a bug: log it, keep serving
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal_error", "the relay hit an unexpected error",
                              "Retry; if it persists, report it to the organizer with the relay log.")


async def read_message(request: web.Request, schema: type[Schema]) -> Schema:
    if request.content_length is not None and request.content_length > MAX_JSON_BODY:
        raise ApiError(413, "body_too_large", f"JSON bodies are limited to {MAX_JSON_BODY} bytes")
    return schema.loads(await request.read())


def _collab(request: web.Request) -> Collaboration:
    return request.app[COLLAB]


def _int_query(request: web.Request, name: str, default: int | None = None) -> int:
    raw = request.query.get(name)
    if raw is None:
        if default is None:
            raise ApiError(400, "bad_query", f"query parameter {name!r} is required")
        return default
    if not _QUERY_INT.fullmatch(raw):  # ASCII digits, bounded: int() alone takes "1_0", "\u0661", 10**4000
        raise ApiError(400, "bad_query", f"query parameter {name!r} must be an integer")
    return int(raw)


def _path_int(request: web.Request, name: str) -> int:
    raw = request.match_info[name]
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 12:  # "\u00b2".isdigit() is True
        raise ApiError(400, "bad_path", f"{name} in the path must be a non-negative integer, got {raw[:20]!r}")
    return int(raw)


# --- handlers ---------------------------------------------------------------------------------
async def get_run(request: web.Request) -> web.Response:
    return json_ok(_collab(request).run_info)


async def get_status(request: web.Request) -> web.Response:
    status = _collab(request).status()
    return json_ok(dataclasses.replace(status, shards=shards_api.status_summary(request.app)))


async def get_progress(request: web.Request) -> web.Response:
    """The collaboration's progress without reporting any: what a peer polls while it waits."""
    return json_ok(_collab(request).state())


async def get_state(request: web.Request) -> web.Response:
    return json_ok(_collab(request).state_info())


async def post_join(request: web.Request) -> web.Response:
    req = await read_message(request, JoinRequest)
    identity = request.get(IDENTITY_KEY)
    username = identity["username"] if identity is not None else f"anonymous:{req.peer_name}"
    return json_ok(_collab(request).join(req, username))


def own_peer(request: web.Request, peer_id: str) -> str:
    """A peer id acts only for the user who joined with it: otherwise alice could heartbeat,
    leave or upload as bob. (Open mode has no users to tell apart.)"""
    identity = request.get(IDENTITY_KEY)
    if identity is not None and _collab(request).peer(peer_id).username != identity["username"]:
        raise ApiError(403, "not_your_peer", "this peer id belongs to another user",
                       "Use the peer id your own join returned.")
    return peer_id


async def post_heartbeat(request: web.Request) -> web.Response:
    hb = await read_message(request, Heartbeat)
    return json_ok(_collab(request).heartbeat(own_peer(request, request.match_info["peer_id"]), hb))


async def post_leave(request: web.Request) -> web.Response:
    _collab(request).leave(own_peer(request, request.match_info["peer_id"]))
    return json_ok({"ok": True})


async def put_gradient(request: web.Request) -> web.Response:
    collab = _collab(request)
    step = _path_int(request, "step")
    peer_id = own_peer(request, request.query.get("peer_id", ""))
    limit = collab.codec.wire_bytes(collab.num_params)
    if request.content_length is None:
        raise ApiError(411, "length_required", "a gradient upload must declare its Content-Length",
                       "Send the body with a known length (the toolkit does); chunked uploads are refused.")
    if request.content_length > limit + MAX_HEADER + 8:
        raise ApiError(413, "body_too_large", f"a gradient is at most {limit + MAX_HEADER + 8} bytes")
    body = request.get(BODY_STREAM_KEY, request.content)  # signed runs: every chunk checked against its digest
    reader = AsyncContainerReader(body, limit, total_bytes=request.content_length)
    try:
        receipt = await collab.receive_gradient(step, peer_id, reader)
    except (ApiError, ProtocolError):
        await _drain(request)
        raise
    return json_ok(receipt)


async def _drain(request: web.Request) -> None:
    """Read a little of a rejected body so the peer gets our answer, not a reset connection."""
    remaining = request.content_length
    if remaining is None or remaining > _DRAIN_LIMIT:
        return
    try:
        await request.content.read(_DRAIN_LIMIT)
    except Exception:  # the peer may already be gone
        pass


async def get_params(request: web.Request) -> web.StreamResponse:
    """The parameters of version >= ``min_step``, long-polling up to ``wait`` seconds: in full,
    or as a delta when the peer says it holds the version before (``have``) and the run's codec
    is lossy. 204 when nothing newer was published in time."""
    collab = _collab(request)
    min_step = _int_query(request, "min_step", 0)
    have = _int_query(request, "have", -1)
    wait = min(MAX_LONG_POLL_S, max(0.0, float(_int_query(request, "wait", 0))))
    peer_id = request.query.get("peer_id", "")
    peer = collab.registry.get(own_peer(request, peer_id)) if peer_id else None
    if peer is not None:
        peer.inflight += 1  # a waiting peer is alive
    try:
        version = await collab.wait_for_step(min_step, wait)
    finally:
        if peer is not None:
            peer.inflight -= 1
            collab.registry.touch(peer)
    if version is None:
        return web.Response(status=204, headers={"X-Collab-Step": str(collab.step)})
    return await collab.publisher.send(request, version, have if have >= 0 else None)


async def get_favicon(request: web.Request) -> web.Response:
    """Browsers ask for /favicon.ico even on JSON pages; the dashboard's icon is an SVG."""
    raise web.HTTPMovedPermanently("/static/favicon.svg")


async def get_index(request: web.Request) -> web.StreamResponse:
    static = resources.files("relay_server").joinpath("static/index.html")
    if static.is_file():
        return web.Response(text=static.read_text(), content_type="text/html")
    status = _collab(request).status()
    return web.Response(text=f"<!doctype html><title>{status.run_name}</title><h1>{status.run_name}</h1>"
                             f"<p>step {status.step}, {status.num_peers} peers. JSON: <a href='/api/status'>/api/status</a>",
                        content_type="text/html")


ROUTE_TABLE = [
    ("GET", ROUTES["run"], get_run),
    ("GET", ROUTES["status"], get_status),
    ("GET", ROUTES["state"], get_state),
    ("GET", ROUTES["progress"], get_progress),
    ("GET", ROUTES["params"], get_params),
    ("POST", ROUTES["join"], post_join),
    ("POST", ROUTES["heartbeat"], post_heartbeat),
    ("POST", ROUTES["leave"], post_leave),
    ("PUT", ROUTES["gradient"], put_gradient),
    ("GET", "/", get_index),
    ("GET", "/favicon.ico", get_favicon),
    *shards_api.ROUTES,
]


# What an observer or a peer that has not logged in yet may read.
PUBLIC_ROUTES = frozenset({"/", "/static", "/favicon.ico", ROUTES["status"], ROUTES["run"], ROUTES["login"],
                           ROUTES["shards"]})


def build_auth(config: RelayConfig, is_banned: Callable[[str], bool]) -> tuple[list, list]:
    """The middleware and routes for ``auth.mode``: none in open mode (the lifespan says so loudly).

    In "hf" mode every route but :data:`PUBLIC_ROUTES` needs a signed request with a valid pass."""
    if config.auth.mode == "open":
        return [], []
    a = config.auth
    key = RelayKey.load_or_create(config.server.data_dir)
    allow = AllowList(users=frozenset(a.allow_users), orgs=frozenset(a.allow_orgs), any_user=a.allow_any_hf_user)
    identity = HfIdentityVerifier(allow, endpoint=a.hf_endpoint or None, timeout_s=a.login_timeout_s)
    service = LoginService(identity, PassIssuer(key, ttl_s=a.pass_ttl_s), is_banned=is_banned,
                           reauth_after_s=a.reauth_after_s)
    verifier = RequestVerifier(key, max_skew_s=a.max_skew_s, is_banned=is_banned)
    return [auth_middleware(verifier, PUBLIC_ROUTES)], service.routes()


def create_app(config: RelayConfig, middlewares: tuple = ()) -> web.Application:
    app = web.Application(middlewares=[error_middleware, *middlewares], client_max_size=MAX_JSON_BODY)
    auth_middlewares, auth_routes = build_auth(config, lambda user: COLLAB in app and app[COLLAB].store.is_banned(user))
    admin_middlewares, admin_routes = build_admin(config, lambda: app[COLLAB])
    before_auth, after_auth = build_rate_limits(config.limits, auth_enabled=bool(auth_middlewares))
    # admin (own token, then straight to its handler) -> failed-auth guard -> auth -> per-user limits
    app.middlewares.extend([*admin_middlewares, *before_auth, *auth_middlewares, *after_auth])
    app[CONFIG] = config
    for method, path, handler in [*ROUTE_TABLE, *auth_routes, *admin_routes]:
        app.router.add_route(method, path, handler)
    static_dir = resources.files("relay_server").joinpath("static")
    if static_dir.is_dir():
        app.router.add_static("/static", str(static_dir))
    app.cleanup_ctx.append(_lifespan)
    app.cleanup_ctx.append(shards_api.lifespan)  # after the collaboration it expires leases against
    return app


async def _lifespan(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    store = Store(config.server.data_dir, keep=config.server.keep_checkpoints, fsync=config.server.fsync)
    observers = ObserverThread(build_observers(config))
    collab = await asyncio.to_thread(Collaboration, config, store, observers)
    app[COLLAB] = collab
    ticker = asyncio.create_task(collab.run_ticker())
    if config.auth.mode == "open":
        log.warning("AUTH IS OFF (auth.mode = 'open'): anyone who can reach this relay can join and send gradients")
    yield
    ticker.cancel()
    try:
        await ticker
    except asyncio.CancelledError:
        pass
    await asyncio.to_thread(observers.close)
    collab.close()
    store.close()
