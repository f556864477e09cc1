"""``relay-server aggregator``: an extra server that owns a slice of the vector for the relay.

    relay-server aggregator --coordinator https://relay.example --port 8751 \\
        --public-url https://agg1.example --data-dir agg1-data --admin-token-file admin_token

It registers with the relay (the coordinator) using the organizer's admin token, heartbeats with
what it measured, and owns the slice the relay's plan assigns it: the master parameters and
optimizer state of that slice, the reduction of the gradient slices peers upload to it (with the
relay's tickets), and the published versions of the slice that peers download from it
(:class:`relay_server.backbone.slice_owner.SliceOwner`, the same code the relay runs for its own slice).
It never decides anything: the relay opens and closes rounds, tells it when to finalize (asking
first for its slice's gradient norm when clipping by the global norm), and
moves slices between rounds (``assign``). Its versions live in its own data directory.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from relay_server.api.moderation import AdminToken
from relay_server.api.server import serve_app
from relay_server.backbone.slice_owner import SliceOwner
from relay_server.backbone.slice_routes import get_slice, put_slice
from relay_server.backbone.state_transfer import CallFailed, InternalClient, check_range, send_state
from relay_server.core import logsafe
from relay_server.core.config import OptimizerSection, RoundsSection
from relay_server.core.data_lock import DataDirLock
from relay_server.core.errors import ApiError
from relay_server.core.http import error_middleware, int_query, json_ok, read_message
from relay_server.planning.measure import ServerMeter
from relay_server.rounds.publisher import Version
from relay_server.rounds.reducer import robust_config
from relay_server.rounds.store import Store
from toolkit.wire.compression import run_codecs
from toolkit.wire.protocol import (
    MAX_JSON_BODY,
    PROTOCOL_VERSION,
    ROUTES,
    AggregatorHeartbeat,
    AggregatorRegistration,
    AggregatorWelcome,
    AssignRequest,
    FinalizeRequest,
    GradNormReport,
    GradNormRequest,
    SliceReport,
    TransferSample,
)

log = logging.getLogger(__name__)

AGGREGATOR: web.AppKey[AggregatorServer] = web.AppKey("aggregator", object)  # type: ignore[arg-type]  # class below
MAX_PENDING_TRANSFERS = 4096


class AggregatorServer:
    def __init__(
        self,
        *,
        coordinator: str,
        public_url: str,
        data_dir: str | Path,
        token: str,
        name: str,
        keep_versions: int = 3,
        call_timeout_s: float = 60.0,
    ) -> None:
        self.coordinator, self.public_url, self.name, self.token = coordinator.rstrip("/"), public_url, name, token
        self.admin = AdminToken(token)
        self.store = Store(data_dir, keep=keep_versions)
        self.client = InternalClient(token, call_timeout_s)
        self.welcome: AggregatorWelcome | None = None
        self.owner: SliceOwner | None = None
        self.meter = ServerMeter()
        self.transfers: list[TransferSample] = []
        self._assigning = asyncio.Lock()
        self.task: asyncio.Task[None] | None = None  # register + heartbeat loop

    @property
    def aggregator_id(self) -> str:
        return self.welcome.aggregator_id if self.welcome else ""

    def record(self, peer_id: str, direction: str, step: int, nbytes: int, started: float) -> None:
        """A transfer this aggregator served: into its own rates, and reported to the relay."""
        self.meter.record(direction, step, nbytes, started)
        if peer_id and nbytes and len(self.transfers) < MAX_PENDING_TRANSFERS:
            self.transfers.append(
                TransferSample(
                    peer_id=peer_id,
                    direction=direction,  # type: ignore[arg-type]  # the slice routes pass "up" or "down"
                    step=step,
                    nbytes=nbytes,
                    seconds=max(time.monotonic() - started, 1e-6),
                )
            )

    # --- talking to the relay ---------------------------------------------------------------------
    async def run(self) -> None:
        """Register, then heartbeat forever; register again whenever the relay forgot us."""
        await asyncio.to_thread(_warm_up)
        while True:
            if self.welcome is None:
                try:
                    self.welcome = await self.client.call(
                        "POST",
                        self.coordinator + ROUTES["aggregator_register"],
                        AggregatorWelcome,
                        AggregatorRegistration(name=self.name, url=self.public_url, protocol=PROTOCOL_VERSION),
                    )
                    log.info("registered with %s as %s", self.coordinator, self.aggregator_id)
                except CallFailed as exc:
                    log.warning("cannot register with the relay yet: %s", exc)
                    await asyncio.sleep(1.0)
                    continue
            await asyncio.sleep(self.welcome.heartbeat_interval_s)
            await self._heartbeat()

    async def _heartbeat(self) -> None:
        sent, self.transfers = self.transfers, []
        hb = AggregatorHeartbeat(
            step=self.owner.step if self.owner else 0,
            plan_version=self.owner.plan_version if self.owner else "",
            upload=self.meter.upload.value,
            download=self.meter.download.value,
            transfers=sent,
        )
        url = self.coordinator + ROUTES["aggregator_heartbeat"].format(aggregator_id=self.aggregator_id)
        try:
            await self.client.call("POST", url, None, hb)
        except CallFailed as exc:
            if "HTTP 410" in str(exc):  # declared dead or the relay restarted: join again (state kept
                log.warning("the relay dropped this aggregator; registering again")  # until reassigned)
                self.welcome = None
            else:
                log.warning("heartbeat failed: %s", exc)

    # --- what the relay asks ----------------------------------------------------------------------
    async def assign(self, req: AssignRequest) -> SliceReport:
        """Own ``[start, end)`` from ``step`` on: pull the state from the relay, publish it."""
        if self.welcome is None:
            raise ApiError(503, "not_registered", "this aggregator is not registered yet")
        run = self.welcome.run
        check_range(req.start, req.end, run.num_params)
        async with self._assigning:
            try:
                meta, state, _ = await self.client.fetch_tensors(
                    self.coordinator + ROUTES["slice_state"], {"start": req.start, "end": req.end, "step": req.step}
                )
            except CallFailed as exc:
                raise ApiError(502, "state_pull_failed", str(exc)) from None
            if (meta.get("start"), meta.get("end"), meta.get("step")) != (str(req.start), str(req.end), str(req.step)):
                raise ApiError(502, "state_pull_failed", f"the relay sent {meta}")
            owner = await asyncio.to_thread(  # builds the optimizer: keep the event loop (heartbeats) free
                SliceOwner,
                run.layout,
                state,
                start=req.start,
                end=req.end,
                step=req.step,
                optimizer=OptimizerSection(**self.welcome.optimizer),
                total_steps=run.total_steps,
                codecs=run_codecs(run.compression, run.download_compression),
                store=self.store,
                run_name=run.run_name,
                download_feedback=run.download_feedback,
                robust=robust_config(RoundsSection(**self.welcome.rounds)),
                plan_version=req.plan_version,
                on_transfer=self.record,
            )
            version: Version = await owner.reducer.run(owner.write_initial)
            owner.publisher.publish(version)
            old, self.owner = self.owner, owner
            if old is not None:
                await asyncio.to_thread(old.close)
        log.info("now owning [%d, %d) at step %d (plan %s)", req.start, req.end, req.step, req.plan_version)
        return SliceReport(step=version.step, start=req.start, end=req.end, sha256=version.sha256)

    async def grad_norm(self, req: GradNormRequest) -> GradNormReport:
        """Close the round and report its mean gradient's squared norm (global-norm clipping)."""
        owner = self.current_owner(req.plan_version)
        sq_norm = await owner.grad_sq_norm(req.step, req.round_id)
        return GradNormReport(step=req.step, round_id=req.round_id, start=owner.start, end=owner.end, sq_norm=sq_norm)

    async def finalize(self, req: FinalizeRequest) -> SliceReport:
        owner = self.current_owner(req.plan_version)
        version, r, norm = await owner.finalize(req.step, req.round_id, req.grad_norm)
        return SliceReport(
            step=version.step,
            start=owner.start,
            end=owner.end,
            sha256=version.sha256,
            peers=len(r.received),
            grad_norm=norm,
            refused=r.refused,
        )

    def current_owner(self, plan_version: str | None = None) -> SliceOwner:
        """The slice this aggregator owns, refused (409) when it owns none or follows another plan."""
        if self.owner is None:
            raise ApiError(409, "no_slice", "this aggregator owns no slice")
        if plan_version is not None and plan_version != self.owner.plan_version:
            raise ApiError(
                409,
                "plan_changed",
                f"finalize for plan {plan_version}, this aggregator follows {self.owner.plan_version}",
            )
        return self.owner

    async def close(self) -> None:
        await self.client.close()
        if self.owner is not None:
            self.owner.close()
        self.store.close()


def _warm_up() -> None:
    """Build and step a tiny optimizer once: torch imports a lot lazily on the first one, which
    would otherwise stall the first ``assign`` (seconds on a small VM)."""
    import torch

    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    for opt in (torch.optim.SGD([p], lr=0.1, momentum=0.9), torch.optim.AdamW([p])):
        opt.step()


# --- HTTP -------------------------------------------------------------------------------------------
def _agg(request: web.Request) -> AggregatorServer:
    return request.app[AGGREGATOR]


def _internal(request: web.Request) -> AggregatorServer:
    """The relay's calls (grad norm, finalize, assign, state): the organizer's admin token."""
    agg = _agg(request)
    agg.admin.check(request.headers.get("Authorization"))
    return agg


async def put_gradient(request: web.Request) -> web.Response:
    agg = _agg(request)
    if agg.welcome is None:
        raise ApiError(503, "not_registered", "this aggregator has not joined the run yet", "Retry shortly.")
    return json_ok(
        await put_slice(request, agg.owner, agg.welcome.ticket_key, require_digests=agg.welcome.run.auth != "open")
    )


async def get_params(request: web.Request) -> web.StreamResponse:
    agg = _agg(request)
    return await get_slice(request, agg.owner, agg.record)


async def post_finalize(request: web.Request) -> web.Response:
    agg = _internal(request)
    return json_ok(await agg.finalize(await read_message(request, FinalizeRequest)))


async def post_grad_norm(request: web.Request) -> web.Response:
    agg = _internal(request)
    return json_ok(await agg.grad_norm(await read_message(request, GradNormRequest)))


async def post_assign(request: web.Request) -> web.Response:
    agg = _internal(request)
    return json_ok(await agg.assign(await read_message(request, AssignRequest)))


async def get_state(request: web.Request) -> web.StreamResponse:
    """The slice's whole state at ``step`` (the relay's recovery copy, and plan changes)."""
    agg = _internal(request)
    owner = agg.current_owner()
    step = int_query(request, "step")
    if step != owner.step:
        raise ApiError(409, "wrong_step", f"this slice is at step {owner.step}, not {step}")
    got, state = await owner.reducer.run(owner.export)
    return await send_state(request, state, {"step": str(got), "start": str(owner.start), "end": str(owner.end)})


async def get_status(request: web.Request) -> web.Response:
    agg = _agg(request)
    owner = agg.owner
    return json_ok(
        {
            "aggregator_id": agg.aggregator_id,
            "name": agg.name,
            "coordinator": agg.coordinator,
            "slice": [owner.start, owner.end] if owner else None,
            "step": owner.step if owner else None,
            "plan_version": owner.plan_version if owner else None,
            "upload": agg.meter.upload.value,
            "download": agg.meter.download.value,
        }
    )


ROUTE_TABLE = [
    ("PUT", ROUTES["gradient"], put_gradient),
    ("GET", ROUTES["params"], get_params),
    ("GET", ROUTES["status"], get_status),
    ("POST", ROUTES["grad_norm"], post_grad_norm),
    ("POST", ROUTES["finalize"], post_finalize),
    ("POST", ROUTES["assign"], post_assign),
    ("GET", ROUTES["slice_state"], get_state),
]


def create_app(agg: AggregatorServer) -> web.Application:
    logsafe.install()  # user text escaped and secrets redacted in every log line
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_JSON_BODY)
    app[AGGREGATOR] = agg
    for method, path, handler in ROUTE_TABLE:
        app.router.add_route(method, path, handler)
    app.cleanup_ctx.append(_lifespan)
    return app


async def _lifespan(app: web.Application) -> AsyncIterator[None]:
    agg = app[AGGREGATOR]
    yield
    if agg.task is not None:
        agg.task.cancel()
        try:
            await agg.task
        except asyncio.CancelledError:
            pass
    await agg.close()


async def serve_aggregator(
    *,
    coordinator: str,
    host: str,
    port: int,
    public_url: str | None,
    data_dir: str,
    token: str,
    name: str | None,
    keep_versions: int = 3,
    ready_file: str | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Listen, then register with the relay at ``coordinator`` (once the URL peers use is known:
    with ``port`` 0 the bound port is in it, the ``ready_file`` gets it, and an unnamed aggregator
    is named after it). Its data dir is locked first, as a relay's is (:mod:`relay_server.core.data_lock`):
    two aggregators on one directory would write one slice's versions over each other."""
    with DataDirLock.acquire(data_dir, "aggregator") as lock:
        agg = AggregatorServer(
            coordinator=coordinator,
            public_url=public_url or "",
            data_dir=data_dir,
            token=token,
            name=name or "",
            keep_versions=keep_versions,
        )

        def ready(url: str) -> None:
            lock.announce(url)
            agg.public_url = (public_url or url).rstrip("/")
            agg.name = agg.name or agg.public_url.split("://")[-1][:128]
            agg.task = asyncio.get_running_loop().create_task(agg.run())
            log.info(
                "aggregator %r listening on %s (reachable as %s), relay %s", agg.name, url, agg.public_url, coordinator
            )

        await serve_app(create_app(agg), host, port, ready_file=ready_file, stop=stop, on_ready=ready)
