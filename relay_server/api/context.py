"""What every route module needs from a request: the app's keys and the peer-ownership check.

Kept apart from :mod:`relay_server.api.app` so route modules (shards, the app's own handlers)
import it without importing the app that gathers them."""

from __future__ import annotations

from typing import TypeVar

from aiohttp import web

from relay_server.auth.verify import IDENTITY_KEY
from relay_server.collaboration.machine import Collaboration
from relay_server.core.config import RelayConfig
from relay_server.core.errors import ApiError, unknown_peer

T = TypeVar("T")
COLLAB = web.AppKey("collaboration", Collaboration)
CONFIG = web.AppKey("config", RelayConfig)


def collab(request: web.Request) -> Collaboration:
    return request.app[COLLAB]


def owner_of(collaboration: Collaboration, peer_id: str) -> str:
    """The username that joined with ``peer_id``: the live registry first, then the peers the
    store remembers (departed, or from before a restart). A pure read: it re-admits nobody and
    refreshes no last-seen time, so a request refused by :func:`own_peer` has had no effect."""
    peer = collaboration.registry.get(peer_id)
    if peer is not None:
        return peer.username
    known = collaboration.store.known_peer(peer_id)
    if known is None:
        raise unknown_peer(peer_id)
    return known[1]


def own_peer(request: web.Request, peer_id: str) -> str:
    """A peer id acts only for the user who joined with it: otherwise alice could heartbeat,
    leave or upload as bob. (Open mode has no users to tell apart.)

    Authorization comes before any effect: every peer-scoped handler calls this before it
    touches the registry, a round, a lease or a counter, and this check itself changes nothing
    (``tests/test_hostile_peers.py`` snapshots the whole state around a refused request on every
    peer-scoped route)."""
    identity = request.get(IDENTITY_KEY)
    if identity is not None and owner_of(collab(request), peer_id) != identity["username"]:
        raise ApiError(
            403, "not_your_peer", "this peer id belongs to another user", "Use the peer id your own join returned."
        )
    return peer_id


def enabled(request: web.Request, key: web.AppKey[T], code: str, what: str, hint: str) -> T:
    """The app's state under ``key`` (a feature's: DMoE, the pipeline), or 404 ``code`` when the
    run does not enable it."""
    value = request.app.get(key)
    if value is None:
        raise ApiError(404, code, what, hint)
    return value
