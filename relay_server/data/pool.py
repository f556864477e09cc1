"""The shard-lease pool: which peer reads which data file, and how much of each was trained on.

DESIGN.md s8, "better than the paper": instead of every peer walking every shard in its own order
(DeDLOC s3.3), a peer asks the relay for its next shard.

Policy, per dataset of the mix (a "source"):

1. **Unleased first.** A shard nobody holds always wins over a leased one, so two peers never
   read the same shard while an unleased shard remains.
2. **Least processed first**: fewest complete passes, then fewest rows trained on. A shard a
   departed peer left half-read sorts after untouched ones and before finished ones, and over
   time every shard is covered once before any is covered twice.
3. **Ties** (e.g. a fresh run, where every shard is untouched) are broken by a hash of
   (shard, peer): deterministic, but each peer walks the tied shards in its own order, so
   neighbouring files (often correlated: one crawl date, one domain) are not read in sequence
   and peers do not all start on ``train-00000``.
4. **When every shard is leased, share the least-leased one** (then least processed) rather
   than answer "none for now". Why: volunteer compute is the scarce resource and an idle peer is
   worse than one that re-reads a shard (each peer shuffles its own rows anyway: the paper's
   baseline duplicates everything); and "none for now" deadlocks. A stream asks for its next
   shard while its shuffle buffer still holds rows of shards it has finished *reading* -- those
   leases end only when the buffer drains, and the buffer drains only when new rows arrive. Two
   peers each waiting for the shard the other one holds would wait forever. Sharing only happens
   when peers outnumber unleased shards; the lease says so (``holders > 1``).

A lease ends when its peer releases it (``finished`` adds a pass) or drops out of the relay's
registry (heartbeat TTL, or leave): :meth:`ShardPool.expire` runs on the relay's ticker.
Leases live in memory; a relay restart forgets them, and a peer's next progress report on a
shard re-attaches its lease. Counts and the lease log are durable (:class:`ShardLedger`).
"""

from __future__ import annotations

import hashlib
import logging
import sqlite3
import time
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay_server.core.errors import ApiError
from toolkit.data.dataset_config import StreamConfig
from toolkit.wire.protocol import ShardCoverage, ShardLease, ShardReportAck, ShardsReport, ShardUpdate, SourceCoverage

log = logging.getLogger(__name__)

ShardKey = tuple[str, str]
"""(source, shard): a dataset name of the mix and one of its resolved shard paths."""


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass(eq=False)
class ShardState:
    source: str
    shard: str
    order: int
    """A hash of the shard; XOR-ed with a peer's salt it breaks ties in that peer's own order."""
    samples: int = 0
    passes: int = 0
    rows: int | None = None
    holders: Counter[str] = field(default_factory=Counter)
    """peer_id -> leases it holds on this shard (a peer holding every shard may hold one twice)."""

    @property
    def leases(self) -> int:
        return sum(self.holders.values())


class ShardPool:
    """Leases over the shards of each dataset (see the module docstring for the policy).

    Lives on the event loop (not thread-safe). Every change marks the shard dirty and appends to
    the lease log; :meth:`take_changes` hands both to the ledger, off the loop.
    """

    def __init__(
        self,
        shards: Mapping[str, Sequence[str]],
        *,
        saved: Mapping[ShardKey, tuple[int, int, int | None]] | None = None,
        first_seq: int = 1,
        clock: Any = time.time,
    ) -> None:
        self.clock = clock
        self.sources: dict[str, list[ShardState]] = {}
        self._shards: dict[ShardKey, ShardState] = {}
        for source, paths in shards.items():
            states = []
            for path in dict.fromkeys(paths):  # a shard listed twice (overlapping globs) is one shard
                state = ShardState(source, path, _hash64(f"{source}/{path}"))
                if saved and (source, path) in saved:
                    state.samples, state.passes, state.rows = saved[(source, path)]
                states.append(state)
                self._shards[(source, path)] = state
            self.sources[source] = states
        self._held_by: dict[str, Counter[ShardKey]] = {}
        self._granted: dict[str, dict[str, tuple[str, ShardKey]]] = {}  # peer -> source -> (request id, shard)
        self._reported: dict[str, str] = {}  # peer -> last report request id
        self._dirty: set[ShardKey] = set()
        self._events: list[tuple[Any, ...]] = []
        self._seq = first_seq
        self._log("", "", "", "start", 0)  # replaying the log: every lease before this one is gone

    @classmethod
    def from_dataset(cls, dataset: Mapping[str, Any], ledger: "ShardLedger | None" = None) -> "ShardPool | None":
        """The pool for a run's ``[dataset]`` section; None when it streams no shards or opts out
        of leases. Shard lists resolve as peers resolve them (:meth:`DatasetSpec.shards`): give
        absolute paths or ``hf://`` URLs, which mean the same file on the relay and on a peer."""
        if (dataset.get("kind") or "demo_corpus") != "stream":
            return None
        config = StreamConfig.from_dict(dataset)
        if not config.leases:
            return None
        shards = {spec.name: spec.shards() for spec in config.datasets}
        if ledger is None:
            return cls(shards)
        return cls(shards, saved=ledger.load(), first_seq=ledger.last_seq() + 1)

    # --- leases ---------------------------------------------------------------------------------
    def lease(self, peer_id: str, source: str, request_id: str = "") -> ShardLease:
        """Lease the best shard of ``source`` to ``peer_id``; a repeated ``request_id`` gets the
        lease it already has (the first answer was lost), not a second one."""
        states = self.sources.get(source)
        if states is None:
            raise ApiError(
                404,
                "unknown_source",
                f"the run has no dataset named {source[:64]!r}",
                f"Datasets of this run: {sorted(self.sources)}; the peer and relay configs disagree.",
            )
        previous = self._granted.get(peer_id, {}).get(source)
        if (
            request_id
            and previous is not None
            and previous[0] == request_id
            and self._shards[previous[1]].holders[peer_id] > 0
        ):
            return self._lease_info(self._shards[previous[1]])
        salt = _hash64(peer_id)
        best = min(states, key=lambda s: (s.leases, s.passes, s.samples, s.order ^ salt))
        best.holders[peer_id] += 1
        self._held_by.setdefault(peer_id, Counter())[(best.source, best.shard)] += 1
        self._granted.setdefault(peer_id, {})[source] = (request_id, (best.source, best.shard))
        self._log(best.source, best.shard, peer_id, "grant", best.leases)
        if best.leases > 1:
            log.info("dataset %r: every shard is leased; %s shared by %d leases", source, best.shard, best.leases)
        return self._lease_info(best)

    def report(
        self, peer_id: str, updates: Sequence[ShardUpdate], request_id: str = "", *, alive: bool = True
    ) -> ShardReportAck:
        """Apply a peer's progress deltas and releases. A progress update on a shard the peer no
        longer holds (its lease expired, or the relay restarted) re-attaches the lease when the
        peer is ``alive``: it is evidently still reading that shard."""
        if request_id and self._reported.get(peer_id) == request_id:
            return ShardReportAck(accepted=len(updates))
        if request_id:
            self._reported[peer_id] = request_id
        unknown: list[str] = []
        for u in updates:
            state = self._shards.get((u.source, u.shard))
            if state is None:
                unknown.append(u.shard)
                continue
            state.samples += u.samples
            if u.release:
                if state.holders[peer_id] > 0:
                    self._drop(state, peer_id)
                    self._log(state.source, state.shard, peer_id, "finish" if u.finished else "release", state.leases)
                if u.finished:
                    state.passes += 1
                    if u.rows is not None:
                        state.rows = u.rows
            elif alive and state.holders[peer_id] == 0:
                state.holders[peer_id] += 1
                self._held_by.setdefault(peer_id, Counter())[(state.source, state.shard)] += 1
                self._log(state.source, state.shard, peer_id, "reclaim", state.leases)
            self._dirty.add((state.source, state.shard))
        if unknown:
            log.warning(
                "peer %s reported %d shard(s) the pool does not have, e.g. %s",
                peer_id[:8],
                len(unknown),
                unknown[0][:200],
            )
        return ShardReportAck(accepted=len(updates) - len(unknown), unknown=unknown[:16])

    def expire(self, live_peers: Collection[str]) -> list[ShardKey]:
        """End every lease of a peer that is not in ``live_peers`` (the registry): it stopped
        heartbeating or left. Returns the shards that went back to the pool."""
        returned = []
        for peer_id in [p for p in self._held_by if p not in live_peers]:
            for key, count in self._held_by.pop(peer_id).items():
                state = self._shards[key]
                for _ in range(count):  # one event per lease, as grants are logged
                    state.holders[peer_id] -= 1
                    self._log(state.source, state.shard, peer_id, "expire", state.leases)
                del state.holders[peer_id]
                returned.append(key)
        for books in (self._granted, self._reported):  # retry memory of departed peers
            for peer_id in [p for p in books if p not in live_peers]:
                del books[peer_id]
        if returned:
            log.info("%d shard lease(s) of departed peers went back to the pool", len(returned))
        return returned

    def _drop(self, state: ShardState, peer_id: str) -> None:
        state.holders[peer_id] -= 1
        if state.holders[peer_id] <= 0:
            del state.holders[peer_id]
        held = self._held_by[peer_id]
        held[(state.source, state.shard)] -= 1
        if held[(state.source, state.shard)] <= 0:
            del held[(state.source, state.shard)]
        if not held:
            del self._held_by[peer_id]

    def _lease_info(self, state: ShardState) -> ShardLease:
        return ShardLease(
            source=state.source, shard=state.shard, holders=state.leases, passes=state.passes, samples=state.samples
        )

    def _log(self, source: str, shard: str, peer_id: str, event: str, leases: int) -> None:
        self._events.append((self._seq, self.clock(), source, shard, peer_id, event, leases))
        self._seq += 1

    # --- coverage --------------------------------------------------------------------------------
    def summary(self) -> list[SourceCoverage]:
        """Per dataset: shards, leased now, started, finished, epochs, rows trained (for /api/status)."""
        return [
            SourceCoverage(
                source=source,
                shards=len(states),
                leased=sum(s.leases > 0 for s in states),
                started=sum(s.samples > 0 for s in states),
                finished=sum(s.passes > 0 for s in states),
                min_passes=min(s.passes for s in states),
                samples=sum(s.samples for s in states),
            )
            for source, states in self.sources.items()
        ]

    def coverage(self, source: str | None = None) -> ShardsReport:
        """The summary plus one line per shard (optionally of one dataset only)."""
        shards = [
            ShardCoverage(
                source=s.source, shard=s.shard, samples=s.samples, passes=s.passes, rows=s.rows, holders=s.leases
            )
            for name, states in self.sources.items()
            if source in (None, name)
            for s in states
        ]
        return ShardsReport(sources=[c for c in self.summary() if source in (None, c.source)], shards=shards)

    def held_by(self, peer_id: str) -> dict[ShardKey, int]:
        return dict(self._held_by.get(peer_id, {}))

    # --- persistence -----------------------------------------------------------------------------
    def take_changes(self) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        """(coverage rows of changed shards, new lease-log events) since the last call."""
        rows = [
            (s.source, s.shard, s.samples, s.passes, s.rows, self.clock())
            for s in (self._shards[k] for k in self._dirty)
        ]
        events, self._events, self._dirty = self._events, [], set()
        return rows, events

    def restore_changes(self, rows: list[tuple[Any, ...]], events: list[tuple[Any, ...]]) -> None:
        """Put back what a failed write took: the counts are absolute, so re-marking is enough."""
        self._dirty.update((r[0], r[1]) for r in rows)
        self._events[:0] = events


_SCHEMA = """
CREATE TABLE IF NOT EXISTS shard_coverage (
    source TEXT NOT NULL, shard TEXT NOT NULL, samples INTEGER NOT NULL, passes INTEGER NOT NULL,
    rows INTEGER, updated_at REAL NOT NULL, PRIMARY KEY (source, shard));
CREATE TABLE IF NOT EXISTS shard_events (
    seq INTEGER PRIMARY KEY, at REAL NOT NULL, source TEXT NOT NULL, shard TEXT NOT NULL,
    peer_id TEXT NOT NULL, event TEXT NOT NULL, leases INTEGER NOT NULL);
"""


class ShardLedger:
    """The pool's durable half, two tables in the relay's SQLite file (``relay.sqlite``).

    ``shard_coverage``: rows trained, complete passes and size per shard -- what the run knows of
    its data coverage across restarts. ``shard_events``: the lease log (grant, release, finish,
    expire, reclaim; "start" marks a relay start), for audits and for tests that replay it.

    Its own connection, not the :class:`~relay_server.rounds.store.Store`'s: the Store's connection is
    shared with the worker thread that commits each step inside ``BEGIN .. COMMIT``, and an
    explicit transaction of ours on that same connection could interleave with it ("cannot start a
    transaction within a transaction", or our rows committed by their COMMIT). SQLite in WAL mode
    serializes two connections' writes safely (``timeout`` waits for the lock).
    """

    def __init__(self, path: str | Path, *, timeout_s: float = 10.0) -> None:
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=timeout_s)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # survives a crash of the relay; a power cut may lose ~1 s
        self.db.executescript(_SCHEMA)

    def load(self) -> dict[ShardKey, tuple[int, int, int | None]]:
        return {
            (src, shard): (samples, passes, rows)
            for src, shard, samples, passes, rows in self.db.execute(
                "SELECT source, shard, samples, passes, rows FROM shard_coverage"
            )
        }

    def last_seq(self) -> int:
        return int(self.db.execute("SELECT COALESCE(MAX(seq), 0) FROM shard_events").fetchone()[0])

    def write(self, rows: list[tuple[Any, ...]], events: list[tuple[Any, ...]]) -> None:
        """One transaction: absolute coverage rows (upserted) and new log events."""
        if not rows and not events:
            return
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.db.executemany(
                "INSERT INTO shard_coverage VALUES (?,?,?,?,?,?) ON CONFLICT(source, shard) DO UPDATE SET "
                "samples = excluded.samples, passes = excluded.passes, rows = excluded.rows, "
                "updated_at = excluded.updated_at",
                rows,
            )
            self.db.executemany("INSERT OR IGNORE INTO shard_events VALUES (?,?,?,?,?,?,?)", events)
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def events(self, since: int = 0) -> list[tuple[Any, ...]]:
        """The lease log after ``since``: (seq, at, source, shard, peer_id, event, leases)."""
        return self.db.execute("SELECT * FROM shard_events WHERE seq > ? ORDER BY seq", (since,)).fetchall()

    def close(self) -> None:
        self.db.close()
