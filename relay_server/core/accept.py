"""Descriptors and accepting connections, below the guard (:mod:`relay_server.core.connections`).

The soft ``RLIMIT_NOFILE`` of a stock VM is 1024: the relay raises it to the hard limit at start
(:func:`raise_descriptor_limit`). And it accepts connections itself (:class:`Acceptor`): CPython's
own accept loop (3.11) answers EMFILE by logging a traceback and scheduling a retry for *each* of
up to ``backlog`` failed accepts of one wake-up, so the retries multiply and the event loop spins
(two million failed accepts a minute were measured with 200 idle connections and a limit of 64).
Here a failed accept pauses accepting for half a second, once, and is reported once a minute;
and the guard decides on each connection *before* the next accept of a burst, freeing an evicted
connection's descriptor at once (:func:`shut`), so accepts rarely fail at all.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import socket
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)

ACCEPT_BURST = 128  # accepts per wake-up of the listening socket
ACCEPT_PAUSE_S = 0.5  # after a failed accept (out of descriptors)
LOG_EVERY_S = 60.0
RETRY_AFTER_S = 2
BUSY_BODY = (
    b'{"error": "relay_busy", "message": "the relay holds as many connections as it can", '
    b'"hint": "Retry in a few seconds (the toolkit does this on its own)."}'
)
BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: %d\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
) % (RETRY_AFTER_S, len(BUSY_BODY), BUSY_BODY)


class Admission(Protocol):
    """What the acceptor asks of the guard."""

    def make_room(self, address: str) -> bool:
        """Whether a connection from ``address`` may come in (then counted as pending)."""

    def unreserve(self, address: str) -> None:
        """A connection let in failed before it was registered."""


def raise_descriptor_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the descriptor limit from %d to %d (%s)", soft, target, exc)
            return soft, soft
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def open_descriptors() -> int:
    """Descriptors this process holds now (Linux: /proc/self/fd; elsewhere a cautious guess)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 64


class Acceptor:
    """Accepts connections on a listening socket for the guard, a bounded burst per wake-up.

    asyncio's own accept loop (CPython 3.11) handles EMFILE badly: it logs a traceback and
    schedules a retry for *each* of up to ``backlog`` failed accepts of one wake-up, so the
    retries multiply and the loop spins (millions of failed accepts a minute were measured).
    Here a failed accept pauses accepting for half a second, once, and is counted quietly; and
    since the guard frees an evicted connection's descriptor at once, accepts rarely fail."""

    def __init__(self, guard: Admission, sock: socket.socket, factory: Callable[[], asyncio.Protocol]) -> None:
        self.guard, self.sock, self.factory = guard, sock, factory
        self.loop = asyncio.get_running_loop()
        self.failed, self._logged, self._closed = 0, 0.0, False
        self.tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        if not self._closed:
            self.loop.add_reader(self.sock.fileno(), self._accept)

    def close(self) -> None:
        self._closed = True
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()

    def _accept(self) -> None:
        for _ in range(ACCEPT_BURST):
            try:
                conn, peer = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                self._out_of_resources(exc)
                return
            conn.setblocking(False)
            address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
            if not self.guard.make_room(address):  # decided here, before the next accept of the burst
                try:
                    conn.recv(1 << 16)  # what already arrived: closing with unread bytes sends a reset
                except OSError:
                    pass
                try:
                    conn.send(BUSY)
                except OSError:
                    pass
                conn.close()
                continue
            task = self.loop.create_task(self._attach(conn, address))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _attach(self, conn: socket.socket, address: str) -> None:
        try:
            await self.loop.connect_accepted_socket(self.factory, conn)
        except OSError:
            self.guard.unreserve(address)
            conn.close()

    def _out_of_resources(self, exc: OSError) -> None:
        self.loop.remove_reader(self.sock.fileno())
        self.loop.call_later(ACCEPT_PAUSE_S, self.start)
        self.failed += 1
        now = time.monotonic()
        if now - self._logged >= LOG_EVERY_S:
            log.warning(
                "cannot accept connections (%s): %d failed accept(s) since the last report, each followed "
                "by a %.1f s pause. Raise the hard descriptor limit (ulimit -Hn, LimitNOFILE=) or lower "
                "connections.max_connections.",
                exc,
                self.failed,
                ACCEPT_PAUSE_S,
            )
            self.failed, self._logged = 0, now


def shut(transport: asyncio.Transport) -> None:
    """Abort ``transport`` and free its descriptor now, not on the next loop iteration: the loop
    accepts a burst of connections in one iteration, and each eviction must make room for the
    next accept of the same burst (else accept() itself fails with EMFILE)."""
    transport.abort()
    sock = getattr(transport, "_sock", None)  # asyncio's selector transport; absent elsewhere
    if isinstance(sock, socket.socket):
        sock.close()  # already out of the selector (abort); the transport's own close is then a no-op
