"""HTTP face of Learning@home on the relay: expert calls in, tasks out, results back.

Routes (paths from :data:`toolkit.wire.protocol.ROUTES`; bodies in :mod:`toolkit.wire.payloads`):

* ``GET  /api/moe/spec``                              the run's ``[moe]`` as trainers and hosts need it
* ``GET  /api/moe/directory``                         {version, live: [uid], total}
* ``PUT  /api/moe/peers/{peer_id}/calls/{uid}?kind=&call_id=``   a trainer's call; answered (long
  poll) with the expert's result, or 410 ``expert_gone`` / 429 ``queue_busy`` / 504 ``task_timeout``
  / 502 ``bad_result``: each a failed expert for the trainer, never garbage (the deadline counts on
  the relay's clock: a stall of its event loop never fails a call, :mod:`relay_server.core.loop_clock`)
* ``POST /api/moe/hosts/{peer_id}/lease?capacity=``   the experts this host serves now (body, optional:
  a :class:`~toolkit.wire.protocol.LeaseRequest` naming the copies it holds, taken back first)
* ``GET  /api/moe/hosts/{peer_id}/tasks?max_rows=&wait=``        a batch of tasks (204: none yet)
* ``PUT  /api/moe/hosts/{peer_id}/tasks/{task_id}``   a task's result, validated before the caller
  sees it (a bad one fails the call and is refused 422)
* ``PUT|GET /api/moe/hosts/{peer_id}/experts/{uid}/checkpoint``  the leaseholder's checkpoints

Hosts and trainers are registered peers (join, heartbeats): a host that leaves the registry loses
its experts' leases at the next tick, its queued and leased calls fail at once with
``expert_gone``, and the next host that asks takes the orphans with their last checkpoint.

:data:`FEATURE` plugs DMoE into the relay: these routes, the state (:class:`~relay_server.moe.state.Experts`,
built from ``[moe]`` outside HTTP and ticked by the app's lifespan) and the Experts panel's data.
"""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

from aiohttp import web

from relay_server.api.context import collab as _collab
from relay_server.api.context import enabled, own_peer
from relay_server.api.feature import Feature, PeerPlaces
from relay_server.auth.verify import BODY_STREAM_KEY
from relay_server.collaboration.machine import Collaboration
from relay_server.core.config import RelayConfig
from relay_server.core.errors import ApiError
from relay_server.core.http import int_query, json_ok, read_message, upload_length
from relay_server.moe.state import Experts
from relay_server.tasks.broker import DONE
from relay_server.trust.expert_checks import build_trust, moderation, read_version
from toolkit.errors import ProtocolError
from toolkit.wire import payloads
from toolkit.wire.protocol import ROUTES, CheckpointReceipt, ExpertLease, LeaseRequest, ResultAck, TaskHead
from toolkit.wire.tensor_container import MAX_HEADER

log = logging.getLogger(__name__)
MAX_TASK_WAIT_S = 25
_CALL_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


EXPERTS = web.AppKey("experts", Experts)


def _experts(request: web.Request) -> Experts:
    return enabled(
        request,
        EXPERTS,
        "no_moe",
        "this run has no mixture-of-experts layers",
        "The organizer enables them with [moe] enabled = true in the relay config.",
    )


def _registered(request: web.Request) -> tuple[Experts, str]:
    """The DMoE state and the path's peer id: this user's (signed runs, checked before anything
    else), then alive: re-admitted as the round routes do when the relay knew it (a host back
    from a blip longer than the peer TTL, or from before a relay restart) and touched. A peer
    the relay never knew is 404 ``unknown_peer`` (join again)."""
    peer_id = own_peer(request, request.match_info["peer_id"])
    experts = _experts(request)
    if experts.review is not None:
        experts.review.admit(peer_id)  # a host caught lying (relay_server.trust.expert_checks)
    return experts, _collab(request).peer(peer_id).peer_id


def _uid(experts: Experts, uid: str) -> str:
    if uid not in experts.known:
        raise ApiError(
            404, "unknown_expert", f"no expert {uid[:40]!r} in this run", "Take uids from GET /api/moe/directory."
        )
    return uid


def _leased(experts: Experts, request: web.Request, host: str) -> str:
    """The path's expert uid, if ``host`` holds its lease: only the leaseholder reads or writes
    an expert's checkpoints."""
    uid = _uid(experts, request.match_info["uid"])
    if experts.directory.host_of(uid) != host:
        raise ApiError(
            403,
            "not_your_expert",
            f"expert {uid} is not leased to this host",
            "Use the experts your lease returned (POST .../lease).",
        )
    return uid


async def get_spec(request: web.Request) -> web.Response:
    return json_ok(_experts(request).config.spec())


async def get_directory(request: web.Request) -> web.Response:
    return json_ok(_experts(request).directory.snapshot())


async def put_call(request: web.Request) -> web.Response:
    experts, caller = _registered(request)  # who may act on what, before anything else
    uid = _uid(experts, request.match_info["uid"])
    kind, call_id = request.query.get("kind", ""), request.query.get("call_id", "")
    if kind not in payloads.KINDS or not _CALL_ID.fullmatch(call_id):
        raise ApiError(400, "bad_query", "kind must be forward or backward, call_id 1-64 of [A-Za-z0-9_-]")
    cfg, width = experts.config, experts.config.width()
    body = await request.read()  # bounded by the app's client_max_size
    codec = experts.codec
    names = payloads.row_names("x", codec) | (payloads.row_names("g", codec) if kind == "backward" else set())
    try:
        _, tensors = payloads.decode(body, 2 * cfg.max_rows_per_call * width * 4)
        if set(tensors) != names:
            raise ProtocolError("bad_tensor", f"a {kind} call carries exactly {sorted(names)}")
        x = payloads.read_rows(tensors, "x", None, width, codec)
        g = payloads.read_rows(tensors, "g", x.shape[0], width, codec) if kind == "backward" else None
    except ProtocolError as exc:
        raise ApiError(
            400,
            exc.code,
            exc.message,
            f"Send [rows, d] tensors x (and g for a backward) in the run's "
            f"activation codec ({codec.name}); the toolkit does.",
        ) from None
    if x.shape[0] > cfg.max_rows_per_call:
        raise ApiError(400, "bad_tensor", f"a call carries at most {cfg.max_rows_per_call} rows")
    if experts.directory.host_of(uid) is None:
        experts.note_call(failed=True)
        raise ApiError(410, "expert_gone", f"expert {uid} has no host right now", "Treat it as a failed expert.")
    timeout = cfg.forward_timeout_s if kind == "forward" else cfg.backward_timeout_s
    task = experts.broker.submit(
        caller=caller, call_id=call_id, key=uid, kind=kind, rows=int(x.shape[0]), payload=body, timeout_s=timeout
    )
    await experts.broker.wait(task)
    experts.note_call(failed=task.state != DONE)
    if task.state != DONE:
        error = task.error
        if error is not None and error.code == "worker_gone":
            error = ApiError(410, "expert_gone", f"the host of {uid} left during the call", error.hint)
        raise error or ApiError(500, "task_failed", f"the call to {uid} failed")
    answer = experts.broker.result(task)
    experts.broker.forget(task)
    if experts.review is not None and task.worker is not None:  # spot checks: the truth, or 502, never a lie
        answer = (
            await experts.review.review(task.task_id, uid, kind, task.worker, x, g, answer, task.leased_at) or answer
        )
    return web.Response(body=answer, content_type="application/octet-stream")


async def post_lease(request: web.Request) -> web.Response:
    experts, host = _registered(request)  # who may act on what, before anything else
    capacity = int_query(request, "capacity")
    if not 0 <= capacity <= 4096:
        raise ApiError(400, "bad_query", "capacity must be 0..4096")
    held = (await read_message(request, LeaseRequest)).held if request.can_read_body else []
    before = set(experts.directory.hosted_by(host))
    uids = experts.directory.lease(host, capacity, prefer=held)
    return json_ok(ExpertLease(uids=uids, spec=experts.config.spec(), granted=[u for u in uids if u not in before]))


async def get_tasks(request: web.Request) -> web.Response:
    """Every queued call of the host's experts, oldest first, up to ``max_rows`` rows (at least
    one call): the host runs the calls of one expert and kind as one batch. The bodies go out as
    they came in (validated when the call was taken): nothing is decoded here."""
    experts, host = _registered(request)  # who may act on what, before anything else
    max_rows = int_query(request, "max_rows", experts.config.max_rows_per_call)
    wait = min(int_query(request, "wait", 10), MAX_TASK_WAIT_S)
    keys = experts.directory.hosted_by(host)
    if not keys:
        raise ApiError(
            409,
            "no_lease",
            "this host holds no experts (its leases ended, or the relay restarted)",
            "Lease experts again: POST .../lease (the toolkit's host does this by itself).",
        )
    tasks = await experts.broker.lease(host, keys, max_rows=max(1, max_rows), wait_s=wait)
    if not tasks:
        return web.Response(status=204)
    # a call's kind was checked to be forward or backward when the trainer posted it (put_call)
    heads = [TaskHead(task_id=t.task_id, uid=t.key, kind=t.kind, rows=t.rows) for t in tasks]  # type: ignore[arg-type]
    body = payloads.task_batch(heads, [experts.broker.payload(t) for t in tasks])
    return web.Response(body=body, content_type="application/octet-stream")


async def put_result(request: web.Request) -> web.Response:
    experts, host = _registered(request)  # who may act on what, before anything else
    task = experts.broker.leased(host, request.match_info["task_id"])  # 409/410 before any byte is read
    body = await request.read()
    name = "y" if task.kind == "forward" else "g"
    try:
        metadata, tensors = payloads.decode(body, task.rows * experts.config.width() * 4 + 4096)
        if experts.review is not None:
            read_version(metadata)
        if set(tensors) != payloads.row_names(name, experts.codec):
            raise ProtocolError(
                "bad_tensor", f"a {task.kind} result carries exactly {sorted(payloads.row_names(name, experts.codec))}"
            )
        payloads.read_rows(tensors, name, task.rows, experts.config.width(), experts.codec)
    except ProtocolError as exc:
        log.warning("host %s sent an invalid result for %s: %s", host[:16], task.key, exc.message)
        experts.broker.fail(
            host,
            task.task_id,
            ApiError(
                502, "bad_result", f"the host of {task.key} sent an invalid result", "Treat it as a failed expert."
            ),
        )
        raise ApiError(
            422, exc.code, exc.message, "The result was refused and the call failed; fix the host."
        ) from None
    experts.broker.complete(host, task.task_id, body)
    return json_ok(ResultAck(ok=True))


async def put_checkpoint(request: web.Request) -> web.Response:
    experts, host = _registered(request)  # who may act on what, before anything else
    uid = _leased(experts, request, host)
    length = upload_length(request, experts.checkpoint_bytes + MAX_HEADER + 8)
    stream = request.get(BODY_STREAM_KEY, request.content)  # signed runs: every chunk checked against its digest
    try:
        body = await stream.readexactly(length)
    except asyncio.IncompleteReadError:
        raise ApiError(400, "truncated_body", "the checkpoint ended early") from None
    try:
        updates, tensors = payloads.read_checkpoint(body, experts.shapes)
    except ProtocolError as exc:
        raise ApiError(422, exc.code, exc.message, "The checkpoint was refused; the previous one stays.") from None
    number = await asyncio.to_thread(experts.checkpoints.save, uid, body)
    if experts.review is not None:
        experts.review.checkpointed(uid, updates, tensors, host)
    return json_ok(CheckpointReceipt(uid=uid, checkpoint=number, updates=updates))


async def get_checkpoint(request: web.Request) -> web.Response:
    experts, host = _registered(request)  # who may act on what, before anything else
    uid = _leased(experts, request, host)
    body = await asyncio.to_thread(experts.checkpoints.latest, uid)
    if body is None:
        raise ApiError(
            404,
            "no_checkpoint",
            f"expert {uid} has no checkpoint yet",
            "Initialize it from the run's seed (the toolkit does this).",
        )
    return web.Response(body=body, content_type="application/octet-stream")


BINARY_ROUTES = frozenset({("PUT", ROUTES["moe_call"]), ("PUT", ROUTES["moe_result"])})
"""Routes whose body is a small tensor container, signed whole (the auth middleware's list)."""


def _checkpoint_limit(experts: Experts | None) -> int:
    """Checkpoints are streamed containers (signed by chunk digests, like gradients), at most
    one expert's parameters plus three optimizer states each: an expert may be far larger than
    one signed request."""
    return experts.checkpoint_bytes if experts is not None else 0


ROUTE_TABLE = [
    ("GET", ROUTES["moe_spec"], get_spec),
    ("GET", ROUTES["moe_directory"], get_directory),
    ("PUT", ROUTES["moe_call"], put_call),
    ("POST", ROUTES["moe_lease"], post_lease),
    ("GET", ROUTES["moe_tasks"], get_tasks),
    ("PUT", ROUTES["moe_result"], put_result),
    ("PUT", ROUTES["moe_checkpoint"], put_checkpoint),
    ("GET", ROUTES["moe_checkpoint"], get_checkpoint),
]


async def build(config: RelayConfig, collab: Collaboration) -> Experts:
    """The DMoE state of ``[moe]``; its ticker expires departed hosts once started."""
    cfg = config.moe
    experts = Experts.create(
        cfg, Path(config.server.data_dir), clock=collab.loop_clock, live_peers=lambda: collab.registry.peers
    )
    log.info(
        "mixture-of-experts: %d layers x %s grid = %d experts, k=%d; waiting for hosts",
        cfg.layers,
        "x".join(map(str, cfg.grid)),
        len(experts.directory.uids),
        cfg.k,
    )
    if cfg.check_share > 0:
        experts.review = build_trust(experts, moderation(config, collab))
    return experts


def _places(experts: Experts) -> PeerPlaces:
    return PeerPlaces(experts_hosted=experts.directory.hosts())


FEATURE = Feature(
    name="moe",
    section="moe",
    enabled=lambda config: config.moe.enabled,
    key=EXPERTS,
    build=build,
    routes=tuple(ROUTE_TABLE),
    binary_routes=BINARY_ROUTES,
    container_limits={("PUT", ROUTES["moe_checkpoint"]): _checkpoint_limit},
    status=lambda experts: {"experts": experts.summary()},
    places=_places,
)
