"""The two routes every slice owner serves to peers, on the relay and on each aggregator alike:
a ticketed gradient-slice upload and its slice's parameters. Same validation and errors
everywhere (:mod:`relay_server.core.http`)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import numpy as np
from aiohttp import web

from relay_server.auth.verify import BODY_STREAM_KEY, VerifiedBodyStream, container_digests, read_container_head
from relay_server.backbone.slice_owner import HeadedStream, SliceOwner
from relay_server.backbone.tickets import verify_ticket
from relay_server.core.errors import ApiError
from relay_server.core.http import drain, int_query, path_int, upload_length
from relay_server.planning.measure import delivered
from toolkit.errors import ProtocolError
from toolkit.wire.protocol import TICKET_HEADER, UploadReceipt
from toolkit.wire.tensor_container import AsyncContainerReader

MAX_LONG_POLL_S = 60.0


def _moved(owner: SliceOwner | None) -> ApiError:
    where = f"[{owner.start}, {owner.end})" if owner is not None else "no slice"
    return ApiError(
        409,
        "wrong_slice",
        f"this server owns {where} now",
        "Fetch the latest parameters' manifest again (GET /api/params on the relay); slices moved.",
    )


async def put_slice(
    request: web.Request,
    owner: SliceOwner | None,
    ticket_key: str,
    *,
    require_digests: bool,
    verify: Callable[[np.ndarray], Awaitable[None]] | None = None,
) -> UploadReceipt:
    """Reduce one peer's gradient slice into ``owner``'s round. The ticket is checked before
    any body byte is read; ``require_digests`` (signed runs) makes the container list a digest
    per data chunk, each checked before the chunk is used."""
    step = path_int(request, "step")
    try:
        ticket = verify_ticket(request.headers.get(TICKET_HEADER), ticket_key)
        if ticket.step != step:
            raise ApiError(400, "bad_ticket", f"the ticket is for round {ticket.step}, the path says {step}")
        if owner is None:
            raise _moved(owner)
        limit = owner.codecs.up.wire_bytes(owner.upload_numel)
        total = upload_length(request, limit)
        body = request.get(BODY_STREAM_KEY)
        stream: HeadedStream | VerifiedBodyStream
        if body is not None:  # the relay's auth middleware already verified the head; it replays it
            head = await read_container_head(body)
            stream = HeadedStream(head, body)
        else:
            head = await read_container_head(request.content)
            stream = (
                VerifiedBodyStream(request.content, head, container_digests(head, limit))
                if require_digests
                else HeadedStream(head, request.content)
            )
        return await owner.receive(ticket, head, AsyncContainerReader(stream, limit, total_bytes=total), verify)
    except (ApiError, ProtocolError):
        await drain(request)
        raise


async def get_slice(
    request: web.Request, owner: SliceOwner | None, on_transfer: Callable[[str, str, int, int, float], None]
) -> web.StreamResponse:
    """``owner``'s version >= ``min_step`` of its slice (``start``/``end`` must name it), whole or
    as a delta against ``have``; long-polls up to ``wait`` seconds, 204 if nothing came."""
    start, end = int_query(request, "start"), int_query(request, "end")
    if owner is None or (start, end) != (owner.start, owner.end):
        raise _moved(owner)
    min_step, have = int_query(request, "min_step", 0), int_query(request, "have", -1)
    wait = min(MAX_LONG_POLL_S, max(0.0, float(int_query(request, "wait", 0))))
    version = await owner.publisher.wait(min_step, wait)
    if version is None:
        return web.Response(status=204, headers={"X-Collab-Step": str(owner.step)})
    started = time.monotonic()
    response = await owner.publisher.send(request, version, have if have >= 0 else None)
    on_transfer(request.query.get("peer_id", "")[:64], "down", version.step, sent_bytes(request, response), started)
    return response


def sent_bytes(request: web.Request, response: web.StreamResponse) -> int:
    """The bytes of ``response`` its receiver acknowledged by now (see :func:`measure.delivered`)."""
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    return delivered(sock, response.content_length or 0)
