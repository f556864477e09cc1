"""A test-only hook that freezes the relay's event loop, to prove a stall costs time, not answers.

The loop-stall tests (tests/test_loop_stall.py) run a DMoE and a pipeline run through a relay
whose event loop blocks (``time.sleep``, nothing else runs) for a few seconds now and then, and
check that no expert call or task that met its deadline on the relay's clock fails and that no
request ends in an unhandled error (:mod:`relay_server.core.loop_clock`).

It is inert unless the relay *process* starts with the environment variable
``COLLABTRAIN_TEST_LOOP_STALL`` set, read once when the app is built: nothing a network client
sends can turn it on, change it or reach it (no route, no header, no config field), and a relay
started without the variable has no such middleware at all. Its value::

    COLLABTRAIN_TEST_LOOP_STALL="seconds=3,every=40,times=2,path=/calls/"

blocks the loop ``seconds`` in the handling of every ``every``-th request whose path matches the
regular expression ``path`` (searched, default ``/api/``), at most ``times`` times (default 1). A relay started with it says so
in a warning at startup. A malformed value ends the start in one line naming the field.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from relay_server.core.typed import ConfigError

log = logging.getLogger(__name__)
ENV = "COLLABTRAIN_TEST_LOOP_STALL"


@dataclass
class StallPlan:
    seconds: float
    every: int
    times: int = 1
    path: str = "/api/"


def parse(value: str) -> StallPlan:
    fields: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in value.split(","))):
        name, sep, text = part.partition("=")
        if not sep or name not in ("seconds", "every", "times", "path"):
            raise ConfigError(f"{ENV}: {part!r} is not one of seconds=, every=, times=, path=")
        fields[name] = text
    try:
        plan = StallPlan(
            seconds=float(fields["seconds"]),
            every=int(fields["every"]),
            times=int(fields.get("times", 1)),
            path=fields.get("path", "/api/"),
        )
    except KeyError as exc:
        raise ConfigError(f"{ENV}: {exc.args[0]}= is required (e.g. seconds=3,every=40)") from None
    except ValueError as exc:
        raise ConfigError(f"{ENV}: {exc}: seconds is a number, every and times are whole numbers") from None
    if not (0 < plan.seconds <= 60 and plan.every >= 1 and plan.times >= 1):
        raise ConfigError(f"{ENV}: seconds must be in (0, 60], every and times >= 1")
    try:
        re.compile(plan.path)
    except re.error as exc:
        raise ConfigError(f"{ENV}: path={plan.path!r} is not a regular expression ({exc})") from None
    return plan


def stall_middlewares(environ: dict[str, str] | None = None) -> list[Middleware]:
    """The stalling middleware when ``ENV`` is set (read here, once), else nothing."""
    value = (os.environ if environ is None else environ).get(ENV)
    if not value:
        return []
    plan = parse(value)
    log.warning(
        "TEST HOOK %s is set: the event loop blocks %.1f s in every %d-th request whose path matches %r, %d time(s). "
        "Never set it on a relay that serves a real run",
        ENV,
        plan.seconds,
        plan.every,
        plan.path,
        plan.times,
    )
    seen, done = 0, 0
    pattern = re.compile(plan.path)

    @web.middleware
    async def stall(request: web.Request, handler: Handler) -> web.StreamResponse:
        nonlocal seen, done
        if done < plan.times and pattern.search(request.path):
            seen += 1
            if seen % plan.every == 0:
                done += 1
                log.info(
                    "test hook: blocking the event loop %.1f s in %s %s", plan.seconds, request.method, request.path
                )
                time.sleep(plan.seconds)  # on purpose: the whole loop stops, as a starved machine's does
        return await handler(request)

    return [stall]
