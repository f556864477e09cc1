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
* ``GET  /api/pipeline/workers/{peer_id}/credit``      WorkerCredit: the tasks and samples the relay
  credited this worker (what a volunteer's ``join()`` result reports; answered after it left too)
* ``GET  /api/pipeline``                                PipelineStatus (the dashboard's panel)

Every body these routes (and the takeovers of the core gradient and params routes) move is
counted, by kind (:class:`~relay_server.pipeline.figures.PipelineBytes`), and in the
collaboration's traffic (``StatusReport.traffic``): boundaries both ways, stage gradients up,
stage parameters down.

Workers are registered peers (join, heartbeats); one that leaves the registry has its tasks
re-dispatched and its undelivered stage gradients recomputed (:meth:`PipelineCoordinator.worker_left`).

:data:`FEATURE` plugs it into the relay: the service (:class:`~relay_server.pipeline.service.PipelineService`,
built and ticked outside HTTP), these routes, and its takeover of the core gradient and params routes
for ticketed stage slices.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from aiohttp import web

from relay_server.api.context import CONFIG, enabled, own_peer
from relay_server.api.context import collab as _collab
from relay_server.api.feature import SLICE_PARAMS, TICKETED_GRADIENT, Feature, PeerPlaces
from relay_server.auth.verify import BODY_STREAM_KEY
from relay_server.backbone.slice_routes import get_slice, put_slice
from relay_server.backbone.tickets import encode_ticket, verify_ticket
from relay_server.collaboration.opening import RoundsElsewhere
from relay_server.core.errors import ApiError
from relay_server.core.http import int_query, json_ok, path_int, read_message, upload_length
from relay_server.pipeline.coordinator import PipelineCoordinator
from relay_server.pipeline.service import PipelineService
from relay_server.pipeline.status import pipeline_status, run_figures
from relay_server.trust.gradient_audit import GradientLie
from toolkit.wire import payloads
from toolkit.wire.protocol import (
    MAX_JSON_BODY,
    ROUTES,
    TICKET_HEADER,
    PipelineDone,
    PipelineTicketRequest,
    StageAssignment,
    StageRequest,
)
from toolkit.wire.tensor_container import MAX_HEADER

if TYPE_CHECKING:
    from relay_server.rounds.peer_registry import Peer
    from relay_server.rounds.publisher import Version

log = logging.getLogger(__name__)
PIPELINE = web.AppKey("pipeline", PipelineService)
MAX_WAIT_S = 25
MAX_CACHED = 4096


def _pipeline(request: web.Request) -> PipelineCoordinator:
    return enabled(
        request,
        PIPELINE,
        "no_pipeline",
        "this run is not a staged pipeline",
        "The organizer enables it with [pipeline] enabled = true in the relay config.",
    ).coordinator


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
    return json_ok(
        StageAssignment(
            stage=worker.stage,
            num_stages=coordinator.K,
            layers_per_stage=list(coordinator.layers),
            start=start,
            end=end,
            microbatch_size=config.microbatch_size,
            boundary_codec=config.boundary_codec,
            width=coordinator.shapes.width,
            step=coordinator.owners.step,
        )
    )


async def get_work(request: web.Request) -> web.Response:
    coordinator, peer_id = _worker(request)
    wait = min(int_query(request, "wait", 10), MAX_WAIT_S)
    try:
        cached = {int(m) for m in request.query.get("cached", "").split(",") if m}
    except ValueError:
        raise ApiError(400, "bad_query", "cached must be comma-separated micro-batch ids") from None
    if len(cached) > MAX_CACHED:
        raise ApiError(400, "bad_query", f"at most {MAX_CACHED} cached micro-batches")
    peer: Peer = _collab(request).registry.get(peer_id)  # type: ignore[assignment]  # _worker re-admitted it
    peer.inflight += 1  # a long-polling worker is alive
    try:
        work, tensors = await coordinator.work(peer_id, cached, wait)
    finally:
        peer.inflight -= 1
    body = payloads.encode(tensors, {"work": work.dumps().decode()})
    coordinator.bytes_out += len(body)
    coordinator.figures.bytes.boundaries_down += len(body)
    _collab(request).traffic.down_bytes += len(body)
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
    ack = coordinator.result(peer_id, task_id, body)
    if ack.accepted:  # a refused duplicate is wasted work (PipelineStatus.refused_results), not traffic
        coordinator.figures.bytes.boundaries_up += length
        _collab(request).traffic.up_bytes += length
    return json_ok(ack)


async def get_credit(request: web.Request) -> web.Response:
    """This worker's credit: the relay's count, which its ``join()`` result reports. Not a
    request that re-admits the worker: it is asked once the worker left."""
    peer_id = own_peer(request, request.match_info["peer_id"])
    coordinator = _pipeline(request)
    stage = coordinator.workers.stage_of(peer_id) if peer_id in coordinator.workers.by_id else None
    return json_ok(coordinator.figures.credit(peer_id, stage))


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
    """The Pipeline panel's figures, and the memory the relay and each stage's worker are
    predicted to need (``memory``: every term, :mod:`relay_server.pipeline.run_memory`)."""
    body = pipeline_status(_pipeline(request)).to_json()
    body["memory"] = request.app[PIPELINE].memory.to_json()  # type: ignore[union-attr]  # set before routes serve
    return json_ok(body)


async def put_stage_gradient(
    request: web.Request, coordinator: PipelineCoordinator, ticket_key: str, require_digests: bool
) -> web.Response:
    """A worker's stage slice, to that stage's parameter server (called by the relay's gradient
    route when the upload carries a ticket). Its contributor counts as uploading from before the
    first byte until the owner answered, so a worker that stops answering mid-upload is not
    recomputed while its upload might still commit."""
    ticket = verify_ticket(request.headers.get(TICKET_HEADER), ticket_key)
    stage = coordinator.owners.stage_of(ticket.slices[0].start, ticket.slices[0].end) if ticket.slices else None
    if stage is None or ticket.peer_id not in (coordinator.round.tickets if coordinator.round else {}):
        raise ApiError(
            409,
            "round_closed",
            "this ticket is not part of the pipeline's open round",
            "Drop this gradient; take the next task.",
        )
    owner = coordinator.owners.owners[stage]
    worker = coordinator.round.tickets[ticket.peer_id][0]  # type: ignore[union-attr]  # checked open above
    deadline = coordinator.guard.upload_deadline(stage)
    verify = coordinator.hooks.verifier(ticket.peer_id, asyncio.get_running_loop().time() + deadline)
    lie: GradientLie | None = None
    coordinator.uploading.add(ticket.peer_id)
    try:
        async with asyncio.timeout(deadline):
            receipt = await put_slice(request, owner, ticket_key, require_digests=require_digests, verify=verify)
    except GradientLie as exc:  # refused before its commit point: nothing of it counted
        lie = exc
    except TimeoutError:
        late = owner.receipt(ticket)  # cut while its commit ran: it counted
        if late is None:
            coordinator.uploading.discard(ticket.peer_id)
            coordinator.guard.upload_cut(worker, stage, deadline)
            response = web.json_response(
                {
                    "error": "upload_too_slow",
                    "message": f"stage {stage}'s gradient took more than {deadline:.1f} s "
                    "to upload (the stage's measured hold deadline): cut, its micro-batches are recomputed",
                    "hint": "Nothing to do: take the next task. A worker whose uplink is this slow serves the run "
                    "better on a smaller stage.",
                },
                status=408,
            )
            response.force_close()  # the rest of the body is not read
            return response
        receipt = late
    finally:
        coordinator.uploading.discard(ticket.peer_id)
        if lie is not None:  # no longer uploading: its stage gradients are recomputed by others
            coordinator.hooks.gradient_lie(lie.worker, lie.reason)
        coordinator.check_delivered()
    if lie is not None:
        raise lie
    coordinator.figures.bytes.stage_gradients_up += request.content_length or 0  # committed
    _collab(request).traffic.up_bytes += request.content_length or 0
    return json_ok(receipt)


async def get_stage_params(request: web.Request, coordinator: PipelineCoordinator) -> web.StreamResponse:
    """One stage's slice of a version (``start``/``end`` name the stage): the latest, or with
    ``step`` exactly that version while a batch in flight computes on it (delayed parameter
    updates: the one before the latest), its hash in the signed ``X-Collab-Sha256``."""
    start, end = int_query(request, "start"), int_query(request, "end")
    stage = coordinator.owners.stage_of(start, end)
    owner = coordinator.owners.owners[stage] if stage is not None else None
    tie = coordinator.owners.tie
    if owner is None and tie is not None and tie.split and (start, end) == (tie.start, tie.end):
        response = await _tied_copy(request, coordinator, int_query(request, "step"))
    elif "step" in request.query and owner is not None:
        response = await _stage_version(
            request,
            coordinator,
            stage,  # type: ignore[arg-type]  # a stage when owner is set
            int_query(request, "step"),
        )
    else:
        response = await get_slice(request, owner, lambda *a: None)
    coordinator.figures.bytes.stage_params_down += response.content_length or 0
    _collab(request).traffic.down_bytes += response.content_length or 0
    return response


async def _tied_copy(request: web.Request, coordinator: PipelineCoordinator, step: int) -> web.StreamResponse:
    """The last stage's copy of a tied embedding: stage 0's range of it, of exactly version
    ``step`` (the one the worker's task computes on: :mod:`.tied`)."""
    first = _in_use(coordinator, 0, step)
    copy = await coordinator.owners.tie.copy_of(first, coordinator.owners.cuts[0][0])  # type: ignore[union-attr]  # tied runs only
    return await coordinator.owners.owners[0].publisher.send(request, copy, None)


def _in_use(coordinator: PipelineCoordinator, stage: int, step: int) -> Version:
    """Stage ``stage``'s version ``step`` while a batch in flight computes on it."""
    version = coordinator.owners.version(stage, step)
    if version is None or step not in coordinator.flight.versions():
        raise ApiError(
            410,
            "version_gone",
            f"version {step} of stage {stage} is not in use by any batch in flight (the relay is at "
            f"{coordinator.owners.step})",
            "Drop the task that asked for it (its batch is over) and take the next one.",
        )
    return version


async def _stage_version(
    request: web.Request, coordinator: PipelineCoordinator, stage: int, step: int
) -> web.StreamResponse:
    return await coordinator.owners.owners[stage].publisher.send(request, _in_use(coordinator, stage, step), None)


ROUTE_TABLE = [
    ("POST", ROUTES["pipeline_stage"], post_stage),
    ("GET", ROUTES["pipeline_work"], get_work),
    ("PUT", ROUTES["pipeline_result"], put_result),
    ("POST", ROUTES["pipeline_ticket"], post_ticket),
    ("POST", ROUTES["pipeline_done"], post_done),
    ("GET", ROUTES["pipeline_credit"], get_credit),
    ("GET", ROUTES["pipeline"], get_status),
]
PUBLIC = frozenset({ROUTES["pipeline"]})


def _result_limit(service: PipelineService | None) -> int:
    """Results are streamed containers (signed by chunk digests in signed runs): a boundary
    matrix of a real model is far larger than one signed JSON request. On a run without a
    pipeline the limit is one request's body: the handler then refuses whoever sends one."""
    coordinator = service.coordinator if service is not None else None
    return coordinator.shapes.body_limit(coordinator.codec) if coordinator is not None else MAX_JSON_BODY


async def _ticketed_gradient(request: web.Request, service: PipelineService) -> web.Response:
    """The relay's gradient route, for an upload with a ticket: a stage's slice."""
    collab = _collab(request)
    return await put_stage_gradient(
        request, service.coordinator, collab.backbone.ticket_key, require_digests=collab.config.auth.mode != "open"
    )


async def _slice_params(request: web.Request, service: PipelineService) -> web.StreamResponse:
    """The relay's params route, for ``start``/``end``: one stage's slice."""
    return await get_stage_params(request, service.coordinator)


def _places(service: PipelineService) -> PeerPlaces:
    coordinator = service.coordinator
    return PeerPlaces(stage_of={w: k for k in range(coordinator.K) for w in coordinator.workers.on_stage(k)})


FEATURE = Feature(
    name="pipeline",
    section="pipeline",
    enabled=lambda config: config.pipeline.enabled,
    key=PIPELINE,
    build=PipelineService.build,
    routes=tuple(ROUTE_TABLE),
    public=PUBLIC,
    container_limits={("PUT", ROUTES["pipeline_result"]): _result_limit},
    takeovers={TICKETED_GRADIENT: _ticketed_gradient, SLICE_PARAMS: _slice_params},
    status=lambda service: {"pipeline": pipeline_status(service.coordinator).to_json()},
    places=_places,
    figures=run_figures,
    opening=lambda config: RoundsElsewhere(),
    keeps_parameters=True,
    run_info=lambda config: {
        "pipeline": {
            "stages": config.pipeline.stages,
            "microbatch_size": config.pipeline.microbatch_size,
            "boundary_codec": config.pipeline.boundary_codec,
        }
    },
)  # a round opens when the batch is complete (the coordinator's)
