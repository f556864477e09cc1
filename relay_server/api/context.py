"""What every route module needs from a request: the app's keys and the peer-ownership check.

Kept apart from :mod:`relay_server.api.app` so route modules (shards, the app's own handlers)
import it without importing the app that gathers them."""

from __future__ import annotations

from aiohttp import web

from relay_server.auth.verify import IDENTITY_KEY
from relay_server.collaboration.machine import Collaboration
from relay_server.core.config import RelayConfig
from relay_server.core.errors import ApiError

COLLAB = web.AppKey("collaboration", Collaboration)
CONFIG = web.AppKey("config", RelayConfig)


def collab(request: web.Request) -> Collaboration:
    return request.app[COLLAB]


def own_peer(request: web.Request, peer_id: str) -> str:
    """A peer id acts only for the user who joined with it: otherwise alice could heartbeat,
    leave or upload as bob. (Open mode has no users to tell apart.)"""
    identity = request.get(IDENTITY_KEY)
    if identity is not None and collab(request).peer(peer_id).username != identity["username"]:
        raise ApiError(403, "not_your_peer", "this peer id belongs to another user",
                       "Use the peer id your own join returned.")
    return peer_id
