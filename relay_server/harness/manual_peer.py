"""A peer of a run driven by hand, for tests and benchmarks that write a peer's requests themselves.

:class:`ManualPeer` joins, heartbeats every 0.2 s on a thread (an idle report: it trains nothing),
and sends any route of its own with :meth:`ManualPeer.request`: a hostile expert host, a trainer
whose expert calls a test or a benchmark makes itself. It is handed the client it speaks through,
already built (and logged in, on an hf-mode run) by its caller: the relay side never imports the
peer side, so the HTTP client and its keys stay the toolkit's (the type below is only read by
type checkers).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from toolkit.wire.protocol import PROTOCOL_VERSION, ROUTES, Heartbeat, JoinRequest

if TYPE_CHECKING:
    import requests

    from toolkit.client import RelayClient


class ManualPeer:
    """One joined peer of the run at ``client``'s relay; :meth:`close` stops its heartbeats and
    closes the client (it does not leave: the relay expires it, as it would a vanished peer)."""

    def __init__(self, client: RelayClient, name: str) -> None:
        self.client = client
        self.peer_id = client.join(JoinRequest(peer_name=name, protocol=PROTOCOL_VERSION)).peer_id
        self._stop = threading.Event()
        threading.Thread(target=self._beat, daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.wait(0.2):
            self.client.heartbeat(self.peer_id, Heartbeat(version=0, samples=0, samples_per_s=0.0))

    def request(self, method: str, route: str, **kwargs: Any) -> requests.Response:
        """``method ROUTES[route]`` for this peer (``uid``/``task_id`` fill the route's fields)."""
        fmt = {k: kwargs.pop(k) for k in ("uid", "task_id") if k in kwargs}
        return self.client.transport.request(method, ROUTES[route].format(peer_id=self.peer_id, **fmt), **kwargs)

    def close(self) -> None:
        self._stop.set()
        self.client.close()
