"""Parameter bodies at immutable URLs, for an HTTP cache in front of the relay (``[server]
public_params_url``); and the relay's count of the parameter bytes it sent itself.

Why ``/api/params/v/{step}/{tag}/{kind}``: the URL names its bytes, so a cache may keep it
forever (``Cache-Control: public, immutable``; ``ETag`` = the sha256 of the float32 parameters a
peer holds afterwards, the hash the relay already signs); the step is in it because the body's
container header names the step (two steps with equal parameters are two bodies) and it finds the
state file without an index; ``kind`` tells the full body from the int8 delta against the version
before. A URL exists only once the relay has handed it out in a
:class:`~toolkit.wire.protocol.ParamsRef` (the last :data:`REMEMBERED` of them): nobody can walk
the run's versions by counting steps, and an unknown or pruned one is refused, never cached.

Who may read a body. On an open run (``auth.mode = "open"``) anyone may download the parameters
anyway (``GET /api/params`` is public), so the tag is simply the sha256. On a signed run
(``"hf"``) the parameters are the members': the tag is a *capability*, HMAC-SHA256 of step, sha256
and kind under a secret derived from the relay key (:meth:`RelayKey.derive_secret`), and only the
signed ``GET /api/params`` -- a logged-in, allowlisted, unbanned peer -- ever hands one out.
Knowing the sha256 (or anything else a public route shows) gives a non-member nothing: every URL
but a current capability is a 403 that says to log in. Why a capability and not a signature on
each request: the design is that parameter downloads go through a shared HTTP cache (nginx
``proxy_cache``, a CDN) so that the relay sends each body once; such a cache keys on the path,
answers hits itself and cannot check a per-peer signature, so per-request signatures would either
send every download to the relay (no cache) or let the cache serve anyone (no protection). A
capability in the path needs nothing from the cache: it fills itself with the URL a peer asked
for, and serves only those who hold it. What it cannot do is stop a member passing a URL on (as
a member can pass on the parameters themselves), and a URL stays valid until its version leaves
the :data:`REMEMBERED` ones (cached copies, until the cache evicts them): the README says how an
organizer keeps the cache itself private too. The secret follows the relay key, so URLs survive a
restart (the cache's copies stay hits) and change when the key is replaced. The peer still checks
every body against the hash in the relay's signed ref: a cache can withhold or garble, not forge.

``Range``: one byte range, RFC 9110 section 14. A position may have any number of digits (the
RFC sets no limit; Python refuses to convert more than 4300 of them, which once answered 500), so
positions are compared by their digits and never converted beyond the body's size: a first
position past the end is 416 with a hint, a suffix or last position past it means "to the end"
(206, as section 14.1.2 says); a syntactically invalid header, several ranges, another unit or a
stale ``If-Range`` is ignored and the whole body is sent (200), as section 14.2 allows.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Literal

from aiohttp import web

from relay_server.api.context import COLLAB, CONFIG
from relay_server.auth.relay_key import RelayKey
from relay_server.core.errors import ApiError
from relay_server.core.http import error_response, json_ok
from relay_server.rounds.publisher import Version, _full_header
from toolkit.wire.protocol import BLOB_CACHE_CONTROL, FRESH_CACHE_CONTROL, PARAMS_REF_TYPE, ROUTES, ParamsRef

REMEMBERED = 16
"""Versions whose immutable URLs the relay answers (the newest handed out); older ones are refused."""

_RANGE = re.compile(r"bytes=([0-9]*)-([0-9]*)", re.ASCII | re.IGNORECASE)  # the unit is case-insensitive
_LOGIN_HINT = (
    "Log in and ask GET /api/params?ref=1 for the current version's URL (the toolkit's "
    "RelayClient.login, then client.params.download_params, does both); old versions are pruned."
)


@dataclass
class Egress:
    """Parameter bytes the relay wrote itself (bodies only, not HTTP headers), by route: what a
    cache in front saves is visible here (``GET /api/admin/params/egress``, the organizer's: it
    lists the body URLs, which on signed runs are capabilities)."""

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

    def report(self) -> dict[str, Any]:
        return {
            "direct": self.direct,
            "immutable": self.immutable,
            "immutable_requests": self.immutable_requests,
            "refs": self.refs,
            "ref_bytes": self.ref_bytes,
            "by_url": dict(self.by_url),
        }


@dataclass
class Blobs:
    """The versions handed out as refs, newest last, the bytes served, and (signed runs) the
    secret the URLs' capabilities are computed with."""

    versions: OrderedDict[tuple[int, str], Version] = field(default_factory=OrderedDict)
    egress: Egress = field(default_factory=Egress)
    secret: bytes | None = field(default=None, repr=False)
    """None on open runs: a URL's tag is then the sha256 (the module docstring says why)."""

    def tag(self, step: int, sha256: str, kind: str) -> str:
        """What names a body in its URL: the sha256 on open runs, else the body's capability."""
        if self.secret is None:
            return sha256
        return hmac.new(self.secret, f"{step}/{sha256}/{kind}".encode("ascii"), hashlib.sha256).hexdigest()

    def path(self, version: Version, kind: str) -> str:
        return blob_path(version.step, self.tag(version.step, version.sha256, kind), kind)

    def remember(self, version: Version) -> None:
        key = (version.step, version.sha256)
        self.versions[key] = version
        self.versions.move_to_end(key)
        while len(self.versions) > REMEMBERED:
            _, old = self.versions.popitem(last=False)
            for kind in ("full", "delta"):
                self.egress.by_url.pop(self.path(old, kind), None)

    def find(self, step: str, tag: str, kind: str) -> Version | None:
        """The remembered version whose ``kind`` body this URL names, else None. Every candidate
        is compared in constant time: a capability must not be learnable from response times."""
        if kind not in ("full", "delta") or not (
            step.isascii() and step.isdigit() and len(step) <= 19 and tag.isascii()
        ):
            return None
        given, found = tag.encode("ascii"), None
        for version in self.versions.values():
            mine = self.tag(version.step, version.sha256, kind).encode()
            if version.step == int(step) and hmac.compare_digest(mine, given):
                found = version
        return found


BLOBS = web.AppKey("params_blobs", Blobs)


def blob_path(step: int, tag: str, kind: str) -> str:
    return ROUTES["params_blob"].format(step=step, tag=tag, kind=kind)


def ref_response(request: web.Request, version: Version, have: int | None) -> web.Response:
    """The signed, uncached answer naming where version's body is at the run's cache: the delta
    when the peer holds the version before (and one was written), else the full body."""
    blobs = request.app[BLOBS]
    blobs.remember(version)
    blobs.egress.refs += 1
    delta = version.delta_path is not None and have == version.step - 1
    kind: Literal["full", "delta"] = "delta" if delta else "full"
    base = request.app[CONFIG].server.public_params_url.rstrip("/")
    ref = ParamsRef(
        step=version.step,
        sha256=version.sha256,
        kind=kind,
        base=have if delta else -1,  # type: ignore[arg-type]  # delta only when have == step - 1
        url=base + blobs.path(version, kind),
    )
    body = ref.dumps()
    blobs.egress.ref_bytes += len(body)
    return web.Response(
        body=body,
        content_type=PARAMS_REF_TYPE,
        headers={"Cache-Control": FRESH_CACHE_CONTROL, "X-Collab-Step": str(version.step)},
    )


async def get_params_blob(request: web.Request) -> web.StreamResponse:
    """One immutable body: 200 or 206 (a single ``Range``), 304 on a matching ``If-None-Match``,
    404 (never cached) for a URL the relay did not hand out or whose file was pruned -- 403 on a
    signed run, where only a current capability names a body (the module docstring says why)."""
    if not request.app[CONFIG].server.public_params_url:
        raise ApiError(
            404,
            "no_params_cache",
            "this run serves no immutable parameter URLs",
            "Download with GET /api/params; the organizer enables a cache with [server] public_params_url.",
        )
    blobs = request.app[BLOBS]
    kind = request.match_info["kind"]
    version = blobs.find(request.match_info["step"], request.match_info["tag"], kind)
    if version is not None and kind == "delta" and version.delta_path is None:
        version = None
    if version is None and blobs.secret is not None:
        raise ApiError(
            403,
            "params_url_not_issued",
            "on this signed run a parameter body's URL is a capability the "
            "relay hands to logged-in peers, and this is none it handed out (or its version was pruned)",
            _LOGIN_HINT,
        )
    if version is None:
        raise ApiError(
            404,
            "unknown_version",
            f"no published body at {request.path[:160]}",
            "Ask the relay for the current version (GET /api/params); old versions are pruned.",
        )
    sha = version.sha256
    etag = f'"{sha}"' if kind == "full" else f'"{sha}-delta"'
    headers = {
        "ETag": etag,
        "Cache-Control": BLOB_CACHE_CONTROL,
        "Accept-Ranges": "bytes",
        "Content-Type": "application/octet-stream",
        "X-Collab-Step": str(version.step),
        "X-Collab-Sha256": sha,
    }
    held = request.headers.get("If-None-Match", "")  # weak comparison, as RFC 9110 asks for this header
    if held.strip() == "*" or etag in (t.strip().removeprefix("W/") for t in held.split(",")):
        return web.Response(status=304, headers={k: headers[k] for k in ("ETag", "Cache-Control")})
    if kind == "full":
        prefix, path, offset, count = (
            _full_header(version.step, version.numel),
            version.path,
            version.offset,
            version.nbytes,
        )
    else:
        prefix, path, offset = b"", version.delta_path, 0  # type: ignore[assignment]  # checked set above
    try:
        fh = open(path, "rb")  # an open file outlives the store pruning it
    except FileNotFoundError:
        raise ApiError(
            404,
            "unknown_version",
            f"step {version.step} was pruned",
            "Ask the relay for the current version (GET /api/params).",
        ) from None
    with fh:
        if kind == "delta":
            count = fh.seek(0, 2)
        size = len(prefix) + count
        wanted = _range(request, etag, size)
        if wanted == "unsatisfiable":
            return error_response(
                416,
                "range_not_satisfiable",
                f"the range starts past this {size}-byte body",
                "Ask for bytes below the size in Content-Range, or for the whole body (no Range).",
                headers={"Content-Range": f"bytes */{size}", "Cache-Control": FRESH_CACHE_CONTROL},
            )
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
    key = blobs.path(version, kind)
    if (version.step, sha) in blobs.versions:
        blobs.egress.by_url[key] = blobs.egress.by_url.get(key, 0) + sent
    return response


def _range(request: web.Request, etag: str, size: int) -> tuple[int, int] | Literal["unsatisfiable"] | None:
    """The one byte range asked for (inclusive bounds); None for the whole body (no range,
    several ranges, a malformed or invalid one, or a stale ``If-Range``); ``"unsatisfiable"`` for
    a first position past the end. Digits are compared, never converted past ``size`` (above)."""
    match = _RANGE.fullmatch(request.headers.get("Range", "").strip())
    if not match or request.headers.get("If-Range", etag) != etag or not any(match.groups()):
        return None
    start, end = (_digits(g) if g else None for g in match.groups())
    if start is None:  # the last ``end`` bytes: all of them when it asks for more than there are
        suffix = _at_most(end, size)  # type: ignore[arg-type]  # any(groups): end is set when start is not
        return (size - suffix, size - 1) if suffix > 0 else "unsatisfiable"
    if end is not None and (len(end), end) < (len(start), start):  # last < first: invalid, ignored
        return None
    first = _at_most(start, size)
    if first >= size:
        return "unsatisfiable"
    return first, _at_most(end, size - 1) if end is not None else size - 1


def _digits(text: str) -> str:
    """A position's digits without leading zeros ("0" for zero): ordered by (length, text)."""
    return text.lstrip("0") or "0"


def _at_most(digits: str, bound: int) -> int:
    """The position, or ``bound`` if it is larger, without converting a number of any length."""
    return bound if len(digits) > len(str(bound)) else min(int(digits), bound)


async def _write_range(
    response: web.StreamResponse, prefix: bytes, fh: BinaryIO, offset: int, first: int, last: int
) -> int:
    """Bytes ``first..last`` of ``prefix`` + the file's ``[offset, ...)``: the prefix from
    memory, the rest in 4 MiB reads (back-pressure through ``response.write``)."""
    sent = 0
    if first < len(prefix):
        piece = prefix[first : last + 1]
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


def _pread(fh: BinaryIO, position: int, count: int) -> bytes:
    fh.seek(position)
    return fh.read(count)


async def get_params_egress(request: web.Request) -> web.Response:
    """The parameter bytes this relay wrote itself, by route (what a cache in front saves). Under
    ``/api/admin``, so the admin middleware asks for the organizer's token in every mode: the
    report lists the body URLs, and on signed runs those are the members' capabilities."""
    return json_ok(request.app[BLOBS].egress.report())


async def lifespan(app: web.Application) -> AsyncIterator[None]:
    """The store of handed-out versions; on signed runs with the capability secret (from the relay
    key the auth middleware verifies passes with: the same file under the data dir)."""
    config = app[CONFIG]
    secret = None
    if config.auth.mode != "open":
        secret = RelayKey.load_or_create(config.server.data_dir).derive_secret("params-url")
    app[BLOBS] = Blobs(secret=secret)
    yield


ROUTE_TABLE = [
    ("GET", ROUTES["params_blob"], get_params_blob),
    ("HEAD", ROUTES["params_blob"], get_params_blob),
    ("GET", ROUTES["params_egress"], get_params_egress),
]
PUBLIC = frozenset({ROUTES["params_blob"]})
"""A cache fills itself without a pass (signed runs: with a capability URL, see above)."""
