"""What the relay solves the plan from, and when: measurements, never declarations.

Inputs of :func:`relay_server.planning.planner.solve_plan`:

* the relay itself: a receiver with no compute, at the rates it measured serving transfers;
* each live aggregator: a receiver with no compute, at the rates it reported measuring;
* each online peer that computes: its samples/s from its heartbeats (smoothed here), its upload
  and download rates from the transfers the relay and the aggregators served it, client-mode
  (it never aggregates) and pinned to compute (volunteers are never told to stop).

A link nobody measured yet gets ``aggregators.default_bandwidth_mbps``; :class:`PlanInput`
says which numbers are measured. The LP is re-solved when membership changes (at most once a
second) or an input moves by more than ``replan_change`` (at most every ``replan_interval_s``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from typing import Any, Literal

from relay_server.core.config import AggregatorsSection
from relay_server.planning.averaging_plan import Plan
from relay_server.planning.measure import Ewma, PeerRates, ServerMeter
from relay_server.planning.planner import solve_plan
from relay_server.planning.problem import PeerCapacity, PlanError
from toolkit.wire.protocol import PlanInput

log = logging.getLogger(__name__)

RELAY_ID = "relay"


class Planning:
    def __init__(self, cfg: AggregatorsSection, num_params: int, target_batch: int) -> None:
        self.cfg, self.num_params, self.target_batch = cfg, num_params, target_batch
        self.peer_rates = PeerRates()  # from every server's transfers
        self.meter = ServerMeter()  # the relay's own link
        self.samples_per_s: dict[str, Ewma] = {}
        self.inputs: list[PlanInput] = []  # of the latest solve
        self.solved_at = 0.0
        self._last_solve = -math.inf
        self._last_membership: tuple[object, ...] = ()
        self._last_values: dict[str, tuple[float, float, float]] = {}

    # --- measurements -----------------------------------------------------------------------------
    def record_transfer(self, peer_id: str, direction: str, step: int, nbytes: int, started: float) -> None:
        """A transfer the relay itself served (a gradient upload or a parameter download)."""
        seconds = max(time.monotonic() - started, 1e-6)
        self.meter.record(direction, step, nbytes, started)
        if peer_id:
            self.peer_rates.add(peer_id, direction, step, nbytes, seconds)

    def observe_samples_per_s(self, peer_id: str, rate: float) -> None:
        self.samples_per_s.setdefault(peer_id, Ewma()).add(rate)

    def forget_peer(self, peer_id: str) -> None:
        self.samples_per_s.pop(peer_id, None)
        self.peer_rates.forget(peer_id)

    # --- the LP -----------------------------------------------------------------------------------
    def capacities(
        self, aggregators: Iterable[Any], peer_ids: Iterable[str]
    ) -> tuple[list[PeerCapacity], list[PlanInput]]:
        """The LP's input: the relay, the live ``aggregators`` and the computing ``peer_ids``."""
        prior = self.cfg.default_bandwidth_mbps * 125_000.0
        caps, inputs = [], []

        def add(
            node_id: str, name: str, role: Literal["relay", "aggregator", "peer"], sps: float, up: float, down: float
        ) -> None:
            receives = role != "peer"
            caps.append(
                PeerCapacity(node_id, sps, up or prior, down or prior, receives, computes=None if receives else True)
            )
            inputs.append(
                PlanInput(
                    node_id=node_id,
                    name=name,
                    role=role,
                    samples_per_s=sps,
                    upload=up or prior,
                    download=down or prior,
                    upload_source="measured" if up else "prior",
                    download_source="measured" if down else "prior",
                )
            )

        add(RELAY_ID, RELAY_ID, "relay", 0.0, self.meter.upload.value, self.meter.download.value)
        for agg in sorted(aggregators, key=lambda a: a.aggregator_id):
            add(agg.aggregator_id, agg.name, "aggregator", 0.0, agg.upload, agg.download)
        for peer_id in sorted(peer_ids):
            rate = self.samples_per_s.get(peer_id)
            if rate is not None and rate.value > 0:
                up, down = self.peer_rates.up.get(peer_id), self.peer_rates.down.get(peer_id)
                add(peer_id, peer_id[:8], "peer", rate.value, up.value if up else 0.0, down.value if down else 0.0)
        return caps, inputs

    def due(self, caps: list[PeerCapacity], now: float) -> bool:
        """Whether ``caps`` differ materially from the last solve's, and the rate limit allows."""
        membership = tuple(sorted((c.peer_id, c.can_receive) for c in caps))
        values = {c.peer_id: (c.samples_per_s, c.upload, c.download) for c in caps}
        joined_or_left = membership != self._last_membership
        moved = any(_rel_change(v, self._last_values.get(k)) > self.cfg.replan_change for k, v in values.items())
        interval = 1.0 if joined_or_left else self.cfg.replan_interval_s
        if not (joined_or_left or moved) or now - self._last_solve < interval:
            return False
        self._last_solve, self._last_membership, self._last_values = now, membership, values
        return True

    def solve(self, caps: list[PeerCapacity], inputs: list[PlanInput]) -> Plan | None:
        try:
            plan = solve_plan(caps, self.num_params, self.target_batch)
        except PlanError as exc:
            log.info("no plan yet: %s", exc)
            return None
        self.inputs, self.solved_at = inputs, time.time()
        log.info(
            "plan %s (%.3g steps/s): %s",
            plan.version,
            plan.steps_per_s,
            ", ".join(f"{k[:8]}={v:.3f}" for k, v in sorted(plan.fractions.items())),
        )
        return plan


def _rel_change(now: tuple[float, ...], before: tuple[float, ...] | None) -> float:
    if before is None:
        return math.inf
    return max(abs(a - b) / max(abs(b), 1e-9) for a, b in zip(now, before))
