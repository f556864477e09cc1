"""``GET /api/tokenizer``: the run's ``tokenizer.json``, and its sha256 and objective in RunInfo.

The file is read once when the relay starts and checked against the sha256 the configuration
computed (:mod:`relay_server.core.run_data`), so a file edited under a running relay is never
served; peers check the same sha256 (``RelayClient.get_tokenizer``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from relay_server.api.context import COLLAB, CONFIG
from relay_server.core.config import ConfigError
from relay_server.core.errors import ApiError
from toolkit.wire.protocol import ROUTES as PATHS

TOKENIZER = web.AppKey("tokenizer", bytes)


async def get_tokenizer(request: web.Request) -> web.Response:
    data = request.app.get(TOKENIZER)
    if data is None:
        raise ApiError(
            404,
            "no_tokenizer",
            "this run has no tokenizer",
            'The organizer adds [tokenizer] file = "tokenizer.json" to the run\'s config.',
        )
    return web.Response(body=data, content_type="application/json")


ROUTES = [("GET", PATHS["tokenizer"], get_tokenizer)]


async def lifespan(app: web.Application) -> AsyncIterator[None]:
    """Load the file; put its sha256 and the objective into the run peers receive."""
    config = app[CONFIG]
    if config.tokenizer.file:
        data = Path(config.tokenizer.file).read_bytes()
        if hashlib.sha256(data).hexdigest() != config.tokenizer.sha256:
            raise ConfigError(f"tokenizer.file {config.tokenizer.file} changed after the configuration was read")
        app[TOKENIZER] = data
    collab = app[COLLAB]
    collab.run_info = dataclasses.replace(
        collab.run_info, tokenizer_sha256=config.tokenizer.sha256, objective=dict(config.objective)
    )
    yield
