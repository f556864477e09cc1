"""Per-peer rate limits: token buckets keyed by who is asking, one bucket per kind of route.

Who is asking: the Hugging Face username of a signed request (every notebook of one volunteer
shares it, so a volunteer cannot multiply their allowance by opening tabs), else the remote
address (open mode, and unsigned requests in hf mode: the dashboard, logins). Kinds of route
differ by two orders of magnitude in cost and in how often an honest peer sends them, so each
has its own bucket (``[limits]`` in the run config):

* ``poll``: heartbeats, progress, state, leave, shard leases -- several per second per peer;
* ``transfer``: gradient uploads and parameter downloads -- one or two per round;
* ``join`` and ``login``: rare, and each costs a database row or a Hugging Face whoami call;
* ``observe``: unsigned reads (status, run, dashboard) -- a dashboard polls every 1.5 s;
* ``tasks``: mixture-of-experts calls, task polls and results -- k x layers x 2 per micro-batch.

Two middlewares: :func:`rate_limit_middleware` sits *after* authentication (so it knows the
username), :func:`auth_failure_middleware` sits *before* it and stops an address whose signed
requests keep failing before any signature is checked again (a forged-pass flood would
otherwise cost one Ed25519 verify per request). The admin routes never reach either.

The address is the client's by the rule the connection caps use too
(:mod:`relay_server.core.client_address`): behind a reverse proxy on this host, the last hop of
``X-Forwarded-For`` (``limits.trust_forwarded_for``, on by default, believed from loopback
only), else the socket's address. Unsigned requests from a loopback *client* are not limited by
default (``limits.exempt_loopback``): on a local experiment every peer, script and dashboard is
127.0.0.1 -- except logins, which are limited on loopback too unless
``limits.exempt_loopback_logins`` says otherwise. A request the proxy forwards for a public
address is that address's, never exempt. A proxy that sends no such header makes every
volunteer one loopback client: :class:`SharedAddressWarning` says so in the log, once.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from relay_server.api.moderation import ADMIN_PREFIX
from relay_server.auth.verify import IDENTITY_KEY, AuthRejected
from relay_server.core.client_address import FORWARDED_FOR, client_address, is_loopback
from relay_server.core.config import LimitsSection
from relay_server.core.http import drain
from toolkit.wire.auth import PASS_HEADER
from toolkit.wire.protocol import ROUTES, ErrorBody

log = logging.getLogger(__name__)

_LOG_EVERY_S = 60.0
_TRANSFER = {("PUT", ROUTES["gradient"]), ("GET", ROUTES["params"])}
_OBSERVE = {ROUTES["status"], ROUTES["run"], "/", "/static", "/favicon.ico", ROUTES.get("shards", "/api/shards")}
_LABELS = {
    "poll": "heartbeat/progress",
    "transfer": "upload/download",
    "join": "join",
    "login": "login",
    "observe": "status/dashboard",
    "tasks": "expert call/task",
    "auth_failures": "refused signed",
}


@dataclass(frozen=True)
class Rate:
    """A bucket of ``burst`` tokens refilled at ``per_s`` tokens per second."""

    per_s: float
    burst: float


def rates_from(config: LimitsSection) -> dict[str, Rate]:
    return {kind: Rate(getattr(config, f"{kind}_per_s"), getattr(config, f"{kind}_burst")) for kind in _LABELS}


class TokenBuckets:
    """Buckets by (kind, key) in bounded memory.

    ``max_keys`` bounds the table (an address flood must not grow it without end): the least
    recently used bucket is dropped first. A dropped bucket comes back full, which only ever
    favours a key that has been quiet the longest -- never the one flooding right now.
    """

    def __init__(
        self, rates: Mapping[str, Rate], *, clock: Callable[[], float] = time.monotonic, max_keys: int = 100_000
    ) -> None:
        self.rates, self.clock, self.max_keys = dict(rates), clock, max_keys
        self._buckets: OrderedDict[tuple[str, str], list[float]] = OrderedDict()  # -> [tokens, updated]

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, kind: str, key: str, cost: float = 1.0) -> float:
        """Spend ``cost`` tokens: 0.0 if allowed, else the seconds until that many are back."""
        rate = self.rates[kind]
        now = self.clock()
        bucket = self._buckets.get((kind, key))
        if bucket is None:
            bucket = self._buckets[(kind, key)] = [rate.burst, now]
            if len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end((kind, key))
            bucket[0] = min(rate.burst, bucket[0] + (now - bucket[1]) * rate.per_s)
            bucket[1] = now
        if bucket[0] >= cost:
            bucket[0] -= cost
            return 0.0
        return (cost - bucket[0]) / rate.per_s

    def peek(self, kind: str, key: str) -> float:
        """Seconds until one token is available, without spending any."""
        bucket = self._buckets.get((kind, key))
        if bucket is None:
            return 0.0
        rate = self.rates[kind]
        tokens = min(rate.burst, bucket[0] + (self.clock() - bucket[1]) * rate.per_s)
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / rate.per_s


_TASKS_PREFIX = "/api/moe/"  # expert calls, task polls, results, checkpoints: many per micro-batch


def route_kind(request: web.Request) -> str | None:
    """The bucket a request draws from; None for routes that are never limited (admin)."""
    resource = request.match_info.route.resource
    if resource is None:
        return "observe"  # 404/405: no handler runs, but the answer still costs a little
    path = resource.canonical
    if path.startswith(ADMIN_PREFIX):
        return None
    if path in (ROUTES["login"], ROUTES["refresh"]):
        return "login"
    if path == ROUTES["join"]:
        return "join"
    if (request.method, path) in _TRANSFER:
        return "transfer"
    if path.startswith(_TASKS_PREFIX) and path not in (ROUTES["moe_spec"], ROUTES["moe_directory"]):
        return "tasks"
    if path in _OBSERVE:
        return "observe"
    return "poll"


class ClientKeys:
    """Who a request counts against: ``user:<name>`` when signed, else ``addr:<address>``."""

    def __init__(
        self, *, exempt_loopback: bool = True, trust_forwarded_for: bool = True, exempt_loopback_logins: bool = False
    ) -> None:
        self.exempt_loopback, self.trust_forwarded_for = exempt_loopback, trust_forwarded_for
        self.exempt_loopback_logins = exempt_loopback_logins

    def address(self, request: web.Request) -> str:
        return client_address(
            request.remote or "unknown", request.headers, trust_forwarded_for=self.trust_forwarded_for
        )

    def key(self, request: web.Request, kind: str | None = None) -> str | None:
        """None when the request is not limited (unsigned, from loopback, loopback exempt; a
        login only with ``exempt_loopback_logins``)."""
        identity = request.get(IDENTITY_KEY)
        if identity is not None:
            return "user:" + identity["username"].casefold()
        address = self.address(request)
        exempt = self.exempt_loopback_logins if kind == "login" else self.exempt_loopback
        if exempt and is_loopback(address):
            return None
        return "addr:" + address


class SharedAddressWarning:
    """Warn once when the requests of several users all come from one address without
    ``X-Forwarded-For``: most likely a reverse proxy that does not forward the client's address,
    so every volunteer shares one per-address bucket (logins). Any second address, or one
    forwarded header, shows the relay is not behind such a proxy, and the watch ends."""

    def __init__(self, users_needed: int = 3) -> None:
        self.users_needed = users_needed
        self.address: str | None = None
        self.users: set[str] = set()
        self.done = False

    def observe(self, request: web.Request) -> None:
        if self.done:
            return
        remote = request.remote or "unknown"
        if FORWARDED_FOR in request.headers or self.address not in (None, remote):
            self.done = True
            return
        self.address = remote
        identity = request.get(IDENTITY_KEY)
        if identity is not None:
            self.users.add(identity["username"].casefold())
        if len(self.users) >= self.users_needed:
            self.done = True
            log.warning(
                "requests of %d users all come from %s without X-Forwarded-For: if a reverse proxy "
                "forwards to this relay, make it set X-Forwarded-For (nginx: proxy_set_header "
                "X-Forwarded-For $proxy_add_x_forwarded_for; Caddy sets it) and run it on this host, or "
                "every volunteer shares one login rate limit ([limits] login_*). Expected on a local "
                "experiment.",
                len(self.users),
                remote,
            )


class _Warnings:
    """One log line per (kind, key) per minute: a flood must not become a log flood."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._last: dict[tuple[str, str], float] = {}

    def __call__(self, kind: str, key: str) -> None:
        now = self.clock()
        if now - self._last.get((kind, key), -math.inf) >= _LOG_EVERY_S:
            if len(self._last) > 10_000:
                self._last.clear()
            self._last[(kind, key)] = now
            log.warning("rate limit: refusing %s requests from %s", _LABELS[kind], key)


def too_many(kind: str, wait_s: float, rate: Rate, key: str) -> web.Response:
    """The 429 answer: the usual error body plus ``Retry-After`` (whole seconds, >= 1)."""
    who = key.split(":", 1)[-1]
    body = ErrorBody(
        error="rate_limited",
        message=f"too many {_LABELS[kind]} requests from {who} (limit {rate.per_s:g}/s, bursts of {rate.burst:g})",
        hint=f"Retry in {wait_s:.1f}s. The toolkit's own pace stays far below this; if many "
        "notebooks share one account, ask the organizer to raise the [limits] of this run.",
    )
    return web.json_response(body.to_json(), status=429, headers={"Retry-After": str(max(1, math.ceil(wait_s)))})


def rate_limit_middleware(buckets: TokenBuckets, keys: ClientKeys) -> Middleware:
    """Charge every request to its client's bucket for its kind of route; 429 when empty.
    Install after authentication, so signed requests are charged to their username."""
    warn = _Warnings(buckets.clock)
    shared = SharedAddressWarning()

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        shared.observe(request)
        kind = route_kind(request)
        key = keys.key(request, kind) if kind is not None else None
        if kind is None or key is None:
            return await handler(request)
        wait_s = buckets.take(kind, key)
        if wait_s > 0:
            warn(kind, key)
            await drain(request)
            return too_many(kind, wait_s, buckets.rates[kind], key)
        return await handler(request)

    return middleware


def auth_failure_middleware(buckets: TokenBuckets, keys: ClientKeys) -> Middleware:
    """Count refused credentials (401/403 from authentication or login) per address, and refuse
    an address that exhausted its ``auth_failures`` bucket before verifying anything it sends
    again (requests without credentials cost nothing to refuse and pass through).
    Install before authentication."""
    warn = _Warnings(buckets.clock)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        address = keys.address(request)
        if not _presents_credentials(request) or (keys.exempt_loopback and is_loopback(address)):
            return await handler(request)  # nothing to verify: no verification cost to guard
        key = "addr:" + address
        wait_s = buckets.peek("auth_failures", key)
        if wait_s > 0:
            warn("auth_failures", key)
            await drain(request)
            return too_many("auth_failures", wait_s, buckets.rates["auth_failures"], key)
        try:
            return await handler(request)
        except AuthRejected as exc:
            if exc.status in (401, 403):
                buckets.take("auth_failures", key)
            raise

    return middleware


def _presents_credentials(request: web.Request) -> bool:
    """A pass to verify, or an HF token to send to whoami: the requests worth guarding."""
    resource = request.match_info.route.resource
    return PASS_HEADER in request.headers or (resource is not None and resource.canonical == ROUTES["login"])


def build_rate_limits(config: LimitsSection, *, auth_enabled: bool) -> tuple[list[Middleware], list[Middleware]]:
    """(middlewares to install before authentication, middlewares to install after it)."""
    if not config.enabled:
        return [], []
    buckets = TokenBuckets(rates_from(config))
    keys = ClientKeys(
        exempt_loopback=config.exempt_loopback,
        trust_forwarded_for=config.trust_forwarded_for,
        exempt_loopback_logins=config.exempt_loopback_logins,
    )
    before = [auth_failure_middleware(buckets, keys)] if auth_enabled else []
    return before, [rate_limit_middleware(buckets, keys)]
