"""The relay's DMoE state (:class:`Experts`: directory, broker, checkpoints, call rates) and its
upkeep (:func:`expire_hosts`, started and stopped with the relay as the DMoE feature's service): what the HTTP routes of :mod:`relay_server.moe.feature` act on.

Kept apart from the routes so the state can be built, ticked and read (the dashboard's summary,
the tests' snapshots) without an HTTP request, and so the routes only translate requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from relay_server.core.errors import ApiError
from relay_server.moe.checkpoints import CHECKPOINTS_DIR, CheckpointStore
from relay_server.moe.directory import ExpertDirectory
from relay_server.moe.moe_config import MoeSection
from relay_server.tasks.broker import TaskBroker
from relay_server.tasks.payload_store import PayloadStore
from toolkit.wire import payloads
from toolkit.wire.compression import Codec, get_codec

log = logging.getLogger(__name__)
TICK_S = 0.25
RATE_WINDOW_S = 60.0


class ResultReview(Protocol):
    """What judges the hosts' results (:class:`relay_server.trust.expert_checks.ExpertTrust`, plugged in
    by the feature when ``[moe] check_share`` > 0): a unit above this one, so named by its shape."""

    def admit(self, peer: str) -> None:
        """Refuse (403 ``banned``) a host caught lying, on every expert route."""
        ...

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
        """A call's answer before its caller sees it: the answer to give instead when it is a lie
        the reviewer can correct (None: it stands); raises (502 ``bad_result``) when none may go."""
        ...

    def checkpointed(self, uid: str, updates: int, tensors: dict[str, np.ndarray], host: str = "") -> None:
        """``host``'s checkpoint of ``uid`` at ``updates`` was stored: the checks waiting for it settle."""
        ...

    def status(self) -> dict[str, Any]: ...


@dataclass
class Experts:
    """The relay's DMoE state: one per app, present only when ``[moe] enabled``."""

    config: MoeSection
    directory: ExpertDirectory
    broker: TaskBroker
    checkpoints: CheckpointStore
    shapes: dict[str, tuple[int, ...]]
    """Every expert's parameter shapes (all experts of a run share one architecture)."""
    known: frozenset[str] = frozenset()
    codec: Codec = field(default_factory=lambda: get_codec("none"))
    """How activations travel (``[moe] codec``), built once."""
    calls: deque[tuple[float, bool]] = field(default_factory=deque)
    """(monotonic time, failed) of the calls answered in the last minute: the dashboard's rates."""
    live_peers: Callable[[], Collection[str]] = frozenset
    """The registry's live peers: a host not among them loses its leases (:meth:`expire`)."""
    ticker: asyncio.Task[None] | None = None
    review: ResultReview | None = None
    """The spot checks and monitor of the hosts' results (None: ``[moe] check_share = 0``)."""

    @classmethod
    def create(
        cls,
        cfg: MoeSection,
        data_dir: Path,
        clock: Callable[[], float] = time.monotonic,
        live_peers: Callable[[], Collection[str]] = frozenset,
    ) -> Experts:
        """The state of a run that starts (or restarts: no lease survives, hosts lease again).
        ``clock``: the relay's (:mod:`relay_server.core.loop_clock`), on which calls' deadlines count."""
        from toolkit.moe.experts import expert_shapes  # torch: only relays that run DMoE pay for it

        return cls(
            config=cfg,
            directory=ExpertDirectory(cfg.uids()),
            broker=TaskBroker(
                PayloadStore(cfg.task_memory_mb << 20, data_dir / "tasks"),
                max_queued_rows=cfg.max_queued_rows,
                clock=clock,
            ),
            checkpoints=CheckpointStore(data_dir / CHECKPOINTS_DIR, cfg.keep_checkpoints),
            shapes=expert_shapes(cfg.expert),
            known=frozenset(cfg.uids()),
            codec=get_codec(cfg.codec),
            live_peers=live_peers,
        )

    async def start(self) -> None:
        """Expire departed hosts every ``TICK_S`` until :meth:`stop`."""
        self.ticker = asyncio.create_task(expire_hosts(self, self.live_peers))

    async def stop(self) -> None:
        if self.ticker is not None:
            self.ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.ticker

    @property
    def checkpoint_bytes(self) -> int:
        return payloads.checkpoint_limit(self.shapes)

    def note_call(self, failed: bool) -> None:
        now = time.monotonic()
        self.calls.append((now, failed))
        while self.calls and now - self.calls[0][0] > RATE_WINDOW_S:
            self.calls.popleft()

    def summary(self) -> dict[str, Any]:
        window = [c for c in self.calls if time.monotonic() - c[0] <= RATE_WINDOW_S]
        failed = sum(1 for _, f in window if f)
        return {
            "live": len(self.directory.live()),
            "total": len(self.directory.uids),
            "calls_per_s": round(len(window) / RATE_WINDOW_S, 2),
            "failure_rate": round(failed / len(window), 4) if window else 0.0,
            "experts_per_host": self.directory.hosts(),
            "queued_rows": self.broker.summary()["queued"],
            **({"trust": self.review.status()} if self.review is not None else {}),
        }

    def expire(self, live_peers: Collection[str]) -> None:
        """Hosts that left the registry lose their leases; their experts' open calls fail at once
        (their parameters left with the host) and the next host that asks takes them over."""
        for host in [h for h in self.directory.hosts() if h not in live_peers]:
            self.drop_host(host, "left")
        self.broker.tick()

    def drop_host(self, host: str, why: str) -> None:
        """End every lease of ``host`` (it left, or was banned): its experts' open calls fail at
        once and the next host that asks takes them over from their last checkpoint."""
        orphans = self.directory.release(host)
        failed = sum(
            self.broker.fail_key(
                uid, ApiError(410, "expert_gone", f"the host of {uid} {why}", "Treat it as a failed expert.")
            )
            for uid in orphans
        )
        self.broker.worker_left(host)
        log.info("expert host %s %s: %d experts orphaned, %d calls failed", host[:16], why, len(orphans), failed)


async def expire_hosts(experts: Experts, live_peers: Callable[[], Collection[str]]) -> None:
    """:meth:`Experts.expire` every ``TICK_S``, until cancelled (the app's cleanup)."""
    while True:
        await asyncio.sleep(TICK_S)
        experts.expire(live_peers())
