"""Who is online, on which parameter version, with how many unsent samples.

A peer is alive while it heartbeats within ``ttl`` seconds *or* has a request in flight (a
volunteer on a slow uplink may spend minutes uploading one gradient; that is not silence). A
request in flight cannot keep a peer alive for ever: the connection guard cuts a body that
stops delivering bytes and cancels a long-poll whose client left (:mod:`relay_server.core.connections`),
and the TTL runs from there.

Every heartbeat asks how many samples the collaboration holds toward the next round: with a
thousand peers a scan per heartbeat is quadratic work per second, so the registry keeps the sums
(samples by parameter version, peers online by user) up to date as peers
report, join and leave. :meth:`Registry.set_samples` is the one way to change a peer's samples.
"""

from __future__ import annotations

import time
from collections import Counter
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
    batch: int = 0  # samples its last growing report added: what it adds per step (a micro-batch, or several)
    claimable: int = 0  # the most reported since the last upload: caps an upload's weight
    samples_per_s: float = 0.0  # its own report: shown as such, bounded (relay_server.rounds.throughput)
    accumulated: int = 0  # the samples its progress reports added up since it joined: what bounds that report
    inflight: int = 0
    first_contribution_s: float | None = None  # join -> first accepted gradient
    contributed: int = 0  # samples accepted since the relay (re)admitted it (the dashboard's column)
    # run.mode = "local_sgd", from the latest heartbeat: inner steps since its last outer
    # round, and the share of its training time spent computing (None: not measured yet)
    inner_steps: int = 0
    busy_fraction: float | None = None
    # (version, the most inner steps reported while holding samples on it): the inner steps behind the
    # pseudo-gradient it uploads, whatever it reports while uploading (it may already compute the next)
    held_steps: tuple[int, int] = (-1, 0)

    @property
    def device_label(self) -> str:
        return str(self.device.get("name") or self.device.get("kind") or "unknown")


class Registry:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.peers: dict[str, Peer] = {}
        self._by_version: Counter[int] = Counter()  # unsent samples by the version they were computed on
        self._batch_by_version: Counter[int] = Counter()  # Peer.batch of peers holding samples, by version
        self.online_by_user: Counter[str] = Counter()

    def add(self, peer: Peer) -> Peer:
        self.remove(peer.peer_id)
        self.peers[peer.peer_id] = peer
        self._by_version[peer.version] += peer.samples
        self.online_by_user[peer.username] += 1
        return peer

    def get(self, peer_id: str) -> Peer | None:
        return self.peers.get(peer_id)

    def touch(self, peer: Peer) -> None:
        peer.last_seen = time.monotonic()

    def report(self, peer: Peer, hb: Heartbeat) -> None:
        self._account(peer, -1)
        added = hb.samples - (peer.samples if hb.version == peer.version else 0)
        if added > 0:
            peer.batch = added
            peer.accumulated += added
        peer.version, peer.samples, peer.samples_per_s = hb.version, hb.samples, hb.samples_per_s
        self._account(peer, +1)
        peer.claimable = max(peer.claimable, hb.samples)
        peer.inner_steps, peer.busy_fraction = hb.inner_steps, hb.busy_fraction
        if hb.samples > 0:
            held = peer.held_steps[1] if peer.held_steps[0] == hb.version else 0
            peer.held_steps = (hb.version, max(held, hb.inner_steps))
        self.touch(peer)

    def set_samples(self, peer: Peer, samples: int) -> None:
        """Change a peer's unsent samples (an accepted upload took some) keeping the sums right."""
        self._account(peer, -1)
        peer.samples = samples
        self._account(peer, +1)

    def _account(self, peer: Peer, sign: int) -> None:
        if self.peers.get(peer.peer_id) is not peer:
            return
        self._by_version[peer.version] += sign * peer.samples
        if not self._by_version[peer.version]:
            del self._by_version[peer.version]
        if peer.samples > 0:
            self._batch_by_version[peer.version] += sign * peer.batch
            if not self._batch_by_version[peer.version]:
                del self._batch_by_version[peer.version]

    def remove(self, peer_id: str) -> Peer | None:
        peer = self.peers.get(peer_id)
        if peer is None:
            return None
        self._account(peer, -1)
        del self.peers[peer_id]
        self.online_by_user[peer.username] -= 1
        if not self.online_by_user[peer.username]:
            del self.online_by_user[peer.username]
        if not self.peers:
            self._by_version.clear()
            self._batch_by_version.clear()
        return peer

    def excuse_silence(self, seconds: float) -> None:
        """The relay was deaf for ``seconds``: nobody's silence grows by them."""
        for peer in self.peers.values():
            peer.last_seen += seconds

    def expire(self, now: float | None = None) -> list[Peer]:
        """Drop peers that went silent; returns them so their round share can be released."""
        now = time.monotonic() if now is None else now
        gone = [p for p in self.peers.values() if p.inflight == 0 and now - p.last_seen > self.ttl_s]
        for peer in gone:
            self.remove(peer.peer_id)
        return gone

    def eligible(self, step: int, max_staleness: int) -> list[Peer]:
        """Peers whose unsent samples may still count toward round ``step`` (a scan: once per round)."""
        return [p for p in self.peers.values() if p.samples > 0 and 0 <= step - p.version <= max_staleness]

    def collected(self, step: int, max_staleness: int) -> int:
        """Samples toward round ``step``: O(max_staleness), whatever the number of peers."""
        return sum(self._by_version.get(v, 0) for v in range(step - max_staleness, step + 1))

    def in_flight(self, step: int, max_staleness: int) -> int:
        """What the peers holding samples toward round ``step`` add per step (their last growth):
        the samples they are computing now and will send with the rest. O(max_staleness)."""
        return sum(self._batch_by_version.get(v, 0) for v in range(step - max_staleness, step + 1))
