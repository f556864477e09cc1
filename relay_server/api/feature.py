"""What a feature the relay plugs in (DMoE, the pipeline, local SGD, evaluation) gives :func:`create_app`.

The core relay -- rounds, parameters, auth, shards -- knows no feature by name: ``create_app``
iterates the :class:`FeatureSet` of :data:`relay_server.api.app.FEATURES`. Each :class:`Feature` names its config
section, its routes (with the public ones, the streamed-container bodies and their limits), the
service it runs, built outside HTTP from the config and the collaboration's shared services,
started and stopped by the app's lifespan, what it adds to ``GET /api/status``, and (a mode)
when the collaboration's rounds open. A feature whose service makes the run's steps itself (the
pipeline) also says what stands in for the rounds' figures -- the mode's name, the step's
progress, each peer's credit, whether the averaging plan applies -- in status, the peers' progress
and the observers' step events (``figures``; :class:`~relay_server.collaboration.status.RunFigures`).
A feature that keeps the rounds but adds figures of its own (local SGD's outer loop) amends the
collaboration's report instead (``amends_report``), and one whose peers need to know of it says
what a joining peer learns (``run_info``).

A feature that must serve part of a core route registers a *takeover* under one of the names
below; the core route hands such requests to whichever running feature took it, without naming
it (the pipeline serves ticketed stage gradients and stage slices this way).

Routes are registered whether the run enables the feature or not: a disabled feature's routes
answer 404 with the config field that enables it (:func:`relay_server.api.context.enabled`).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from relay_server.api.context import COLLAB, CONFIG
from relay_server.collaboration.machine import Collaboration
from relay_server.collaboration.opening import OpeningRule
from relay_server.collaboration.status import RunFigures
from relay_server.core.config import RelayConfig
from toolkit.wire.protocol import StatusReport

TICKETED_GRADIENT = "ticketed_gradient"
"""``PUT ROUTES["gradient"]`` with a ticket: a slice for the owner the ticket names."""
SLICE_PARAMS = "slice_params"
"""``GET ROUTES["params"]`` with ``start``/``end``: one slice of a version."""
TAKEOVERS = frozenset({TICKETED_GRADIENT, SLICE_PARAMS})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Route = tuple[str, str, Handler]


class Service(Protocol):
    """A feature's running part: built before the relay serves, stopped when it stops."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class Takeover(Protocol):
    """A feature's handler of a core route: the request, and its running service by keyword."""

    def __call__(self, request: web.Request, *, service: Any) -> Awaitable[web.StreamResponse]: ...


@dataclass(frozen=True)
class PeerPlaces:
    """What a feature knows of peers that the registry does not: the experts each host serves,
    the stage each worker runs (``GET /api/status`` places its peers with them)."""

    experts_hosted: Mapping[str, int] = field(default_factory=dict)
    stage_of: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Feature:
    """One capability the relay plugs in; every hook but ``name``/``section``/``enabled`` optional."""

    name: str
    section: str
    """Its ``RelayConfig`` section (``[moe]``, ``[pipeline]``...), whose ``checks()`` the config
    runs when it loads (:mod:`relay_server.core.config`): a run that cannot combine fails there."""
    enabled: Callable[[RelayConfig], bool]
    key: web.AppKey[Any] | None = None
    """Where the running service lives in the app (absent: the run does not enable it)."""
    build: Callable[[RelayConfig, Collaboration], Awaitable[Service | None]] | None = None
    """The service, from the config and the collaboration's shared services (store, backbone,
    registry, clock, the after-publish sequence): called once, before the relay serves (None:
    nothing of it runs, e.g. no evaluator among the observers)."""
    routes: tuple[Route, ...] = ()
    public: frozenset[str] = frozenset()
    """Paths anyone may read without a pass (a dashboard panel's data)."""
    binary_routes: frozenset[tuple[str, str]] = frozenset()
    """(method, path) whose body is a small tensor container, signed whole."""
    container_limits: Mapping[tuple[str, str], Callable[[Any], int]] = field(default_factory=dict)
    """(method, path) whose body is a streamed container -> its byte limit given the service
    (None when the run does not enable the feature)."""
    takeovers: Mapping[str, Takeover] = field(default_factory=dict)
    """Core route name (:data:`TAKEOVERS`) -> the handler that serves it for this feature's service."""
    opening: Callable[[RelayConfig], OpeningRule] | None = None
    """When the collaboration's rounds open on a run that enables it (at most one enabled feature
    says; absent from all: sync's target batch)."""
    status: Callable[[Any], dict[str, Any]] | None = None
    """The ``StatusReport`` fields its dashboard panel reads, from the service."""
    places: Callable[[Any], PeerPlaces] | None = None
    keeps_parameters: bool = False
    """Its service keeps the run's parameters across relay restarts (the pipeline's stage owners
    each resume from their own store): the collaboration then restores no version of its own."""
    figures: Callable[[Any], RunFigures] | None = None
    """A feature whose service makes the steps: its figures, from the service, in place of the
    rounds' (at most one enabled feature has them, as at most one says when rounds open)."""
    amends_report: Callable[[Any, StatusReport], StatusReport] | None = None
    """What it adds to the collaboration's own report, from the service: ``GET /api/status`` and
    the observers' step events alike (local SGD's outer loop, which W&B logs)."""
    run_info: Callable[[RelayConfig], Mapping[str, Any]] | None = None
    """``RunInfo`` fields a joining peer needs from it (local SGD's inner budget, the pipeline's
    stages), from the config: the collaboration adds them to the run it describes."""


RUNNING = web.AppKey("features", dict)
"""The enabled features' services, by feature name, while the app runs."""
TAKEN_OVER = web.AppKey("taken_over", dict)
"""Core route name -> the handler a running feature serves it with (:data:`TAKEOVERS`)."""


class FeatureSet:
    """The features one app plugs in: what ``create_app`` registers, starts and reports from."""

    def __init__(self, features: tuple[Feature, ...]) -> None:
        seen: dict[str, str] = {}
        for feature in features:
            for name in feature.takeovers:
                if name not in TAKEOVERS:
                    raise ValueError(f"feature {feature.name!r} takes over {name!r}: not one of {sorted(TAKEOVERS)}")
                if name in seen:
                    raise ValueError(f"features {seen[name]!r} and {feature.name!r} both take over {name!r}")
                seen[name] = feature.name
        self.features = features
        self.routes = tuple(route for f in features for route in f.routes)
        """Enabled or not: a disabled feature's routes say how to enable it."""
        self.public = frozenset(path for f in features for path in f.public)
        self.binary_routes = frozenset(route for f in features for route in f.binary_routes)

    def opening(self, config: RelayConfig) -> OpeningRule | None:
        """The round-opening rule of the enabled feature that has one (None: sync's default)."""
        rules = [(f.name, f.opening(config)) for f in self.features if f.opening is not None and f.enabled(config)]
        if len(rules) > 1:  # the config's compatibility checks refuse such a run first; this is the backstop
            raise ValueError(f"features {[name for name, _ in rules]} each decide when rounds open: enable one")
        return rules[0][1] if rules else None

    def run_info(self, config: RelayConfig) -> dict[str, Any]:
        """The ``RunInfo`` fields the enabled features add (:attr:`Feature.run_info`)."""
        fields: dict[str, Any] = {}
        for feature in self.features:
            if feature.run_info is not None and feature.enabled(config):
                fields |= feature.run_info(config)
        return fields

    def keep_parameters(self, config: RelayConfig) -> bool:
        """Whether an enabled feature keeps the run's parameters itself (:attr:`Feature.keeps_parameters`)."""
        return any(f.keeps_parameters and f.enabled(config) for f in self.features)

    def container_limits(self, app: web.Application) -> dict[tuple[str, str], Callable[[], int]]:
        """Each streamed-container route -> its byte limit now (from the running service, or
        what the feature allows while the run does not enable it)."""

        def limit(feature: Feature, of: Callable[[Any], int]) -> Callable[[], int]:
            return lambda: of(app[RUNNING].get(feature.name) if RUNNING in app else None)

        return {route: limit(f, of) for f in self.features for route, of in f.container_limits.items()}

    async def lifespan(self, app: web.Application) -> AsyncIterator[None]:
        """Build and start every enabled feature's service (in order) with the core routes it
        takes over; stop them in reverse order."""
        config, running, taken, started = app[CONFIG], app[RUNNING], app[TAKEN_OVER], []
        amendments: list[Callable[[StatusReport], StatusReport]] = []
        try:
            for feature in self.features:
                if feature.build is None or not feature.enabled(config):
                    continue
                service = await feature.build(config, app[COLLAB])
                if service is None:
                    continue
                if feature.key is not None:
                    app[feature.key] = service
                running[feature.name] = service
                taken.update(
                    {name: functools.partial(handler, service=service) for name, handler in feature.takeovers.items()}
                )
                await service.start()
                started.append(service)
                if feature.figures is not None:
                    app[COLLAB].report_figures_from(functools.partial(feature.figures, service))
                if feature.amends_report is not None:
                    amendments.append(functools.partial(feature.amends_report, service))
            app[COLLAB].amend_reports_with(*amendments)
            yield
        finally:
            app[COLLAB].report_figures_from(lambda: None)
            app[COLLAB].amend_reports_with()
            for service in reversed(started):
                await service.stop()

    def status(self, app: web.Application) -> tuple[dict[str, Any], PeerPlaces]:
        """The ``StatusReport`` fields the running features fill, and where they place peers."""
        fields: dict[str, Any] = {}
        hosted: dict[str, int] = {}
        stage_of: dict[str, int] = {}
        for feature in self.features:
            service = app[RUNNING].get(feature.name)
            if service is None:
                continue
            fields |= feature.status(service) if feature.status is not None else {}
            places = feature.places(service) if feature.places is not None else PeerPlaces()
            hosted |= places.experts_hosted
            stage_of |= places.stage_of
        return fields, PeerPlaces(experts_hosted=hosted, stage_of=stage_of)
