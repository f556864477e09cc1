"""``[evaluation]`` as a feature the relay plugs in: the held-out scores on the dashboard.

The evaluator itself is an observer (:mod:`relay_server.observers.evaluation`): built with the
others from the config before the collaboration, fed step events by the observers' thread, scoring
in a process of its own, closed with the observers. What this feature adds to the app is its
panel: the evaluator's recent records in ``GET /api/status`` (``evaluations``), read under the
evaluator's own lock, so a status request never waits on scoring.
"""

from __future__ import annotations

from typing import Any

from relay_server.api.feature import Feature
from relay_server.collaboration.machine import Collaboration
from relay_server.core.config import RelayConfig


class EvaluationPanel:
    """The running evaluator, as the app sees it. Started and stopped by the observers' thread
    (which owns it), so :meth:`start` and :meth:`stop` have nothing to do."""

    def __init__(self, evaluator: Any) -> None:
        self.evaluator = evaluator

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def status(self) -> dict[str, Any]:
        return {"evaluations": self.evaluator.status_records()}


async def build(config: RelayConfig, collab: Collaboration) -> EvaluationPanel | None:
    """The evaluator among the run's observers (the one that keeps records for the dashboard)."""
    evaluator = next((o for o in collab.observers.observers if hasattr(o, "status_records")), None)
    return EvaluationPanel(evaluator) if evaluator is not None else None


FEATURE = Feature(
    name="evaluation",
    section="evaluation",
    enabled=lambda config: config.evaluation.enabled,
    build=build,
    status=EvaluationPanel.status,
)
