"""What a local SGD run adds to the relay's report about itself: its outer loop.

The collaboration's report (``GET /api/status``, the dashboard, the observers' step events) is
the rounds'. A local SGD run adds the outer round and the inner budget, each peer's inner steps and
busy fraction as its last heartbeat said, their mean, and the mean inner steps behind the last
round's pseudo-gradients (W&B logs the last two as ``local_sgd/busy_fraction`` and
``local_sgd/inner_steps`` from the step event's report). The feature amends the report with them
(:attr:`relay_server.api.feature.Feature.amends_report`), so the core's status names no mode.
"""

from __future__ import annotations

import dataclasses

from relay_server.collaboration.machine import Collaboration
from relay_server.core.config import RelayConfig
from toolkit.wire.protocol import LocalSgdStatus, StatusReport


class OuterLoopFigures:
    """The local SGD feature's running part: it reads the collaboration's peer registry and round
    cycle when a report is made, and owns nothing (so :meth:`start` and :meth:`stop` have nothing to do)."""

    def __init__(self, config: RelayConfig, collab: Collaboration) -> None:
        self.section, self.collab = config.local_sgd, collab

    @classmethod
    async def build(cls, config: RelayConfig, collab: Collaboration) -> OuterLoopFigures:
        return cls(config, collab)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def amend(self, report: StatusReport) -> StatusReport:
        """``report`` with the outer loop's figures and each online peer's inner steps and busy fraction."""
        registry = self.collab.registry
        busy = [p.busy_fraction for p in registry.peers.values() if p.busy_fraction is not None]
        peers = []
        for row in report.peers:
            peer = registry.get(row.peer_id)
            if peer is not None:
                row = dataclasses.replace(row, inner_steps=peer.inner_steps, busy_fraction=peer.busy_fraction)
            peers.append(row)
        outer = LocalSgdStatus(
            outer_round=report.step,
            inner_steps=self.section.inner_steps,
            inner_seconds=self.section.inner_seconds,
            busy_fraction=sum(busy) / len(busy) if busy else None,
            inner_steps_last_round=self.collab.rounds.inner_steps_last_round,
        )
        return dataclasses.replace(report, peers=peers, local_sgd=outer)
