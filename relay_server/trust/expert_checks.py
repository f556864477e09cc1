"""Spot checks and a monitor of expert hosts' results, and what a failed check costs the host.

**Where.** Every expert call passes through the relay (hosts cannot be reached): the trainer's
``PUT .../calls/{uid}`` waits there for the host's result, so the relay sees the call (``x``, and
``g`` for a backward) and its answer together, before the caller does. The checks sit there
(:meth:`ExpertTrust.review`, called by the call route), not at the caller: a caller could only
ask the same relay again.

**Against what.** An expert has one host at a time (the directory leases each expert to one
host, and its parameters change with every backward it serves), so no second host holds the
same parameters to ask. The relay's own copy does (:mod:`.expert_copy`): a host tags every result
with the version of the expert it computed it on (the optimizer steps it holds, the ``updates``
its checkpoints carry), and the relay holds that version's parameters when it is the fresh
expert (version 0, built from the run's seed; a frozen run's experts are always that) or a
checkpoint it keeps. A checked call at such a version is computed again on the relay at once, and
when the host's answer differs the caller gets the relay's answer instead: the expert's true
result at that version, so the caller's step loses nothing (not a failed expert masked by the
mixture, and never the lie). Once a host is banned, its answers still on their way are refused
(502 ``bad_result``: a failed expert to the caller). A checked call at a version the relay has no parameters of yet
waits for the host's next checkpoint of that version (*deferred*: the caller has its answer
already) and is dropped as *unverifiable* when a later version's checkpoint comes first.

**Which calls.** A share (``[moe] check_share``) chosen by an HMAC of the relay's task id under a
secret drawn when the relay starts; a checked call is an ordinary call to the host (the same task,
the same route; the host's result is acknowledged before any check runs), and every call of a
host the monitor finds suspect is checked.

**The monitor.** Every answer is reduced to one number: the relative size of what the expert
adds to its input (``|y - x| / |x|`` for a forward, ``|g_x - g_y| / |g_y|`` for a backward; the
experts are residual blocks, so an expert that returns its input scores 0), scored per layer and
kind against all hosts' running distribution (:class:`relay_server.trust.monitor.ResultMonitor`:
median and MAD; per layer because each expert has a single host, whose own history would be its
reference). Suspicion only makes every call of the host a check; only a check bans.

**Consequences.** A host whose answer is farther than the tolerance (:mod:`.compare`, the run's
fp32 plus its activation codec) from the relay's copy is banned: refused on every expert route
(403 ``banned``), its leases end and its experts' open calls fail, so the next host that asks takes
them over from their last checkpoint, and the relay's moderation records the ban (on runs with
verified usernames: the ban list, every peer of the user leaves). A lie found late (deferred) was
trained on by its caller; the expert's parameters it came from are the host's own checkpoint.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from relay_server.core.errors import ApiError
from relay_server.moe.state import Experts
from relay_server.trust.compare import distance
from relay_server.trust.monitor import ResultMonitor
from toolkit.errors import ProtocolError
from toolkit.wire import payloads

if TYPE_CHECKING:
    from relay_server.collaboration.machine import Collaboration
    from relay_server.core.config import RelayConfig
    from relay_server.trust.expert_copy import ExpertCopy  # torch: built only on a relay that checks

log = logging.getLogger(__name__)
MAX_PENDING_PER_EXPERT = 8
"""Deferred checks kept per expert; an older one is dropped (unverifiable) for a newer."""
VERSION_KEY = payloads.RESULT_VERSION


@dataclass
class ExpertCheck:
    task_id: str
    uid: str
    kind: str
    host: str
    version: int
    x: np.ndarray
    g: np.ndarray | None
    answer: np.ndarray


@dataclass
class ExpertTrustCounters:
    checks: int = 0
    agreed: int = 0
    disagreed: int = 0
    deferred: int = 0
    """Checks that waited for a checkpoint of their version (each then agreed, disagreed or
    became unverifiable)."""
    unverifiable: int = 0
    answered: int = 0
    """Lies found at once whose callers got the relay's own answer instead."""
    stale: int = 0
    """Results naming a version older than their host had checkpointed before taking the call."""
    max_agreeing_distance: float = 0.0


@dataclass
class ExpertTrust:
    experts: Experts
    copy: ExpertCopy
    share: float
    tolerance: float
    frozen: bool = False
    """``[moe] optimizer = none``: every version's parameters are the seed's."""
    on_ban: Callable[[str, str], None] = lambda host, reason: None
    """The relay's moderation: ``host`` was caught lying (the reason)."""
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    monitor: ResultMonitor = field(default_factory=ResultMonitor)
    counters: ExpertTrustCounters = field(default_factory=ExpertTrustCounters)
    pending: dict[str, list[ExpertCheck]] = field(default_factory=dict)
    """uid -> its deferred checks, oldest first."""
    banned: dict[str, str] = field(default_factory=dict)
    bans: list[dict[str, Any]] = field(default_factory=list)
    checked_by: dict[str, int] = field(default_factory=dict)
    """host -> checks of its answers so far (a ban says how many it took)."""
    settling: set[asyncio.Task[None]] = field(default_factory=set)
    floors: dict[str, tuple[str, int, float]] = field(default_factory=dict)
    """uid -> (host, updates, when stored on the broker's clock) of its latest checkpoint: a call
    that host took after it is computed on that version or a later one."""

    # --- admission ------------------------------------------------------------------------------
    def admit(self, peer: str) -> None:
        if peer in self.banned:
            raise ApiError(
                403,
                "banned",
                f"this peer was banned from hosting experts: {self.banned[peer]}",
                "The relay checks hosts' results against its own copy of the experts; run the unmodified toolkit.",
            )

    # --- calls ----------------------------------------------------------------------------------
    def chosen(self, task_id: str, host: str) -> bool:
        if self.monitor.suspect(host):
            return True
        digest = hmac.new(self.secret, task_id.encode(), hashlib.sha256).digest()
        return int.from_bytes(digest[:8], "big") < self.share * 2**64

    async def review(
        self,
        task_id: str,
        uid: str,
        kind: str,
        host: str,
        x: np.ndarray,
        g: np.ndarray | None,
        answer: bytes,
        leased_at: float | None = None,
    ) -> bytes | None:
        """Score ``host``'s ``answer`` to a ``kind`` call of ``uid`` (leased to it at ``leased_at``,
        the broker's clock); check it if chosen. Returns the relay's own answer when the check
        found a lie (what the caller gets instead: the expert's true result at the version the
        host named, so the caller's step loses nothing), else None (the host's answer stands).
        Raises 502 ``bad_result`` when no answer may reach its caller: a banned host's, or a
        stale one's (the relay has no true answer to give then)."""
        self._refuse_if_banned(host, uid)
        version, out = self._read(answer, "y" if kind == "forward" else "g", x.shape[0])
        self._refuse_if_stale(uid, kind, host, version, leased_at)
        before = x if kind == "forward" else g
        if before is not None:
            scale = float(np.linalg.norm(before))
            if scale > 0 and math.isfinite(scale):
                self.monitor.observe(
                    f"{uid.split('.', 1)[0]}.{kind}", host, float(np.linalg.norm(out - before)) / scale, 1
                )
        if not self.chosen(task_id, host):
            return None
        self.counters.checks += 1
        self.checked_by[host] = self.checked_by.get(host, 0) + 1
        check = ExpertCheck(task_id, uid, kind, host, version, x, g, out)
        floor = self.floors.get(uid)
        if self.frozen or version == 0:  # the seed's parameters: a fresh expert, or one never trained
            found, params = True, None
        elif floor is None or version > floor[1]:  # newer than any checkpoint stored since the relay started
            found, params = False, None
        else:
            found, params = await asyncio.to_thread(self._params_at, uid, version)
        if not found:
            self._defer(check)
            return None
        truth = await asyncio.to_thread(self.copy.compute, uid, kind, params, x, g)
        if self._judge(check, truth):
            return None
        self.counters.answered += 1
        name = "y" if kind == "forward" else "g"
        return payloads.encode(
            payloads.encode_rows(name, truth.astype(np.float32), self.experts.codec), {VERSION_KEY: str(version)}
        )

    def _refuse_if_banned(self, host: str, uid: str) -> None:
        if host in self.banned:
            raise ApiError(
                502,
                "bad_result",
                f"the host of {uid} failed a spot check and was banned; its answer was withheld",
                "Treat it as a failed expert (the toolkit does); another host takes the expert over.",
            )

    def _refuse_if_stale(self, uid: str, kind: str, host: str, version: int, leased_at: float | None) -> None:
        """Every call: a host names a version older than one it checkpointed before it took the
        call. An honest host cannot (it uploads a checkpoint from the expert it serves, and polls
        for its next calls only after the upload was stored); a host answering from an old copy
        of the expert, saying so to be checked there, does."""
        floor = self.floors.get(uid)
        if floor is None or leased_at is None or floor[0] != host or leased_at <= floor[2] or version >= floor[1]:
            return
        self.counters.stale += 1
        self.ban(
            host,
            f"its {kind} result for expert {uid} names version {version}, older than version {floor[1]} it "
            "had checkpointed before it took the call (a stale copy)",
        )
        self._refuse_if_banned(host, uid)

    def _read(self, answer: bytes, name: str, rows: int) -> tuple[int, np.ndarray]:
        """The version an answer says it was computed on, and its rows ``name`` (both validated
        when the host sent it: :func:`read_version`)."""
        metadata, tensors = payloads.decode(answer, len(answer))
        return int(metadata[VERSION_KEY]), payloads.read_rows(
            tensors, name, rows, self.experts.config.width(), self.experts.codec
        )

    def _params_at(self, uid: str, version: int) -> tuple[bool, dict[str, np.ndarray] | None]:
        """(a checkpoint the relay keeps holds version ``version`` of ``uid``, its parameters)."""
        for body in self.experts.checkpoints.bodies(uid):
            try:
                updates, tensors = payloads.read_checkpoint(body, self.experts.shapes)
            except ProtocolError:
                continue
            if updates == version:
                return True, tensors
        return False, None

    def _defer(self, check: ExpertCheck) -> None:
        self.counters.deferred += 1
        waiting = self.pending.setdefault(check.uid, [])
        waiting.append(check)
        while len(waiting) > MAX_PENDING_PER_EXPERT:
            waiting.pop(0)
            self.counters.unverifiable += 1

    def checkpointed(self, uid: str, updates: int, tensors: dict[str, np.ndarray], host: str = "") -> None:
        """``host``'s checkpoint of ``uid`` at ``updates`` was stored: the deferred checks of that
        version are computed now (off the event loop), older ones can no longer be."""
        self.floors[uid] = (host, updates, self.experts.broker.clock())
        waiting = self.pending.pop(uid, [])
        due = [c for c in waiting if c.version == updates and c.host not in self.banned]
        later = [c for c in waiting if c.version > updates]
        self.counters.unverifiable += len(waiting) - len(due) - len(later)
        if later:
            self.pending[uid] = later
        if due:
            params = None if self.frozen else tensors
            task = asyncio.get_running_loop().create_task(self._settle(due, params))
            self.settling.add(task)
            task.add_done_callback(self.settling.discard)

    async def _settle(self, checks: list[ExpertCheck], params: dict[str, np.ndarray] | None) -> None:
        for check in checks:
            try:
                truth = await asyncio.to_thread(self.copy.compute, check.uid, check.kind, params, check.x, check.g)
            except Exception:  # a copy that cannot compute decides nothing
                log.exception("the relay could not compute a deferred check of %s", check.uid)
                self.counters.unverifiable += 1
                continue
            self._judge(check, truth)

    # --- verdicts -------------------------------------------------------------------------------
    def _judge(self, check: ExpertCheck, truth: np.ndarray) -> bool:
        """Whether the host's answer agrees with ``truth``; a host whose does not is banned."""
        d = distance(truth, check.answer)
        if d <= self.tolerance:
            self.counters.agreed += 1
            self.counters.max_agreeing_distance = max(self.counters.max_agreeing_distance, d)
            return True
        self.counters.disagreed += 1
        self.ban(
            check.host,
            f"its {check.kind} result for expert {check.uid} (version {check.version}) is {d:.3g} (relative L2) "
            f"from the relay's own computation, tolerance {self.tolerance:.3g}",
        )
        return False

    def ban(self, host: str, reason: str) -> None:
        if host in self.banned:
            return
        self.banned[host] = reason
        self.bans.append({"host": host, "reason": reason, "checks": self.checked_by.get(host, 0)})
        log.warning("expert host %s banned: %s", host[:16], reason)
        for uid in list(self.pending):
            kept = [c for c in self.pending[uid] if c.host != host]
            self.counters.unverifiable += len(self.pending[uid]) - len(kept)
            self.pending[uid] = kept
        self.experts.drop_host(host, "was banned")
        self.on_ban(host, reason)

    def status(self) -> dict[str, Any]:
        """What ``GET /api/status`` shows under ``experts.trust`` (the dashboard's Experts panel)."""
        c = self.counters
        return {
            "check_share": self.share,
            "tolerance": self.tolerance,
            "checks": c.checks,
            "agreed": c.agreed,
            "disagreed": c.disagreed,
            "deferred": c.deferred,
            "unverifiable": c.unverifiable,
            "answered_by_relay": c.answered,
            "stale": c.stale,
            "pending": sum(len(v) for v in self.pending.values()),
            "max_agreeing_distance": c.max_agreeing_distance,
            "relay_computations": self.copy.computed,
            "monitored": self.monitor.observed,
            "outliers": self.monitor.outliers,
            "suspects": sorted(h for h in self.monitor.suspicion if self.monitor.suspect(h)),
            "bans": list(self.bans),
        }


def read_version(metadata: dict[str, str]) -> int:
    """The expert version a host's result names (the result route refuses one without it on a
    checked run: a result that names none could never be checked)."""
    value = metadata.get(VERSION_KEY, "")
    if not value.isdigit() or len(value) > 12:
        raise ProtocolError(
            "no_version",
            f"a result must name the expert version it was computed on (metadata {VERSION_KEY!r}, an integer)",
        )
    return int(value)


def build_trust(experts: Experts, on_ban: Callable[[str, str], None]) -> ExpertTrust:
    """The checks of ``[moe] check_share`` over ``experts``: fp32 experts (hosts compute in
    float32 whatever the codec) plus the activation codec's rounding."""
    from relay_server.trust.compare import tolerance
    from relay_server.trust.expert_copy import ExpertCopy

    cfg = experts.config
    return ExpertTrust(
        experts=experts,
        copy=ExpertCopy(cfg.expert, cfg.seed),
        share=cfg.check_share,
        tolerance=tolerance("fp32", cfg.codec),
        frozen=cfg.optimizer.get("name") == "none",
        on_ban=on_ban,
    )


def moderation(config: RelayConfig, collab: Collaboration) -> Callable[[str, str], None]:
    """What a ban of a lying host does beyond the expert routes: on a run with verified usernames
    its user is banned like one an organizer bans (the store's ban list, ``GET /api/admin/bans``,
    the leaderboard's mark; every peer of the user leaves); on an open run, where nobody has a
    verified name, the expert routes refuse its id (:meth:`ExpertTrust.admit`)."""

    def ban(host: str, reason: str) -> None:
        peer = collab.registry.get(host)
        if peer is None or not peer.username or config.auth.mode == "open":
            return
        collab.store.ban(peer.username, f"expert results failed a spot check: {reason}"[:500])
        for other in [p.peer_id for p in list(collab.registry.peers.values()) if p.username == peer.username]:
            collab.leave(other)

    return ban
