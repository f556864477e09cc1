"""HTTP face of the staged pipeline (:mod:`relay_server.pipeline`): stages, tasks, results, rounds.

Routes (paths from :data:`toolkit.wire.protocol.ROUTES`, bodies in :mod:`toolkit.wire.protocol.pipeline`):

* ``POST /api/pipeline/workers/{peer_id}/stage``       StageRequest -> StageAssignment
* ``GET  /api/pipeline/workers/{peer_id}/work?wait=&cached=``  a container: metadata ``work``
  (PipelineWork: tasks, or the round to upload to) and the tasks' inputs
* ``PUT  /api/pipeline/workers/{peer_id}/tasks/{task_id}``   a task's result (container), validated
  before anything downstream sees it -> PipelineAck
* ``POST /api/pipeline/workers/{peer_id}/rounds/{step}/ticket``  PipelineTicketRequest -> Ticket; the
  stage's slice then goes up through ``ROUTES["gradient"]`` with the ticket (:func:`put_stage_gradient`)
* ``POST /api/pipeline/workers/{peer_id}/rounds/{step}/done``    PipelineDone
* ``GET  /api/pipeline``                                PipelineStatus (the dashboard's panel)

Workers are registered peers (join, heartbeats); one that leaves the registry has its tasks
re-dispatched and its undelivered stage gradients recomputed (:meth:`PipelineCoordinator.worker_left`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from relay_server.api.context import COLLAB, CONFIG, collab as _collab, enabled, own_peer
from relay_server.auth.verify import BODY_STREAM_KEY
from relay_server.backbone.routes import get_slice, put_slice
from relay_server.backbone.slicing import Published
from relay_server.backbone.tickets import encode_ticket, verify_ticket
from relay_server.core.errors import ApiError
from relay_server.core.http import int_query, json_ok, path_int, read_message, upload_length
from relay_server.observers.events import StepEvent
from relay_server.pipeline.boundaries import Boundaries
from relay_server.pipeline.coordinator import PipelineCoordinator
from relay_server.pipeline.plan import Planner
from relay_server.pipeline.stage_owners import StageOwners
from relay_server.pipeline.status import pipeline_status
from relay_server.pipeline.workers import Workers
from relay_server.rounds.master import lr_at
from relay_server.rounds.store import RoundLog
from relay_server.tasks.broker import TaskBroker
from relay_server.tasks.store import PayloadStore
from toolkit.moe import payloads
from toolkit.wire.compression import get_codec
from toolkit.wire.protocol import (MAX_JSON_BODY, ROUTES, TICKET_HEADER, PipelineDone, PipelineTicketRequest,
                                   StageAssignment, StageRequest)
from toolkit.wire.tensor_container import MAX_HEADER

log = logging.getLogger(__name__)
PIPELINE = web.AppKey("pipeline", PipelineCoordinator)
TICK_S = 0.1
MAX_WAIT_S = 25
MAX_CACHED = 4096


def status_summary(app: web.Application) -> dict | None:
    """The Pipeline panel's data in ``/api/status`` (None: not a pipeline run)."""
    coordinator = app.get(PIPELINE)
    return pipeline_status(coordinator).to_json() if coordinator is not None else None


def _pipeline(request: web.Request) -> PipelineCoordinator:
    return enabled(request, PIPELINE, "no_pipeline", "this run is not a staged pipeline",
                   "The organizer enables it with [pipeline] enabled = true in the relay config.")


def _worker(request: web.Request) -> tuple[PipelineCoordinator, str]:
    """The pipeline and the path's peer id: this user's (checked before anything else), then
    alive (re-admitted after a relay restart) and touched."""
    peer_id = own_peer(request, request.match_info["peer_id"])
    coordinator = _pipeline(request)
    return coordinator, _collab(request).peer(peer_id).peer_id


async def post_stage(request: web.Request) -> web.Response:
    coordinator, peer_id = _worker(request)
    req = await read_message(request, StageRequest)
    worker = coordinator.assign(peer_id, req.memory_bytes, req.samples_per_s)
    start, end = coordinator.owners.cuts[worker.stage]
    config = request.app[CONFIG].pipeline
    return json_ok(StageAssignment(stage=worker.stage, num_stages=coordinator.K,
                                   layers_per_stage=list(coordinator.layers), start=start, end=end,
                                   microbatch_size=config.microbatch_size, boundary_codec=config.boundary_codec,
                                   width=coordinator.shapes.width,
                                   step=coordinator.owners.step))


async def get_work(request: web.Request) -> web.Response:
    coordinator, peer_id = _worker(request)
    wait = min(int_query(request, "wait", 10), MAX_WAIT_S)
    try:
        cached = {int(m) for m in request.query.get("cached", "").split(",") if m}
    except ValueError:
        raise ApiError(400, "bad_query", "cached must be comma-separated micro-batch ids") from None
    if len(cached) > MAX_CACHED:
        raise ApiError(400, "bad_query", f"at most {MAX_CACHED} cached micro-batches")
    peer = _collab(request).registry.get(peer_id)
    peer.inflight += 1  # a long-polling worker is alive
    try:
        work, tensors = await coordinator.work(peer_id, cached, wait)
    finally:
        peer.inflight -= 1
    body = payloads.encode(tensors, {"work": work.dumps().decode()})
    coordinator.bytes_out += len(body)
    return web.Response(body=body, content_type="application/octet-stream")


async def put_result(request: web.Request) -> web.Response:
    coordinator, peer_id = _worker(request)
    task_id = request.match_info["task_id"]
    length = upload_length(request, coordinator.shapes.body_limit(coordinator.codec) + MAX_HEADER + 8)
    stream = request.get(BODY_STREAM_KEY, request.content)
    try:
        body = await stream.readexactly(length)
    except asyncio.IncompleteReadError:
        raise ApiError(400, "truncated_body", "the result ended early") from None
    return json_ok(coordinator.result(peer_id, task_id, body))


async def post_ticket(request: web.Request) -> web.Response:
    coordinator, peer_id = _worker(request)
    req = await read_message(request, PipelineTicketRequest)
    return json_ok({"ticket": encode_ticket(coordinator.ticket(peer_id, path_int(request, "step"), req))})


async def post_done(request: web.Request) -> web.Response:
    coordinator, peer_id = _worker(request)
    done = await read_message(request, PipelineDone)
    coordinator.done(peer_id, done.round_id, done.contributor, done.delivered)
    return json_ok({"ok": True})


async def get_status(request: web.Request) -> web.Response:
    return json_ok(pipeline_status(_pipeline(request)))


async def put_stage_gradient(request: web.Request, coordinator: PipelineCoordinator, ticket_key: str,
                             require_digests: bool) -> web.Response:
    """A worker's stage slice, to that stage's parameter server (called by the relay's gradient
    route when the upload carries a ticket). Its contributor counts as uploading from before the
    first byte until the owner answered, so a worker that stops answering mid-upload is not
    recomputed while its upload might still commit."""
    ticket = verify_ticket(request.headers.get(TICKET_HEADER), ticket_key)
    stage = coordinator.owners.stage_of(ticket.slices[0].start, ticket.slices[0].end) if ticket.slices else None
    if stage is None or ticket.peer_id not in (coordinator.round.tickets if coordinator.round else {}):
        raise ApiError(409, "round_closed", "this ticket is not part of the pipeline's open round",
                       "Drop this gradient; take the next task.")
    coordinator.uploading.add(ticket.peer_id)
    try:
        receipt = await put_slice(request, coordinator.owners.owners[stage], ticket_key,
                                  require_digests=require_digests)
    finally:
        coordinator.uploading.discard(ticket.peer_id)
        coordinator.check_delivered()
    return json_ok(receipt)


async def get_stage_params(request: web.Request, coordinator: PipelineCoordinator) -> web.StreamResponse:
    """One stage's slice of a version (``start``/``end`` name the stage)."""
    start, end = int_query(request, "start"), int_query(request, "end")
    stage = coordinator.owners.stage_of(start, end)
    owner = coordinator.owners.owners[stage] if stage is not None else None
    return await get_slice(request, owner, lambda *a: None)


ROUTE_TABLE = [
    ("POST", ROUTES["pipeline_stage"], post_stage),
    ("GET", ROUTES["pipeline_work"], get_work),
    ("PUT", ROUTES["pipeline_result"], put_result),
    ("POST", ROUTES["pipeline_ticket"], post_ticket),
    ("POST", ROUTES["pipeline_done"], post_done),
    ("GET", ROUTES["pipeline"], get_status),
]
PUBLIC = frozenset({ROUTES["pipeline"]})


def container_limits(app: web.Application) -> dict:
    """Results are streamed containers (signed by chunk digests in signed runs): a boundary
    matrix of a real model is far larger than one signed JSON request. On a run without a
    pipeline the limit is one request's body: the handler then refuses whoever sends one."""
    def limit() -> int:
        coordinator = app.get(PIPELINE)
        return coordinator.shapes.body_limit(coordinator.codec) if coordinator is not None else MAX_JSON_BODY
    return {("PUT", ROUTES["pipeline_result"]): limit}


async def lifespan(app: web.Application) -> AsyncIterator[None]:
    """Build the stages, the pool and the first batch when ``[pipeline] enabled``; tick."""
    config = app[CONFIG]
    if not config.pipeline.enabled:
        yield
        return
    from relay_server.pipeline.model_cut import cut_model  # torch and the stage code: pipeline relays only

    collab = app[COLLAB]
    cfg = config.pipeline
    cut = await asyncio.to_thread(cut_model, config)
    resume = collab.store.latest_step() if collab.store.get_meta("manifest") else None
    owners = await asyncio.to_thread(StageOwners, config, collab.layout, collab.codecs, collab.master.flat.numpy(),
                                     cut.cuts, resume, collab.store)
    root = Path(config.server.data_dir)

    def publish(published: Published, loss_sum: float, samples: int, elapsed: float, grad_norm: float,
                contributions: dict[str, int]) -> None:
        record = RoundLog(contributions=contributions, loss=loss_sum / samples if samples else None,
                          duration_s=elapsed, deadline_s=0.0, finalized_by="pipeline",
                          lr=lr_at(published.step - 1, config.optimizer, config.run.total_steps), grad_norm=grad_norm,
                          samples=samples)
        collab.store.commit(published.step, published.sha256, record, {"manifest": published.manifest.dumps().decode()})
        collab.backbone.board.publish(published)
        if collab.leaderboard is not None:
            collab.leaderboard.credit(contributions)
        if collab.observers.observers:
            status = collab.status()
            collab.observers.publish(StepEvent(step=published.step, record=status.recent_rounds[-1], status=status,
                                               state_path=owners.whole_path))

    broker = TaskBroker(PayloadStore(1 << 20, None), max_queued_rows=1 << 30, initial_lease_s=cfg.initial_lease_s,
                        lease_floor_s=cfg.lease_floor_s, lease_factor=cfg.lease_factor,
                        clock=collab.loop_clock)  # leases count on the relay's clock: a stall expires none
    coordinator = PipelineCoordinator(
        num_stages=len(cut.cuts), microbatch_size=cfg.microbatch_size, microbatches_per_batch=cfg.microbatches_per_batch,
        owners=owners, broker=broker, boundaries=Boundaries(cfg.boundary_memory_mb << 20, root / "boundaries"),
        workers=Workers([e - s for s, e in cut.cuts], cut.stage_bytes(), sticky=cfg.dispatch == "static"),
        shapes=cut.shapes,
        codec=get_codec(cfg.boundary_codec), ticket_key=collab.backbone.ticket_key, publish=publish,
        dispatch=cfg.dispatch, planner=Planner(cut.model, cut.plan_config, list(cut.layers)),
        rebalance_every=cfg.rebalance_every_batches, clock=collab.loop_clock)
    coordinator.layers = cut.layers
    collab.backbone.board.publish(owners.published())
    app[PIPELINE] = coordinator
    log.info("pipeline: %d stages of %s layers, %d micro-batches of %d per batch; waiting for workers",
             len(cut.cuts), cut.layers, cfg.microbatches_per_batch, cfg.microbatch_size)
    ticker = asyncio.create_task(_tick(app, coordinator))
    try:
        yield
    finally:
        ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticker
        owners.close()


async def _tick(app: web.Application, coordinator: PipelineCoordinator) -> None:
    while True:
        await asyncio.sleep(TICK_S)
        try:
            app[COLLAB].loop_clock.beat()  # a stall just ended is excused before silence is judged below
            live = app[COLLAB].registry.peers
            for worker in [w for w in coordinator.workers.by_id if w not in live]:
                log.info("pipeline worker %s left: its tasks go back to the pool", worker[:16])
                coordinator.worker_left(worker)
            now = time.monotonic()
            registry = app[COLLAB].registry
            coordinator.orphan_silent({w: now - peer.last_seen for w in coordinator.workers.by_id
                                       if (peer := registry.get(w)) is not None and peer.inflight == 0})
            coordinator.broker.tick()
            coordinator.note_lapses()
            coordinator.expire_holds()
            coordinator.restart_lost()
            coordinator.staff_empty_stages()
            coordinator.check_delivered()  # an owner's commit no worker reported (it died right after)
            coordinator.retry_finalize()
        except Exception:  # the ticker must outlive any one bad tick
            log.exception("pipeline tick failed")
