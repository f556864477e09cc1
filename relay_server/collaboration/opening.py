"""When the next round opens: a rule the run's mode plugs into the round cycle.

The round cycle (:mod:`.round_cycle`) owns the open round and never asks which mode the run is
in: on every report it asks its :class:`OpeningRule` whether the round on version ``step`` is
due. Sync data parallelism's rule is :class:`TargetBatch` (the default); local SGD plugs in its
outer-round rule (:class:`relay_server.local_sgd.outer_rounds.OuterRoundRule`) and the pipeline
:class:`RoundsElsewhere`, each through its feature (:attr:`relay_server.api.feature.Feature.opening`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from relay_server.rounds.peer_registry import Registry


class OpeningRule(Protocol):
    def due(self, registry: Registry, step: int, ahead: int) -> bool:
        """Whether the round on ``step`` should open now; ``ahead``: samples the peers are
        computing now and will add before they see the round (``rounds.open_round = "projected"``)."""
        ...

    def published(self, step: int, contributors: Iterable[str]) -> None:
        """The round these peers contributed to produced ``step``."""
        ...


class TargetBatch:
    """Sync mode: once the eligible peers' unsent samples (plus ``ahead``) reach the target batch."""

    def __init__(self, target_batch: int, max_staleness: int) -> None:
        self.target_batch, self.max_staleness = target_batch, max_staleness

    def due(self, registry: Registry, step: int, ahead: int) -> bool:
        if registry.collected(step, self.max_staleness) + ahead < self.target_batch:
            return False  # the common case on every heartbeat: O(1), no scan of the registry
        return sum(p.samples for p in registry.eligible(step, self.max_staleness)) + ahead >= self.target_batch

    def published(self, step: int, contributors: Iterable[str]) -> None:
        pass


class RoundsElsewhere:
    """The collaboration opens no round: the feature that plugged this in opens its own (a
    pipeline's round opens when its batch is complete, :mod:`relay_server.pipeline`)."""

    def due(self, registry: Registry, step: int, ahead: int) -> bool:
        return False

    def published(self, step: int, contributors: Iterable[str]) -> None:
        pass
