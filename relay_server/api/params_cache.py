"""Parameter bodies at immutable URLs, for an HTTP cache in front of the relay (``[server]
public_params_url``); and the relay's count of the parameter bytes it sent itself.

Why ``/api/params/v/{step}/{sha256}/{kind}``: the sha256 (of the float32 parameters a peer holds
afterwards, the hash the relay already signs) makes the URL name its content, so a cache may keep
it forever (``Cache-Control: public, immutable``; ``ETag`` = that sha256); the step is in it
because the body's container header names the step (two steps with equal parameters are two
bodies) and it finds the state file without an index; ``kind`` tells the full body from the int8
delta against the version before. A URL exists only once the relay has handed it out in a
:class:`~toolkit.wire.protocol.ParamsRef` (the last :data:`REMEMBERED` of them): nobody can walk
the run's versions by counting steps, and an unknown or pruned one is a 404 no cache keeps.

The route is public, even on ``auth = "hf"`` runs: a shared cache cannot sign as each peer, and
need not -- the peer checks the bytes against the hash in the relay's signed ref. Whoever learns
a URL can read that version's parameters: the README says how an organizer restricts that.
"""

from __future__ import annotations

import asyncio
import re
from collections import OrderedDict
from dataclasses import dataclass, field

from aiohttp import web

from relay_server.api.context import COLLAB, CONFIG
from relay_server.core.errors import ApiError
from relay_server.core.http import json_ok
from relay_server.rounds.publisher import Version, _full_header
from toolkit.wire.protocol import (BLOB_CACHE_CONTROL, FRESH_CACHE_CONTROL, PARAMS_REF_TYPE, ROUTES, ParamsRef)

REMEMBERED = 16
"""Versions whose immutable URLs the relay answers (the newest handed out); older ones are 404."""

_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


@dataclass
class Egress:
    """Parameter bytes the relay wrote itself (bodies only, not HTTP headers), by route: what a
    cache in front saves is visible here (``GET /api/params/egress``)."""

    direct: int = 0
    """Bodies answered on ``GET /api/params`` (full or delta, to a peer that got no ref)."""
    immutable: int = 0
    """Bodies answered on the immutable URLs (to a cache filling itself, or anyone with a URL)."""
    immutable_requests: int = 0
    refs: int = 0
    ref_bytes: int = 0
    """The refs' JSON bodies (what each peer still gets from the relay per version)."""
    by_url: dict[str, int] = field(default_factory=dict)
    """Immutable bytes per URL path, for the versions still remembered."""

    def report(self) -> dict:
        return {"direct": self.direct, "immutable": self.immutable, "immutable_requests": self.immutable_requests,
                "refs": self.refs, "ref_bytes": self.ref_bytes, "by_url": dict(self.by_url)}


@dataclass
class Blobs:
    """The versions handed out as refs, newest last, and the bytes served."""

    versions: OrderedDict = field(default_factory=OrderedDict)
    egress: Egress = field(default_factory=Egress)

    def remember(self, version: Version) -> None:
        key = (version.step, version.sha256)
        self.versions[key] = version
        self.versions.move_to_end(key)
        while len(self.versions) > REMEMBERED:
            (step, sha), _ = self.versions.popitem(last=False)
            for kind in ("full", "delta"):
                self.egress.by_url.pop(blob_path(step, sha, kind), None)


BLOBS = web.AppKey("params_blobs", Blobs)


def blob_path(step: int, sha256: str, kind: str) -> str:
    return ROUTES["params_blob"].format(step=step, sha256=sha256, kind=kind)


def ref_response(request: web.Request, version: Version, have: int | None) -> web.Response:
    """The signed, uncached answer naming where version's body is at the run's cache: the delta
    when the peer holds the version before (and one was written), else the full body."""
    blobs = request.app[BLOBS]
    blobs.remember(version)
    blobs.egress.refs += 1
    delta = version.delta_path is not None and have == version.step - 1
    kind = "delta" if delta else "full"
    base = request.app[CONFIG].server.public_params_url.rstrip("/")
    ref = ParamsRef(step=version.step, sha256=version.sha256, kind=kind, base=have if delta else -1,
                    url=base + blob_path(version.step, version.sha256, kind))
    body = ref.dumps()
    blobs.egress.ref_bytes += len(body)
    return web.Response(body=body, content_type=PARAMS_REF_TYPE,
                        headers={"Cache-Control": FRESH_CACHE_CONTROL, "X-Collab-Step": str(version.step)})


async def get_params_blob(request: web.Request) -> web.StreamResponse:
    """One immutable body: 200 or 206 (a single ``Range``), 304 on a matching ``If-None-Match``,
    404 (never cached) for a URL the relay did not hand out or whose file was pruned."""
    if not request.app[CONFIG].server.public_params_url:
        raise ApiError(404, "no_params_cache", "this run serves no immutable parameter URLs",
                       "Download with GET /api/params; the organizer enables a cache with [server] public_params_url.")
    blobs = request.app[BLOBS]
    kind, sha = request.match_info["kind"], request.match_info["sha256"]
    try:
        version = blobs.versions.get((int(request.match_info["step"]), sha))
    except ValueError:
        version = None
    if version is None or kind not in ("full", "delta") or (kind == "delta" and version.delta_path is None):
        raise ApiError(404, "unknown_version", f"no published body at {request.path}",
                       "Ask the relay for the current version (GET /api/params); old versions are pruned.")
    etag = f'"{sha}"' if kind == "full" else f'"{sha}-delta"'
    headers = {"ETag": etag, "Cache-Control": BLOB_CACHE_CONTROL, "Accept-Ranges": "bytes",
               "Content-Type": "application/octet-stream", "X-Collab-Step": str(version.step),
               "X-Collab-Sha256": sha}
    held = request.headers.get("If-None-Match", "")  # weak comparison, as RFC 9110 asks for this header
    if held.strip() == "*" or etag in (t.strip().removeprefix("W/") for t in held.split(",")):
        return web.Response(status=304, headers={k: headers[k] for k in ("ETag", "Cache-Control")})
    if kind == "full":
        prefix, path, offset, count = _full_header(version.step, version.numel), version.path, version.offset, version.nbytes
    else:
        prefix, path, offset = b"", version.delta_path, 0
    try:
        fh = open(path, "rb")  # an open file outlives the store pruning it
    except FileNotFoundError:
        raise ApiError(404, "unknown_version", f"step {version.step} was pruned",
                       "Ask the relay for the current version (GET /api/params).") from None
    with fh:
        if kind == "delta":
            count = fh.seek(0, 2)
        size = len(prefix) + count
        wanted = _range(request, etag, size)
        if wanted == "unsatisfiable":
            return web.Response(status=416, headers={"Content-Range": f"bytes */{size}",
                                                     "Cache-Control": FRESH_CACHE_CONTROL})
        first, last = wanted or (0, size - 1)
        status = 200 if wanted is None else 206
        if status == 206:
            headers["Content-Range"] = f"bytes {first}-{last}/{size}"
        response = web.StreamResponse(status=status, headers=headers)
        response.content_length = last - first + 1
        await response.prepare(request)
        if request.method == "HEAD":
            return response
        sent = await _write_range(response, prefix, fh, offset, first, last)
    await response.write_eof()
    blobs.egress.immutable += sent
    request.app[COLLAB].traffic.down_bytes += sent
    blobs.egress.immutable_requests += 1
    key = blob_path(version.step, sha, kind)
    if (version.step, sha) in blobs.versions:
        blobs.egress.by_url[key] = blobs.egress.by_url.get(key, 0) + sent
    return response


def _range(request: web.Request, etag: str, size: int) -> tuple[int, int] | str | None:
    """The one byte range asked for (inclusive bounds); None for the whole body (no range,
    several ranges, a malformed one or a stale ``If-Range``); ``"unsatisfiable"`` past the end."""
    match = _RANGE.fullmatch(request.headers.get("Range", "").strip())
    if not match or request.headers.get("If-Range", etag) != etag or not any(match.groups()):
        return None
    start, end = match.groups()
    if not start:  # the last ``end`` bytes
        return (max(0, size - int(end)), size - 1) if int(end) > 0 else "unsatisfiable"
    if end and int(end) < int(start):  # not a valid range: ignored
        return None
    if int(start) >= size:
        return "unsatisfiable"
    return int(start), min(size - 1, int(end)) if end else size - 1


async def _write_range(response: web.StreamResponse, prefix: bytes, fh, offset: int, first: int, last: int) -> int:
    """Bytes ``first..last`` of ``prefix`` + the file's ``[offset, ...)``: the prefix from
    memory, the rest in 4 MiB reads (back-pressure through ``response.write``)."""
    sent = 0
    if first < len(prefix):
        piece = prefix[first:last + 1]
        await response.write(piece)
        sent += len(piece)
    position = offset + max(0, first - len(prefix))
    remaining = last + 1 - max(first, len(prefix))
    while remaining > 0:
        piece = await asyncio.to_thread(_pread, fh, position, min(remaining, 4 << 20))
        if not piece:
            raise ConnectionResetError("state file ended early")
        await response.write(piece)
        position += len(piece)
        remaining -= len(piece)
        sent += len(piece)
    return sent


def _pread(fh, position: int, count: int) -> bytes:
    fh.seek(position)
    return fh.read(count)


async def get_params_egress(request: web.Request) -> web.Response:
    """The parameter bytes this relay wrote itself, by route (what a cache in front saves)."""
    return json_ok(request.app[BLOBS].egress.report())


async def lifespan(app: web.Application):
    app[BLOBS] = Blobs()
    yield


ROUTE_TABLE = [
    ("GET", ROUTES["params_blob"], get_params_blob),
    ("HEAD", ROUTES["params_blob"], get_params_blob),
    ("GET", ROUTES["params_egress"], get_params_egress),
]
PUBLIC = frozenset({ROUTES["params_blob"], ROUTES["params_egress"]})
