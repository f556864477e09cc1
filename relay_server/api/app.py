"""The relay's HTTP API: routes as data, one lifespan that owns the store and the ticker.

Bodies stream: a gradient upload is reduced chunk by chunk as it arrives, parameters are written
from an immutable snapshot in chunks with back-pressure. Every error, ours or aiohttp's, leaves as
``{"error": code, "message": ..., "hint": ...}`` with a 4xx/5xx status (:mod:`relay_server.core.http`).
Internal routes (aggregators registering, heartbeating, pulling state) take the admin token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from importlib import resources
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from relay_server.api import params_cache
from relay_server.api import shards as shards_api
from relay_server.api import tokenizer as tokenizer_api
from relay_server.api import toolkit_dist as toolkit_api
from relay_server.api.context import COLLAB, CONFIG, own_peer
from relay_server.api.context import collab as _collab
from relay_server.api.feature import RUNNING, SLICE_PARAMS, TAKEN_OVER, TICKETED_GRADIENT, FeatureSet
from relay_server.api.moderation import build_admin, read_token, token_path
from relay_server.api.ratelimit import build_rate_limits
from relay_server.api.stall_hook import stall_middlewares
from relay_server.auth.access import LoginService, PassIssuer
from relay_server.auth.identity import AllowList, HfIdentityVerifier
from relay_server.auth.relay_key import RelayKey
from relay_server.auth.verify import BODY_STREAM_KEY, IDENTITY_KEY, RequestVerifier, auth_middleware
from relay_server.backbone.backbone import Backbone
from relay_server.backbone.slice_routes import MAX_LONG_POLL_S, get_slice, put_slice, sent_bytes
from relay_server.backbone.state_transfer import check_range, send_state
from relay_server.backbone.tickets import encode_ticket
from relay_server.collaboration.machine import Collaboration
from relay_server.collaboration.status import place_peers
from relay_server.core import logsafe
from relay_server.core.config import RelayConfig
from relay_server.core.errors import ApiError
from relay_server.core.http import drain as _drain  # noqa: F401
from relay_server.core.http import error_middleware, json_ok, read_message, upload_length
from relay_server.core.http import int_query as _int_query
from relay_server.core.http import path_int as _path_int
from relay_server.data.loss_references import loss_references
from relay_server.evaluation import feature as evaluation_feature
from relay_server.local_sgd import feature as local_sgd_feature
from relay_server.moe import feature as moe_feature
from relay_server.observers import ObserverThread, build_observers
from relay_server.pipeline import feature as pipeline_feature
from relay_server.rounds.reducer import set_upload_memory
from relay_server.rounds.store import Store
from toolkit.errors import ProtocolError
from toolkit.wire.protocol import (
    FRESH_CACHE_CONTROL,
    MAX_JSON_BODY,
    ROUTES,
    TICKET_HEADER,
    AggregatorHeartbeat,
    AggregatorRegistration,
    DoneRequest,
    Heartbeat,
    JoinRequest,
    TicketRequest,
)
from toolkit.wire.tensor_container import AsyncContainerReader

if TYPE_CHECKING:
    from relay_server.rounds.publisher import Version

log = logging.getLogger(__name__)


# --- handlers ---------------------------------------------------------------------------------
async def get_run(request: web.Request) -> web.Response:
    return json_ok(_collab(request).run_info)


FEATURES = FeatureSet(
    (moe_feature.FEATURE, pipeline_feature.FEATURE, local_sgd_feature.FEATURE, evaluation_feature.FEATURE)
)
"""Every feature the relay can plug in (:mod:`relay_server.api.feature`); a run enables some."""

STATUS_CACHE_S = 1.0  # dashboards poll every 1.5 s: any number of them costs about one report a second
_STATUS_CACHE = web.AppKey("status_cache", list)
LOSS_REFERENCES = web.AppKey("loss_references", list)


async def get_status(request: web.Request) -> web.Response:
    """The dashboard's report, shared for up to :data:`STATUS_CACHE_S` while the step, the peers
    online and the open round stay the same (any change there builds a fresh one)."""
    collab, cache = _collab(request), request.app[_STATUS_CACHE]
    r = collab.rounds.round
    key = (collab.step, len(collab.registry.peers), r and (r.round_id, len(r.received), len(r.expected), r.closed))
    now = time.monotonic()
    if now - cache[0] >= STATUS_CACHE_S or cache[1] != key:
        fields, places = FEATURES.status(request.app)
        status = dataclasses.replace(
            place_peers(collab.status(), places.experts_hosted, places.stage_of),
            shards=shards_api.status_summary(request.app),
            loss_references=request.app[LOSS_REFERENCES],
            **fields,
        )
        cache[:] = [now, key, status.dumps()]
    return web.Response(body=cache[2], content_type="application/json")


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


async def post_heartbeat(request: web.Request) -> web.Response:
    hb = await read_message(request, Heartbeat)
    return json_ok(_collab(request).heartbeat(own_peer(request, request.match_info["peer_id"]), hb))


async def post_leave(request: web.Request) -> web.Response:
    _collab(request).leave(own_peer(request, request.match_info["peer_id"]))
    return json_ok({"ok": True})


async def put_gradient(request: web.Request) -> web.Response:
    collab = _collab(request)
    takeover = request.app[TAKEN_OVER].get(TICKETED_GRADIENT)
    if TICKET_HEADER in request.headers and takeover is not None:  # a running feature's slice (a pipeline stage's)
        return await takeover(request)
    if TICKET_HEADER in request.headers:  # a slice of a sliced round: the relay's own slice
        receipt = await put_slice(
            request,
            collab.backbone.local,
            collab.backbone.ticket_key,
            require_digests=collab.config.auth.mode != "open",
        )
        collab.traffic.up_bytes += request.content_length or 0  # accepted (a refusal raised)
        return json_ok(receipt)
    step = _path_int(request, "step")
    peer_id = own_peer(request, request.query.get("peer_id", ""))
    limit = collab.codecs.up.wire_bytes(collab.num_params)
    upload_length(request, limit)
    body = request.get(BODY_STREAM_KEY, request.content)  # signed runs: every chunk checked against its digest
    reader = AsyncContainerReader(body, limit, total_bytes=request.content_length)
    try:
        receipt = await collab.gradients.receive(step, peer_id, reader)
    except (ApiError, ProtocolError):
        await _drain(request)
        raise
    return json_ok(receipt)


async def get_params(request: web.Request) -> web.StreamResponse:
    """The parameters of version >= ``min_step``, long-polling up to ``wait`` seconds: in full,
    or as a delta when the peer says it holds the version before (``have``) and the run's codec
    is lossy. 204 when nothing newer was published in time. When aggregators own slices the
    answer is the version's manifest (JSON), and ``start``/``end`` ask for the relay's own slice.
    A peer that says ``ref=1`` on a run with ``[server] public_params_url`` gets a signed
    :class:`~toolkit.wire.protocol.ParamsRef` instead: the body's immutable URL at the cache.
    Every answer is ``no-store``: which version is current must never come from a cache."""
    collab = _collab(request)
    peer_id = request.query.get("peer_id", "")
    if peer_id:  # before anything is recorded for it (transfer rates, liveness)
        own_peer(request, peer_id)
    takeover = request.app[TAKEN_OVER].get(SLICE_PARAMS)
    if "start" in request.query and takeover is not None:  # a running feature's slice (a pipeline stage's)
        return await takeover(request)
    if "start" in request.query:
        response = await get_slice(request, collab.backbone.local, collab.backbone.planning.record_transfer)
        collab.traffic.down_bytes += response.content_length or 0
        return response
    min_step = _int_query(request, "min_step", 0)
    have = _int_query(request, "have", -1)
    wait = min(MAX_LONG_POLL_S, max(0.0, float(_int_query(request, "wait", 0))))
    peer = collab.registry.get(peer_id) if peer_id else None
    if peer is not None:
        peer.inflight += 1  # a waiting peer is alive
    try:
        version = await collab.wait_for_step(min_step, wait)
    finally:
        if peer is not None:
            peer.inflight -= 1
            collab.registry.touch(peer)
    if version is None:
        return web.Response(
            status=204, headers={"X-Collab-Step": str(collab.step), "Cache-Control": FRESH_CACHE_CONTROL}
        )
    if version.manifest is not None:  # sliced: each slice comes from its owner (get_slice)
        manifest = json_ok(version.manifest)
        manifest.headers["Cache-Control"] = FRESH_CACHE_CONTROL
        return manifest
    own: Version = version.version  # type: ignore[assignment]  # no manifest: the relay's own version file
    if request.query.get("ref") == "1" and collab.config.server.public_params_url:  # the body from the run's cache
        ref = params_cache.ref_response(request, own, have if have >= 0 else None)
        collab.traffic.down_bytes += ref.content_length or 0
        return ref
    started = time.monotonic()
    response = await collab.publisher.send(request, own, have if have >= 0 else None)
    request.app[params_cache.BLOBS].egress.direct += response.content_length or 0
    collab.traffic.down_bytes += response.content_length or 0
    collab.backbone.planning.record_transfer(
        peer_id[:64], "down", version.step, sent_bytes(request, response), started
    )
    return response


async def post_ticket(request: web.Request) -> web.Response:
    req = await read_message(request, TicketRequest)
    peer_id = own_peer(request, request.query.get("peer_id", ""))
    ticket = _collab(request).gradients.ticket(_path_int(request, "step"), peer_id, req)
    return json_ok({"ticket": encode_ticket(ticket)})


async def post_done(request: web.Request) -> web.Response:
    req = await read_message(request, DoneRequest)
    peer_id = own_peer(request, request.query.get("peer_id", ""))
    return json_ok(_collab(request).gradients.done(_path_int(request, "step"), peer_id, req))


async def get_plan(request: web.Request) -> web.Response:
    return json_ok(_collab(request).plan_info())


# --- the relay's aggregators (under /api/admin: the admin middleware checked the token) ----------
def _backbone(request: web.Request) -> Backbone:
    return _collab(request).backbone


async def post_aggregator_register(request: web.Request) -> web.Response:
    backbone = _backbone(request)
    return json_ok(backbone.register(await read_message(request, AggregatorRegistration)))


async def post_aggregator_heartbeat(request: web.Request) -> web.Response:
    backbone = _backbone(request)
    backbone.heartbeat(request.match_info["aggregator_id"], await read_message(request, AggregatorHeartbeat))
    return json_ok({"ok": True})


async def get_internal_state(request: web.Request) -> web.StreamResponse:
    """A slice of the state being handed to new owners during a plan change."""
    backbone = _backbone(request)
    start, end, step = _int_query(request, "start"), _int_query(request, "end"), _int_query(request, "step")
    check_range(start, end, backbone.num_params)
    return await send_state(
        request, backbone.staged(start, end, step), {"step": str(step), "start": str(start), "end": str(end)}
    )


async def get_favicon(request: web.Request) -> web.Response:
    """Browsers ask for /favicon.ico even on JSON pages; the dashboard's icon is an SVG."""
    raise web.HTTPMovedPermanently("/static/favicon.svg")


async def get_index(request: web.Request) -> web.StreamResponse:
    static = resources.files("relay_server.api").joinpath("static/index.html")
    if static.is_file():
        return web.Response(text=static.read_text(), content_type="text/html")
    status = _collab(request).status()
    return web.Response(
        text=f"<!doctype html><title>{status.run_name}</title><h1>{status.run_name}</h1>"
        f"<p>step {status.step}, {status.num_peers} peers. JSON: <a href='/api/status'>/api/status</a>",
        content_type="text/html",
    )


ROUTE_TABLE = [
    ("GET", ROUTES["run"], get_run),
    ("GET", ROUTES["status"], get_status),
    ("GET", ROUTES["state"], get_state),
    ("GET", ROUTES["progress"], get_progress),
    ("GET", ROUTES["params"], get_params),
    ("GET", ROUTES["plan"], get_plan),
    ("POST", ROUTES["ticket"], post_ticket),
    ("POST", ROUTES["done"], post_done),
    ("POST", ROUTES["aggregator_register"], post_aggregator_register),
    ("POST", ROUTES["aggregator_heartbeat"], post_aggregator_heartbeat),
    ("GET", ROUTES["slice_state"], get_internal_state),
    ("POST", ROUTES["join"], post_join),
    ("POST", ROUTES["heartbeat"], post_heartbeat),
    ("POST", ROUTES["leave"], post_leave),
    ("PUT", ROUTES["gradient"], put_gradient),
    ("GET", "/", get_index),
    ("GET", "/favicon.ico", get_favicon),
    *shards_api.ROUTES,
    *tokenizer_api.ROUTES,
    *toolkit_api.ROUTES,
    *FEATURES.routes,
    *params_cache.ROUTE_TABLE,
]


# What an observer or a peer that has not logged in yet may read.
PUBLIC_ROUTES = frozenset(
    {
        "/",
        "/static",
        "/favicon.ico",
        ROUTES["status"],
        ROUTES["run"],
        ROUTES["login"],
        ROUTES["shards"],
        ROUTES["plan"],
        *toolkit_api.PUBLIC,
        *params_cache.PUBLIC,
        *FEATURES.public,
    }
)


# Routes whose body is a streamed tensor container (signed by header hash + chunk digests).
CONTAINER_ROUTES = frozenset({("PUT", ROUTES["gradient"])})


def build_auth(
    config: RelayConfig,
    is_banned: Callable[[str], bool],
    container_limit: Callable[[], int] = lambda: 0,
    container_limits: Mapping[tuple[str, str], Callable[[], int]] | None = None,
) -> tuple[list[Middleware], list[tuple[str, str, Handler]]]:
    """The middleware and routes for ``auth.mode``: none in open mode (the lifespan says so loudly).

    In "hf" mode every route but :data:`PUBLIC_ROUTES` needs a signed request with a valid pass."""
    if config.auth.mode == "open":
        return [], []
    a = config.auth
    key = RelayKey.load_or_create(config.server.data_dir)
    allow = AllowList(users=frozenset(a.allow_users), orgs=frozenset(a.allow_orgs), any_user=a.allow_any_hf_user)
    identity = HfIdentityVerifier(allow, endpoint=a.hf_endpoint or None, timeout_s=a.login_timeout_s)
    service = LoginService(
        identity, PassIssuer(key, ttl_s=a.pass_ttl_s), is_banned=is_banned, reauth_after_s=a.reauth_after_s
    )
    verifier = RequestVerifier(key, max_skew_s=a.max_skew_s, is_banned=is_banned)
    return [
        auth_middleware(
            verifier,
            PUBLIC_ROUTES,
            container_routes=CONTAINER_ROUTES,
            container_limit=container_limit,
            binary_routes=FEATURES.binary_routes,
            container_limits=container_limits,
        )
    ], service.routes()


def create_app(config: RelayConfig, middlewares: tuple[Middleware, ...] = ()) -> web.Application:
    logsafe.install()  # user text escaped and secrets redacted in every log line
    app = web.Application(
        middlewares=[error_middleware, *stall_middlewares(), *middlewares],  # stalls: tests only
        client_max_size=MAX_JSON_BODY,
    )
    auth_middlewares, auth_routes = build_auth(
        config,
        lambda user: COLLAB in app and app[COLLAB].store.is_banned(user),
        lambda: app[COLLAB].codecs.up.wire_bytes(app[COLLAB].num_params),
        FEATURES.container_limits(app),
    )
    admin_middlewares, admin_routes = build_admin(config, lambda: app[COLLAB])
    before_auth, after_auth = build_rate_limits(config.limits, auth_enabled=bool(auth_middlewares))
    # admin (own token, then straight to its handler) -> failed-auth guard -> auth -> per-user limits
    app.middlewares.extend([*admin_middlewares, *before_auth, *auth_middlewares, *after_auth])
    app[CONFIG] = config
    app[_STATUS_CACHE] = [0.0, None, b""]  # (built at, what it was built for, the JSON)
    app[LOSS_REFERENCES] = []
    app[RUNNING], app[TAKEN_OVER] = {}, {}
    for method, path, handler in [*ROUTE_TABLE, *auth_routes, *admin_routes]:
        app.router.add_route(method, path, handler)
    static_dir = resources.files("relay_server.api").joinpath("static")
    if static_dir.is_dir():
        app.router.add_static("/static", str(static_dir))
    app.cleanup_ctx.append(_lifespan)
    app.cleanup_ctx.append(shards_api.lifespan)  # after the collaboration it expires leases against
    app.cleanup_ctx.append(tokenizer_api.lifespan)  # the run's tokenizer sha256 and objective into RunInfo
    app.cleanup_ctx.append(_loss_references)  # from the tokenizer just loaded
    app.cleanup_ctx.append(toolkit_api.lifespan)  # the toolkit's wheel, served to notebooks
    app.cleanup_ctx.append(FEATURES.lifespan)  # the enabled features' services ([moe], [pipeline]...)
    app.cleanup_ctx.append(params_cache.lifespan)  # immutable parameter URLs for a cache; the relay's egress
    return app


async def _loss_references(app: web.Application) -> AsyncIterator[None]:
    """Chance level (and the demo text's unigram entropy) for the dashboard and the demo, once."""
    app[LOSS_REFERENCES] = await asyncio.to_thread(loss_references, app[CONFIG], app.get(tokenizer_api.TOKENIZER))
    yield


async def _lifespan(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    set_upload_memory(config.server.upload_memory_mb << 20)
    store = Store(config.server.data_dir, keep=config.server.keep_checkpoints, fsync=config.server.fsync)
    observers = ObserverThread(build_observers(config))
    collab = await asyncio.to_thread(
        Collaboration,
        config,
        store,
        observers,
        FEATURES.opening(config),
        FEATURES.keep_parameters(config),
        FEATURES.run_info(config),
    )
    app[COLLAB] = collab
    collab.backbone.attach(read_token(token_path(config)))  # written by build_admin: calls to aggregators carry it
    await collab.start()
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
    await collab.backbone.aclose()
    collab.close()
    store.close()
