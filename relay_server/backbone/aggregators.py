"""The relay's registry of extra aggregators: who registered at which URL, what each last
measured and reported, and whether it still counts as alive.

Kept apart from :mod:`.backbone`, which decides what the live ones own and calls them: this
module only admits aggregators (same protocol, a sliceable optimizer state, a reachable URL),
takes their heartbeats (their own link rates, and the transfers they served go to the planner's
measurements), and declares them dead -- when one falls silent past ``aggregators.ttl_s``, or
when the coordinator reports a failed call (:meth:`Aggregators.mark_dead`). A dead aggregator
stays listed a while (the dashboard shows it) and is forgotten once it owns no slice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from relay_server.core.config import RelayConfig
from relay_server.core.errors import ApiError
from relay_server.planning.policy import RELAY_ID, Planning
from toolkit.wire.protocol import (
    PROTOCOL_VERSION,
    AggregatorHeartbeat,
    AggregatorRegistration,
    AggregatorStatus,
    AggregatorWelcome,
    RunInfo,
)

log = logging.getLogger(__name__)


@dataclass
class Aggregator:
    aggregator_id: str
    name: str
    url: str
    last_seen: float = field(default_factory=time.monotonic)
    alive: bool = True
    upload: float = 0.0  # bytes/s it measured for itself (0 = not yet)
    download: float = 0.0
    step: int = -1
    plan_version: str = ""


class Aggregators(Mapping[str, Aggregator]):
    """The known aggregators by id (live and recently dead), in registration order."""

    def __init__(self, config: RelayConfig, planning: Planning, run_info: RunInfo, ticket_key: str) -> None:
        self.config, self.cfg, self.planning = config, config.aggregators, planning
        self.run_info, self.ticket_key = run_info, ticket_key
        self._by_id: dict[str, Aggregator] = {}

    def __getitem__(self, aggregator_id: str) -> Aggregator:
        return self._by_id[aggregator_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, agg: Aggregator) -> None:
        self._by_id[agg.aggregator_id] = agg

    def clear(self) -> None:
        self._by_id.clear()

    def register(self, req: AggregatorRegistration) -> AggregatorWelcome:
        if req.protocol != PROTOCOL_VERSION:
            raise ApiError(
                400,
                "protocol_mismatch",
                f"aggregator speaks protocol {req.protocol}, relay {PROTOCOL_VERSION}",
                "Install the same collabtrain version on both.",
            )
        if self.config.master_optimizer().state_bits != 32:  # local SGD: [optimizer] runs on the peers
            raise ApiError(
                409,
                "state_cannot_be_sliced",
                "8-bit optimizer state cannot be cut into slices",
                "Set optimizer.state_bits = 32 to add aggregators, or run the relay alone.",
            )
        if not req.url.startswith(("http://", "https://")):
            raise ApiError(
                422,
                "bad_url",
                "the aggregator URL must start with http:// or https://",
                "Pass --public-url with the address peers can reach.",
            )
        agg = Aggregator(
            aggregator_id=hashlib.sha256(f"{req.url}{time.time_ns()}".encode()).hexdigest()[:16],
            name=req.name,
            url=req.url.rstrip("/"),
        )
        self.add(agg)
        log.info("aggregator %s (%s) registered at %s", agg.name, agg.aggregator_id, agg.url)
        return AggregatorWelcome(
            aggregator_id=agg.aggregator_id,
            ticket_key=self.ticket_key,
            run=self.run_info,
            # what steps the master: local SGD's outer SGD, not the peers' inner optimizer
            optimizer=dataclasses.asdict(self.config.master_optimizer()),
            rounds=dataclasses.asdict(self.config.rounds),
            heartbeat_interval_s=self.cfg.heartbeat_interval_s,
        )

    def heartbeat(self, aggregator_id: str, hb: AggregatorHeartbeat) -> None:
        agg = self._by_id.get(aggregator_id)
        if agg is None or not agg.alive:
            raise ApiError(
                410,
                "aggregator_dropped",
                "this aggregator is not part of the run (it was declared dead, or the relay restarted)",
                "Register again (the aggregator does so itself).",
            )
        agg.last_seen, agg.step, agg.plan_version = time.monotonic(), hb.step, hb.plan_version
        agg.upload, agg.download = hb.upload, hb.download
        for t in hb.transfers:
            self.planning.peer_rates.add(t.peer_id, t.direction, t.step, t.nbytes, t.seconds)

    def mark_dead(self, aggregator_id: str, why: str) -> None:
        agg = self._by_id.get(aggregator_id)
        if agg is not None and agg.alive:
            agg.alive = False
            log.warning("aggregator %s (%s) is dead: %s", agg.name, aggregator_id, why)

    def excuse_silence(self, seconds: float) -> None:
        """The relay was deaf for ``seconds``: no aggregator's silence grows by them."""
        for agg in self._by_id.values():
            agg.last_seen += seconds

    def expire(self, owners: set[str]) -> None:
        """Declare the silent dead; forget the long dead that own none of ``owners``' slices."""
        now = time.monotonic()
        for agg in list(self._by_id.values()):
            if agg.alive and now - agg.last_seen > self.cfg.ttl_s:
                self.mark_dead(agg.aggregator_id, f"silent for {now - agg.last_seen:.1f}s")
            forget = now - agg.last_seen > max(60.0, 10 * self.cfg.ttl_s)  # the dashboard shows the dead a while
            if not agg.alive and forget and agg.aggregator_id not in owners:
                del self._by_id[agg.aggregator_id]

    def alive(self, owner_id: str) -> bool:
        """The relay always is; an aggregator until declared dead (or forgotten)."""
        return owner_id == RELAY_ID or (owner_id in self._by_id and self._by_id[owner_id].alive)

    def live(self) -> list[Aggregator]:
        return [a for a in self._by_id.values() if a.alive]

    def statuses(self) -> list[AggregatorStatus]:
        return [
            AggregatorStatus(
                aggregator_id=a.aggregator_id,
                name=a.name,
                url=a.url,
                alive=a.alive,
                last_seen_s=time.monotonic() - a.last_seen,
                upload=a.upload,
                download=a.download,
            )
            for a in self._by_id.values()
        ]
