"""What happens once a step is applied: the one sequence every publisher runs.

Every way the relay makes a new version -- a collaboration round on the relay's reducer thread or
on its slice owners (:mod:`.round_cycle`), a pipeline batch on its stages' parameter servers
(:mod:`relay_server.pipeline`) -- ends the same way, in this order: the version is committed to
the store with the round that produced it, published on the board (waiting peers wake), the
backbone starts copying remote slices, the contributors are credited on the leaderboard with
what the store committed, the applied samples are counted in the traffic figures, the
publisher's own bookkeeping runs (a round's adaptive deadline, the local SGD rule), and the
observers get their step event. Kept in one place so a publisher cannot skip a step or order
them differently (the pipeline's copy once committed on the event loop and counted no samples).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from relay_server.backbone.backbone import Backbone
from relay_server.backbone.slicing import Published
from relay_server.collaboration.status import Leaderboard
from relay_server.observers.events import ObserverThread, StepEvent
from relay_server.rounds.store import RoundLog, Store
from relay_server.rounds.traffic import Traffic
from toolkit.wire.protocol import StatusReport


class AfterPublish:
    """The sequence after a step, over the relay's shared services (one per collaboration)."""

    def __init__(
        self,
        store: Store,
        backbone: Backbone,
        leaderboard: Leaderboard,
        traffic: Traffic,
        observers: ObserverThread,
        status: Callable[[], StatusReport],
    ) -> None:
        self.store, self.backbone, self.leaderboard, self.traffic = store, backbone, leaderboard, traffic
        self.observers, self.status = observers, status  # status: what a StepEvent carries

    async def commit_and_publish(self, published: Published, record: RoundLog | None) -> None:
        """Make ``published`` the version a restart resumes from (with ``record``, the round that
        made it, if any), then the one peers are served. Off the event loop: a commit fsyncs."""
        manifest = published.manifest.dumps().decode() if published.manifest else ""
        await asyncio.to_thread(self.store.commit, published.step, published.sha256, record, {"manifest": manifest})
        self.announce(published)

    def announce(self, published: Published) -> None:
        """Serve ``published`` (already committed): the board wakes waiting peers; the backbone
        pulls the recovery copy of remote slices when one is due."""
        self.backbone.board.publish(published)
        self.backbone.after_publish(published)

    async def step(
        self,
        published: Published,
        record: RoundLog,
        samples: int,
        *,
        committed: bool = False,
        bookkeeping: Callable[[], None] = lambda: None,
        state_path: Path | None = None,
    ) -> None:
        """A new step, applied: commit (unless ``committed``: the single relay's reducer thread
        commits with the version file it writes), publish, credit ``record``'s contributions,
        count ``samples``, run the publisher's ``bookkeeping``, then the observers' step event
        (its status already shows the bookkeeping: the next round open, the deadline moved), with
        the whole model's file at ``state_path`` (default: the version's own)."""
        if committed:
            self.announce(published)
        else:
            await self.commit_and_publish(published, record)
        self.leaderboard.credit(record.contributions)  # what the store committed, nothing else
        self.traffic.samples += samples
        bookkeeping()
        if self.observers.observers:
            status = self.status()
            path = state_path or (published.version.path if published.version else None)
            self.observers.publish(
                StepEvent(step=published.step, record=status.recent_rounds[-1], status=status, state_path=path)
            )
