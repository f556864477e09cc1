"""Connections and descriptors as a managed resource: what a relay keeps open, for whom, how long.

A relay on a stock VM starts with a soft ``RLIMIT_NOFILE`` of 1024, and every peer holds two or
three connections (heartbeats, the worker's uploads and long-polls): without care a few hundred
peers exhaust it, and the errors then surface inside handlers, mid-response. So:

* at start the soft limit is raised to the hard one (:func:`raise_descriptor_limit`) and the
  relay computes how many connections it can hold (the limit, less the descriptors already open,
  less ``fd_reserve`` for files and the database);
* every accepted connection passes :class:`ConnectionGuard`: past the global or per-address cap
  the longest-idle connection is closed to make room, and with none idle the newcomer is answered
  ``503`` + ``Retry-After`` and closed, before any handler runs (the toolkit waits and retries);
* a connection with no request in progress is closed after ``idle_timeout_s`` (idle keep-alives,
  slowloris headers); a request body that delivers no byte for ``body_idle_timeout_s`` is cut
  (a stalled gradient upload then fails like any other, so its round does not wait for it); a
  GET whose client went away is cancelled (a long-poll must not hold its peer "alive");
* declared upload bytes in flight are capped globally and per address;
* behind a reverse proxy on this host (the README's TLS setup) the per-address caps follow the
  client the proxy names (:mod:`relay_server.core.client_address`), as the rate limits do. A TCP
  connection is admitted before any header arrives, and the proxy's connections all come from
  loopback, so for proxied requests the per-address connection cap counts what a connection
  costs the relay -- a request in progress (a handler, an upstream connection, perhaps a
  long-poll) -- per forwarded client: past ``max_per_address`` of them a client's next request is
  answered 503 + Retry-After. A client's idle keep-alives are held by the proxy, whose own
  timeouts bound them; the proxy's connections themselves stay under the global cap;
* the guard accepts connections itself (:class:`relay_server.core.accept.Acceptor`): CPython's accept loop turns one
  EMFILE into a traceback per failed accept and a growing storm of retries; here a failed accept
  pauses accepting briefly and is reported once a minute.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from relay_server.core.accept import RETRY_AFTER_S, Acceptor, open_descriptors, raise_descriptor_limit, shut
from relay_server.core.client_address import forwarded_client, is_loopback

log = logging.getLogger(__name__)

_UPLOAD_MIN_BYTES = 1 << 20  # bodies this large are tensors (gradients, slices): counted in flight


@dataclass(kw_only=True)
class ConnectionsSection:
    """``[connections]``: how many connections the relay keeps, for whom, and for how long."""

    max_connections: int = 0
    """Open client connections at most; 0 = what the descriptor limit allows (raised to the hard
    limit at start, less ``fd_reserve`` and what is already open). Past it the longest-idle
    connection is closed to admit a new one; with none idle the new one gets 503 + Retry-After."""
    max_per_address: int = 64
    """Open connections per client address (a notebook holds two or three)."""
    exempt_loopback: bool = True
    """No per-address caps for clients at 127.0.0.1/::1 (local runs). The client is the one
    ``limits.trust_forwarded_for`` finds: a reverse proxy on this host connects from loopback
    uncapped, but a public address it forwards for is capped like any other."""
    fd_reserve: int = 64
    """Descriptors kept free for state files and the database; at most a quarter of the limit.
    A transfer in progress holds one more (a download its version file, an upload its spool):
    past the limit it is answered 503 + Retry-After, never failed half-way."""
    idle_timeout_s: float = 30.0
    """A connection with no request in progress is closed after this long: idle keep-alives and
    clients sending a request's headers too slowly."""
    body_idle_timeout_s: float = 10.0
    """A request body that delivers no byte for this long is cut; a gradient upload cut this way
    counts as a failed upload, so the round does not wait for it."""
    max_upload_bytes: int = 8 << 30
    """Declared bytes of tensor uploads in flight at once; past it an upload is answered 503 +
    Retry-After before any of its body is read."""
    max_upload_bytes_per_address: int = 2 << 30
    """The same per client address (proxied: the forwarded one; loopback exempt as for
    ``max_per_address``)."""

    def checks(self) -> list[tuple[bool, str]]:
        """(holds, message) pairs for :meth:`RelayConfig.validate`."""
        return [
            (
                self.max_connections >= 0 and self.fd_reserve >= 0,
                "connections.max_connections and connections.fd_reserve must be >= 0",
            ),
            (
                min(
                    self.max_per_address,
                    self.idle_timeout_s,
                    self.body_idle_timeout_s,
                    self.max_upload_bytes,
                    self.max_upload_bytes_per_address,
                )
                > 0,
                "connections.max_per_address, idle_timeout_s, body_idle_timeout_s and max_upload_bytes"
                "(_per_address) must be > 0",
            ),
        ]


class _Conn:
    """One client connection's bookkeeping."""

    __slots__ = ("transport", "address", "idle_since", "last_bytes", "request", "task")

    def __init__(self, transport: asyncio.Transport, address: str, now: float) -> None:
        self.transport, self.address = transport, address  # the socket's peer: what TCP-level caps count
        self.idle_since = self.last_bytes = now
        self.request: web.BaseRequest | None = None
        self.task: asyncio.Task[Any] | None = None  # a GET's handler: cancelled if its client goes away


class _GuardedProtocol(asyncio.Protocol):
    """aiohttp's request handler behind the guard: admission, byte clock, release."""

    __slots__ = ("_guard", "_inner", "_conn")

    def __init__(self, guard: "ConnectionGuard", inner: asyncio.Protocol) -> None:
        self._guard, self._inner = guard, inner
        self._conn: _Conn | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a listening socket's protocol gets a Transport; asyncio.Protocol declares the base class
        self._conn = self._guard.admit(transport)  # type: ignore[arg-type]
        if self._conn is not None:
            self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._conn is not None:
            self._conn.last_bytes = time.monotonic()
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._conn is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._conn is not None:
            self._guard.release(self._conn)
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._conn is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._conn is not None:
            self._inner.resume_writing()


class ConnectionGuard:
    """Admits, times out and accounts for every client connection of one server.

    ``trust_forwarded_for`` (``limits.trust_forwarded_for``) decides who a request is from, by the
    same rule as the rate limits (:func:`~relay_server.core.client_address.client_address`)."""

    def __init__(self, config: ConnectionsSection, *, trust_forwarded_for: bool = True) -> None:
        self.config, self.trust_forwarded_for = config, trust_forwarded_for
        self._limits = raise_descriptor_limit()  # first: whatever starts next may need descriptors
        self.capacity = config.max_connections or 1 << 30
        self._conns: dict[asyncio.Transport, _Conn] = {}
        self._idle: OrderedDict[asyncio.Transport, _Conn] = OrderedDict()  # longest idle first
        self._bodies: set[_Conn] = set()  # busy with a body still arriving
        self._per_address: Counter[str] = Counter()
        self._uploads: Counter[str] = Counter()  # declared bytes in flight by client address ("" = total)
        self._proxied: Counter[str] = Counter()  # requests in progress by forwarded client address
        self.counts: Counter[str] = Counter()  # refused / evicted / timed out, by reason
        self._acceptor: Acceptor | None = None
        self.pending = 0  # accepted and let in, not yet registered (the transport is being made)

    # --- start -----------------------------------------------------------------------------------
    def start(self) -> str:
        """Size the connection table from the (raised) limit and what the started app holds;
        returns the line to log."""
        before, limit = self._limits
        in_use = open_descriptors()
        reserve = min(self.config.fd_reserve, limit // 4)
        fit = max(8, limit - in_use - reserve)
        self.capacity = min(fit, self.config.max_connections) if self.config.max_connections else fit
        raised = f"raised from {before} to {limit}" if limit > before else f"{limit} (hard limit)"
        return (
            f"descriptors: soft limit {raised}, {in_use} in use, {reserve} reserved: up to {self.capacity} "
            f"connections, about {self.capacity // 2} peers"
        )

    def listen(self, host: str, port: int, inner: Callable[[], asyncio.Protocol]) -> tuple[str, int]:
        """Listen on ``host:port`` (0 = any free port) and serve every admitted connection with a
        protocol from ``inner`` (aiohttp's server); returns the bound address."""
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(1024)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._acceptor = Acceptor(self, sock, lambda: _GuardedProtocol(self, inner()))
        self._acceptor.start()
        return sock.getsockname()[:2]

    def close(self) -> None:
        """Stop accepting (open connections are the server's to shut down)."""
        if self._acceptor is not None:
            self._acceptor.close()

    @property
    def open(self) -> int:
        return len(self._conns)

    # --- admission and release -------------------------------------------------------------------
    def make_room(self, address: str) -> bool:
        """Whether a connection from ``address`` may come in, closing the longest-idle connection
        (of that address past its cap, else any) when a cap is reached; False: refuse it."""
        exempt = self.config.exempt_loopback and is_loopback(address)
        if not exempt and self._per_address[address] >= self.config.max_per_address and not self._evict(address):
            self.counts["refused_per_address"] += 1
            return False
        if len(self._conns) + self.pending >= self.capacity and not self._evict(None):
            self.counts["refused_capacity"] += 1
            return False
        self.pending += 1  # its slot, and its address's, are taken from now on
        self._per_address[address] += 1
        return True

    def unreserve(self, address: str) -> None:
        """A connection :meth:`make_room` let in failed before it was registered."""
        self.pending = max(0, self.pending - 1)
        self._drop_address(address)

    def admit(self, transport: asyncio.Transport) -> _Conn:
        """Register a connection :meth:`make_room` let in (and counted)."""
        self.pending = max(0, self.pending - 1)
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        conn = _Conn(transport, address, time.monotonic())
        self._conns[transport] = conn
        self._idle[transport] = conn
        return conn

    def _drop_address(self, address: str) -> None:
        self._per_address[address] -= 1
        if self._per_address[address] <= 0:
            del self._per_address[address]

    def _evict(self, address: str | None) -> bool:
        """Close the longest-idle connection (of ``address`` when given) whose response is flushed."""
        for conn in self._idle.values():
            if (address is None or conn.address == address) and not conn.transport.get_write_buffer_size():
                self.counts["evicted_idle"] += 1
                self._close(conn)
                return True
        return False

    def _close(self, conn: _Conn) -> None:
        self.release(conn)  # free its slot now: the transport reports connection_lost later
        shut(conn.transport)

    def release(self, conn: _Conn) -> None:
        if self._conns.pop(conn.transport, None) is None:
            return
        self._idle.pop(conn.transport, None)
        self._bodies.discard(conn)
        self._drop_address(conn.address)
        if conn.task is not None and not conn.task.done():
            conn.task.cancel()  # a GET (long-poll, download) nobody will read

    # --- requests --------------------------------------------------------------------------------
    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        # transport is None once the client left: it then finds no connection, as an unknown one would
        conn = self._conns.get(request.transport)  # type: ignore[arg-type]
        if conn is None:
            return await handler(request)
        self._idle.pop(conn.transport, None)
        conn.request = request
        conn.task = asyncio.current_task() if request.method in ("GET", "HEAD") else None
        declared = request.content_length or 0
        counted = declared >= _UPLOAD_MIN_BYTES and request.method in ("PUT", "POST")
        if request.body_exists and not request.content.is_eof():
            conn.last_bytes = time.monotonic()
            self._bodies.add(conn)
        proxied = forwarded_client(conn.address, request.headers, trust_forwarded_for=self.trust_forwarded_for)
        client = proxied or conn.address
        exempt = self.config.exempt_loopback and is_loopback(client)
        holding, reserved = False, 0
        try:
            if proxied is not None and not exempt:  # counted per forwarded client (see the module's docstring)
                if self._proxied[client] >= self.config.max_per_address:
                    return self._refuse_proxied(client)
                self._proxied[client] += 1
                holding = True
            if counted:
                refused = self._reserve_upload(client, exempt, declared)
                if refused is not None:
                    return refused
                reserved = declared
            return await handler(request)
        finally:
            if holding:
                _decrement(self._proxied, client)
            if reserved:
                self._uploads[""] -= reserved
                _decrement(self._uploads, client, reserved)
            self._bodies.discard(conn)
            conn.request, conn.task = None, None
            if conn.transport in self._conns:
                conn.idle_since = time.monotonic()
                self._idle[conn.transport] = conn

    def _refuse_proxied(self, client: str) -> web.Response:
        """A forwarded client already has ``max_per_address`` requests in progress."""
        self.counts["refused_per_address"] += 1
        response = web.json_response(
            {
                "error": "relay_busy",
                "message": f"{self._proxied[client]} requests from {client} are already in "
                "progress (connections.max_per_address)",
                "hint": "Retry in a few seconds (the toolkit does this on its own); one notebook needs two or three.",
            },
            status=503,
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
        response.force_close()  # a body it may carry is unread
        return response

    def _reserve_upload(self, client: str, exempt: bool, declared: int) -> web.Response | None:
        cap = (
            self.config.max_upload_bytes
            if exempt
            else min(self.config.max_upload_bytes, self.config.max_upload_bytes_per_address)
        )
        if declared > cap:  # could never fit, however long the peer waits: too large, not busy
            self.counts["refused_upload_bytes"] += 1
            response = web.json_response(
                {
                    "error": "body_too_large",
                    "message": f"an upload of {declared} bytes is more than this relay takes at once ({cap} bytes)",
                    "hint": "Upload the run's parameters in its codec; the organizer "
                    "can raise connections.max_upload_bytes(_per_address).",
                },
                status=413,
            )
            response.force_close()
            return response
        total, mine = self._uploads[""] + declared, self._uploads[client] + declared
        if total > self.config.max_upload_bytes or (not exempt and mine > self.config.max_upload_bytes_per_address):
            self.counts["refused_upload_bytes"] += 1
            response = web.json_response(
                {
                    "error": "relay_busy",
                    "message": f"{total} upload bytes would be in flight",
                    "hint": "Retry in a few seconds (the toolkit does this on its own).",
                },
                status=503,
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
            response.force_close()  # the unread body must not be parsed as the next request
            return response
        self._uploads[""] += declared
        self._uploads[client] += declared
        return None

    # --- timeouts --------------------------------------------------------------------------------
    async def run(self, period_s: float = 0.5) -> None:
        while True:
            await asyncio.sleep(period_s)
            self.sweep(time.monotonic())

    def sweep(self, now: float) -> None:
        """Close idle connections past ``idle_timeout_s``, cut bodies stalled past ``body_idle_timeout_s``."""
        while self._idle:
            conn = next(iter(self._idle.values()))
            if now - conn.idle_since < self.config.idle_timeout_s:
                break
            self.counts["idle_timeout"] += 1
            self._close(conn)
        for conn in list(self._bodies):
            request = conn.request
            if request is None or request.content.is_eof():
                self._bodies.discard(conn)
            elif not conn.transport.is_reading():  # the relay paused reading (back-pressure): not the peer's fault
                conn.last_bytes = now
            elif now - conn.last_bytes >= self.config.body_idle_timeout_s:
                self.counts["body_timeout"] += 1
                log.info(
                    "%s %s from %s: no body byte for %.0f s; connection cut",
                    request.method,
                    request.path,
                    conn.address,
                    now - conn.last_bytes,
                )
                self._close(conn)

    def stats(self) -> dict[str, int]:
        return {"open": len(self._conns), "capacity": self.capacity, "upload_bytes": self._uploads[""], **self.counts}


def _decrement(counter: Counter[str], key: str, amount: int = 1) -> None:
    counter[key] -= amount
    if counter[key] <= 0:
        del counter[key]
