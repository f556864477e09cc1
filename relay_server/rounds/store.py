"""Everything that must survive a relay restart, under one data directory.

``relay.sqlite`` holds the registry, contributions and round log; ``state/step-NNNNNNNN.safetensors``
holds the parameters and optimizer state of each kept version (written by
:mod:`relay_server.rounds.publisher`). A step becomes durable in two moves -- write the file (tmp +
rename), then commit its number in SQLite -- and the relay publishes a version only after both,
so a crash at any point restarts from a version no peer has seen beyond, and no step is applied
twice or lost.
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from relay_server.rounds.throughput import RATE_WINDOW, RoundRate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundLog:
    """What a finalized round contributes to the persistent log and the leaderboard."""

    contributions: dict[str, int]  # peer_id -> samples
    loss: float | None
    duration_s: float
    deadline_s: float
    finalized_by: str
    lr: float
    grad_norm: float
    outcomes: dict[str, str] = field(default_factory=dict)  # peer_id -> refused / partial / banned_*
    samples: int | None = None
    """The samples the step applied, when not the sum of the contributions: a pipeline's batch,
    which every stage's workers contributed to (each credited with the samples of its stage)."""

    @classmethod
    def recovery(cls) -> RoundLog:
        """The record of a version the relay gathered back from its slice owners (a resume or a
        slice move), not made by a round: no contributions, no loss."""
        return cls(
            contributions={}, loss=None, duration_s=0.0, deadline_s=0.0, finalized_by="recovery", lr=0.0, grad_norm=0.0
        )


_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS peers (
    peer_id TEXT PRIMARY KEY, name TEXT NOT NULL, username TEXT NOT NULL, device TEXT NOT NULL,
    joined_at REAL NOT NULL, last_seen REAL NOT NULL,
    samples_contributed INTEGER NOT NULL DEFAULT 0, rounds_contributed INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS bans (
    username TEXT PRIMARY KEY COLLATE NOCASE, reason TEXT NOT NULL, banned_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS rounds (
    step INTEGER PRIMARY KEY, finalized_at REAL NOT NULL, contributors INTEGER NOT NULL,
    samples INTEGER NOT NULL, loss REAL, duration_s REAL NOT NULL, deadline_s REAL NOT NULL,
    finalized_by TEXT NOT NULL, lr REAL, grad_norm REAL, outcomes TEXT NOT NULL DEFAULT '{}');
"""


def finite_or_none(value: float | None) -> float | None:
    """A round's statistic as stored and shown: None (NULL) rather than NaN or Inf, which JSON
    cannot carry -- one inf ``grad_norm`` in the log broke every ``GET /api/status``."""
    return value if value is None or math.isfinite(value) else None


class Store:
    """SQLite + tensor files in ``data_dir``; one instance per relay process."""

    def __init__(self, data_dir: str | Path, *, keep: int = 3, fsync: bool = False) -> None:
        """The writer's store: one per data dir, opened by the process holding its lock
        (:mod:`relay_server.core.data_lock`). Read-only commands open :meth:`reader` instead."""
        self.dir = Path(data_dir)
        (self.dir / "state").mkdir(parents=True, exist_ok=True)
        self.keep, self.fsync = keep, fsync
        self.db = sqlite3.connect(self.dir / "relay.sqlite", isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(_SCHEMA)
        if "outcomes" not in {row[1] for row in self.db.execute("PRAGMA table_info(rounds)")}:  # older data dirs
            self.db.execute("ALTER TABLE rounds ADD COLUMN outcomes TEXT NOT NULL DEFAULT '{}'")
        self._banned = {u.casefold() for (u,) in self.db.execute("SELECT username FROM bans")}
        self.rate = RoundRate([(at, n) for _, _, n, _, _, _, _, at, _, _ in self.recent_rounds(RATE_WINDOW + 1)])
        """The measured samples/s over the last rounds committed (kept in memory: heartbeats read it)."""

    @classmethod
    def reader(cls, data_dir: str | Path) -> "Store":
        """A read-only view of ``data_dir`` while its relay may be running (``relay-server export``),
        without taking the relay's lock; ``FileNotFoundError`` where no relay has written a
        database yet. It writes nothing the relay keeps: SQLite may record its read in the
        ``-shm`` index, and creates empty ``-wal``/``-shm`` files where no relay has them open.

        Why what it reads is consistent: SQLite in WAL mode gives every read a snapshot of the
        last committed transaction, never part of one; a version's file is written to a
        temporary name and renamed into place before :meth:`commit` records its step, so a
        committed step's file is whole; and pruning keeps at least the two newest versions, so
        the latest one's file is only removed after two more commits (open it at once: an open
        file stays readable after it is unlinked)."""
        path = Path(data_dir) / "relay.sqlite"
        if not path.is_file():
            raise FileNotFoundError(path)
        store = cls.__new__(cls)
        store.dir, store.keep, store.fsync = Path(data_dir), 0, False
        store.db = sqlite3.connect(
            f"{path.absolute().as_uri()}?mode=ro", uri=True, isolation_level=None, check_same_thread=False
        )
        store._banned = {u.casefold() for (u,) in store.db.execute("SELECT username FROM bans")}
        return store

    def close(self) -> None:
        self.db.close()

    # --- bans (checked on every signed request: kept in memory) -------------------------------
    def is_banned(self, username: str) -> bool:
        return username.casefold() in self._banned

    def ban(self, username: str, reason: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO bans VALUES (?, ?, ?)", (username, reason, time.time()))
        self._banned.add(username.casefold())

    def unban(self, username: str) -> None:
        self.db.execute("DELETE FROM bans WHERE username = ?", (username,))
        self._banned.discard(username.casefold())

    def bans(self) -> list[tuple[str, str, float]]:
        return self.db.execute("SELECT username, reason, banned_at FROM bans ORDER BY banned_at").fetchall()

    # --- metadata -----------------------------------------------------------------------------
    def get_meta(self, key: str, default: str | None = None) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def set_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    # --- master state -------------------------------------------------------------------------
    def commit(
        self, step: int, sha256: str, round_log: RoundLog | None = None, meta: dict[str, str] | None = None
    ) -> None:
        """Make version ``step`` (its state file already written) the one a restart resumes from,
        with the round that produced it (and ``meta`` entries), in one transaction; then prune
        old versions."""
        self.db.execute("BEGIN")
        self.set_meta("step", str(step))
        self.set_meta("sha256", sha256)
        for key, value in (meta or {}).items():
            self.set_meta(key, value)
        finalized_at = time.time()
        if round_log is not None:
            self._record_round(step, round_log, finalized_at)
        self.db.execute("COMMIT")
        if round_log is not None:
            self.rate.add(finalized_at, _applied(round_log))
        self._prune(step)

    def latest_step(self) -> int | None:
        value = self.get_meta("step")
        return None if value is None else int(value)

    def load_state(self, step: int) -> dict[str, torch.Tensor]:
        return load_file(str(self.state_path(step)))

    def state_path(self, step: int) -> Path:
        return self.dir / "state" / f"step-{step:08d}.safetensors"

    def _prune(self, step: int) -> None:
        """Keep the newest ``keep`` versions (at least the current one and the one before it,
        which a peer may still be downloading or taking a delta against)."""
        keep = max(self.keep, 2)
        for old in sorted((self.dir / "state").glob("step-*.safetensors"))[:-keep]:
            old.unlink(missing_ok=True)
            old.with_suffix(".delta").unlink(missing_ok=True)

    # --- peers and contributions --------------------------------------------------------------
    def upsert_peer(self, peer_id: str, name: str, username: str, device: str) -> None:
        now = time.time()
        self.db.execute(
            "INSERT INTO peers (peer_id, name, username, device, joined_at, last_seen) VALUES (?,?,?,?,?,?) "
            "ON CONFLICT(peer_id) DO UPDATE SET last_seen = excluded.last_seen",
            (peer_id, name, username, device, now, now),
        )

    def known_peer(self, peer_id: str) -> tuple[str, str, str] | None:
        return self.db.execute("SELECT name, username, device FROM peers WHERE peer_id = ?", (peer_id,)).fetchone()

    def _record_round(self, step: int, r: RoundLog, finalized_at: float) -> None:
        """Log round ``step`` and credit each contributing peer (inside the caller's transaction)."""
        self.db.execute(
            "INSERT INTO rounds (step, finalized_at, contributors, samples, loss, duration_s, deadline_s, "
            "finalized_by, lr, grad_norm, outcomes) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (
                step,
                finalized_at,
                len(r.contributions),
                _applied(r),
                finite_or_none(r.loss),
                r.duration_s,
                r.deadline_s,
                r.finalized_by,
                finite_or_none(r.lr),
                finite_or_none(r.grad_norm),
                json.dumps(r.outcomes, sort_keys=True),
            ),
        )
        self.db.executemany(
            "UPDATE peers SET samples_contributed = samples_contributed + ?, "
            "rounds_contributed = rounds_contributed + 1 WHERE peer_id = ?",
            [(samples, peer_id) for peer_id, samples in r.contributions.items()],
        )

    def contributions(self) -> dict[str, int]:
        return dict(self.db.execute("SELECT peer_id, samples_contributed FROM peers"))

    def recent_rounds(self, limit: int = 200) -> list[tuple[Any, ...]]:
        return self.db.execute(
            "SELECT step, contributors, samples, loss, duration_s, deadline_s, finalized_by, finalized_at, lr, grad_norm "
            "FROM rounds ORDER BY step DESC LIMIT ?",
            (limit,),
        ).fetchall()[::-1]

    def round_outcomes(self, steps: list[int]) -> dict[int, dict[str, str]]:
        """The uploads of rounds ``steps`` that were not counted plainly whole (see :class:`RoundLog`)."""
        marks = ",".join("?" * len(steps))
        rows = self.db.execute(f"SELECT step, outcomes FROM rounds WHERE step IN ({marks})", steps) if steps else []
        return {step: json.loads(text) for step, text in rows if text and text != "{}"}

    def user_contributions(self) -> list[tuple[str, int, int, int, float]]:
        """(username, samples, rounds, peers, last_joined) for every user who ever joined, most
        samples first: the leaderboard's data plus who joined without contributing (moderation)."""
        return self.db.execute(
            "SELECT username, SUM(samples_contributed), SUM(rounds_contributed), COUNT(*), MAX(joined_at) "
            "FROM peers GROUP BY username COLLATE NOCASE ORDER BY 2 DESC, username"
        ).fetchall()

    def leaderboard(self, limit: int = 100) -> list[tuple[str, int, int]]:
        """(username, samples, rounds) summed over all of a volunteer's peers, best first."""
        return self.db.execute(
            "SELECT username, SUM(samples_contributed) AS samples, SUM(rounds_contributed) FROM peers "
            "GROUP BY username HAVING samples > 0 ORDER BY samples DESC, username LIMIT ?",
            (limit,),
        ).fetchall()


def _applied(r: RoundLog) -> int:
    """The samples a round's step applied."""
    return sum(r.contributions.values()) if r.samples is None else r.samples
