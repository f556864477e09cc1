"""``GET /api/toolkit`` and ``GET /toolkit/<wheel>``: the toolkit this relay runs, for notebooks to pin.

At start the relay writes the wheel of its own installed toolkit into ``<data_dir>/toolkit/``
(:mod:`relay_server.core.distribution`; the same bytes as last time are left untouched) and
keeps its sha256. ``relay-server notebook`` asks ``/api/toolkit`` for the file name, its sha256
and the extras the run needs, and writes them into the organizer's notebook; the notebook's pip
fetches ``/toolkit/<wheel>`` and refuses any other bytes. The file is read from disk on every
request, on purpose: the relay never claims bytes it does not serve, so a file changed on disk is
what pip receives and what its hash check catches. Only that one file name is served; anything
else is a 404.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from relay_server.api.context import CONFIG
from relay_server.core.distribution import TOOLKIT_INFO_PATH, WHEEL_PREFIX, ToolkitWheel, ensure_wheel
from relay_server.core.errors import ApiError
from relay_server.core.http import json_ok
from relay_server.core.typed import ConfigError

log = logging.getLogger(__name__)

WHEEL_PATH = WHEEL_PREFIX + "{filename}"
WHEEL = web.AppKey("toolkit_wheel", ToolkitWheel)


def _wheel(request: web.Request) -> ToolkitWheel:
    wheel = request.app.get(WHEEL)
    if wheel is None:
        raise ApiError(
            404,
            "no_toolkit_wheel",
            "this relay could not build its toolkit wheel (see its log)",
            "The organizer installs collabtrain on the relay (pip install -e . in a checkout, or the "
            "release wheel) and restarts it.",
        )
    return wheel


async def get_toolkit_info(request: web.Request) -> web.Response:
    wheel = _wheel(request)
    return json_ok(
        {
            "wheel": wheel.filename,
            "sha256": wheel.sha256,
            "version": wheel.version,
            "url": WHEEL_PREFIX + wheel.filename,
            "extras": request.app[CONFIG].volunteer_extras(),
        }
    )


async def get_wheel(request: web.Request) -> web.Response:
    wheel = _wheel(request)
    if request.match_info["filename"] != wheel.filename:  # the only name served: no path is ever joined
        raise ApiError(
            404,
            "no_such_file",
            f"this relay serves only {WHEEL_PREFIX}{wheel.filename}",
            f"Ask {TOOLKIT_INFO_PATH} for the current file name, or get a fresh notebook from the organizer.",
        )
    try:
        data = await asyncio.to_thread(wheel.path.read_bytes)
    except OSError:
        raise ApiError(
            404,
            "no_toolkit_wheel",
            f"{wheel.filename} is missing from the relay's data dir",
            "The organizer restarts the relay, which writes it again.",
        ) from None
    return web.Response(body=data, content_type="application/zip", headers={"Cache-Control": "no-cache"})


ROUTES = [("GET", TOOLKIT_INFO_PATH, get_toolkit_info), ("GET", WHEEL_PATH, get_wheel)]
PUBLIC = frozenset({TOOLKIT_INFO_PATH, WHEEL_PATH})
"""pip and ``relay-server notebook`` fetch these without a login."""


async def lifespan(app: web.Application) -> AsyncIterator[None]:
    """Write (or keep) the wheel under the data dir; a relay that cannot still trains."""
    directory = Path(app[CONFIG].server.data_dir) / "toolkit"
    try:
        wheel = await asyncio.to_thread(ensure_wheel, directory)
    except (ConfigError, OSError) as exc:
        log.warning("not serving the toolkit to notebooks: %s", exc)
    else:
        app[WHEEL] = wheel
        log.info("serving the toolkit as %s%s (sha256 %s)", WHEEL_PREFIX, wheel.filename, wheel.sha256)
    yield
