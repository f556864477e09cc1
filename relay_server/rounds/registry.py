"""Who is online, on which parameter version, with how many unsent samples.

A peer is alive while it heartbeats within ``ttl`` seconds *or* has a request in flight (a
volunteer on a slow uplink may spend minutes uploading one gradient; that is not silence).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from toolkit.wire.protocol import Heartbeat


@dataclass
class Peer:
    peer_id: str
    name: str
    username: str
    device: dict[str, Any]
    precision: str | None
    joined_at: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)
    version: int = 0
    samples: int = 0  # accumulated on `version`, not yet uploaded (the latest report)
    claimable: int = 0  # the most reported since the last upload: caps an upload's weight
    samples_per_s: float = 0.0
    inflight: int = 0
    first_contribution_s: float | None = None  # join -> first accepted gradient

    @property
    def device_label(self) -> str:
        return str(self.device.get("name") or self.device.get("kind") or "unknown")


class Registry:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.peers: dict[str, Peer] = {}

    def add(self, peer: Peer) -> Peer:
        self.peers[peer.peer_id] = peer
        return peer

    def get(self, peer_id: str) -> Peer | None:
        return self.peers.get(peer_id)

    def touch(self, peer: Peer) -> None:
        peer.last_seen = time.monotonic()

    def report(self, peer: Peer, hb: Heartbeat) -> None:
        peer.version, peer.samples, peer.samples_per_s = hb.version, hb.samples, hb.samples_per_s
        peer.claimable = max(peer.claimable, hb.samples)
        self.touch(peer)

    def remove(self, peer_id: str) -> Peer | None:
        return self.peers.pop(peer_id, None)

    def expire(self, now: float | None = None) -> list[Peer]:
        """Drop peers that went silent; returns them so their round share can be released."""
        now = time.monotonic() if now is None else now
        gone = [p for p in self.peers.values() if p.inflight == 0 and now - p.last_seen > self.ttl_s]
        for peer in gone:
            del self.peers[peer.peer_id]
        return gone

    def eligible(self, step: int, max_staleness: int) -> list[Peer]:
        """Peers whose unsent samples may still count toward round ``step``."""
        return [p for p in self.peers.values() if p.samples > 0 and 0 <= step - p.version <= max_staleness]

    def collected(self, step: int, max_staleness: int) -> int:
        return sum(p.samples for p in self.eligible(step, max_staleness))

    def samples_per_s(self) -> float:
        return sum(p.samples_per_s for p in self.peers.values())
