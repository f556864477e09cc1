"""The round lifecycle: when a round opens, when it closes, and what closing it produces.

A round opens once the eligible peers' unsent samples reach the target batch -- but never while
a plan change is pending or moving slices (:meth:`RoundCycle.maybe_open`); its expected set
follows what peers report while it is open; it closes when every expected peer delivered, left
or failed, at the adaptive deadline, or when nobody is left to wait for
(:meth:`RoundCycle.maybe_finalize`). Closing applies the step -- on the relay's reducer thread
(single relay) or by every slice owner (:meth:`relay_server.backbone.backbone.Backbone.finalize`)
--, then runs the relay's one after-publish sequence (:mod:`.publishing`: commit, publish, credit,
count, step event). A rollback publishes a stored state the same way.

Split from :mod:`.machine`, which admits peers and their gradients and calls in here whenever
something a round waits on changes; this module owns the open round and the tasks that finalize
it or move slices between rounds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable

from relay_server.backbone.backbone import Backbone
from relay_server.backbone.slicing import Published
from relay_server.collaboration.opening import OpeningRule, TargetBatch
from relay_server.collaboration.publishing import AfterPublish
from relay_server.core.config import RelayConfig
from relay_server.core.errors import ApiError
from relay_server.rounds.master import MasterState, NonFiniteStep, lr_at
from relay_server.rounds.membership import DeadlinePolicy, Round
from relay_server.rounds.peer_registry import Peer, Registry
from relay_server.rounds.publisher import Publisher, Version
from relay_server.rounds.reducer import Reducer
from relay_server.rounds.store import RoundLog, Store

log = logging.getLogger(__name__)


class RoundCycle:
    """The open round (``round``, None between rounds) and the steps rounds make."""

    def __init__(
        self,
        config: RelayConfig,
        store: Store,
        backbone: Backbone,
        registry: Registry,
        after_publish: AfterPublish,
        clock: Callable[[], float] = time.monotonic,
        opening: OpeningRule | None = None,
    ) -> None:
        self.config, self.store, self.backbone, self.registry = config, store, backbone, registry
        self.clock = clock  # the relay's: rounds' deadlines and durations count on it
        self.after_publish = after_publish  # commit, publish, credit, count, step event: every step's end
        self.run_cfg = config.run
        self.deadlines = DeadlinePolicy(config.rounds)
        self.opening = opening or TargetBatch(config.run.target_batch, config.run.max_staleness)  # the mode's rule
        self.round: Round | None = None
        self._finalizing: asyncio.Task[None] | None = None
        self._migration: asyncio.Task[None] | None = None
        self.inner_steps_last_round: float | None = None  # local SGD: mean over the last round's contributors
        self.refused_steps = int(store.get_meta("refused_steps", "0") or 0)  # steps that would have been non-finite

    @property
    def step(self) -> int:
        """The published version: the master's step counter moves on the reducer thread before
        the new version is durable, so everything peers and observers see keys off the board."""
        return self.backbone.board.latest.step

    @property
    def finished(self) -> bool:
        return 0 < self.run_cfg.total_steps <= self.step

    # The relay's own slice: the whole vector unless aggregators own parts of it. Asked for only
    # where the relay owns one (backbone.local set): a single relay, or its part of a plan.
    @property
    def master(self) -> MasterState:
        return self.backbone.local.master  # type: ignore[union-attr]  # see above

    @property
    def reducer(self) -> Reducer:
        """The relay's own slice's reducer (an empty one while aggregators own every slice:
        moderation excludes banned peers through it either way)."""
        local = self.backbone.local
        return local.reducer if local is not None else self.backbone.empty_reducer

    @property
    def publisher(self) -> Publisher:
        return self.backbone.local.publisher  # type: ignore[union-attr]  # see master

    # --- opening, membership, closing -----------------------------------------------------------
    def maybe_open(self, reporter: Peer | None = None) -> None:
        """Open the next round once the target is in sight: the samples reported, plus with
        ``rounds.open_round = "projected"`` the micro-batch each other peer holding samples is
        computing now (it adds it before it sees the round; ``reporter`` just reported, so it is
        not computing). Either way every expected peer then sends all it holds."""
        if self.round is not None or self.finished or self._between_rounds_work():
            return
        staleness = self.run_cfg.max_staleness
        ahead = 0
        if self.config.rounds.open_round == "projected":
            ahead = self.registry.in_flight(self.step, staleness)
            if reporter is not None and reporter.samples > 0 and 0 <= self.step - reporter.version <= staleness:
                ahead -= reporter.batch
        if not self.opening.due(self.registry, self.step, ahead):
            return
        eligible = self.registry.eligible(self.step, staleness)
        self.round = Round(
            step=self.step,
            round_id=secrets.token_hex(8),
            expected={p.peer_id for p in eligible},
            deadline_s=self.deadlines.window_s(),
            clock=self.clock,
            plan_version=self.backbone.plan_version,
            slices=self.backbone.round_slices(),
        )
        log.info("round %d open: %d peers, window %.1fs", self.step, len(eligible), self.round.deadline_s)

    def update_membership(self, peer: Peer) -> None:
        """Keep the open round's expected set in line with what peers report. A peer reporting
        eligible samples joins (its gradient would otherwise be wasted or a step late; the
        deadline still bounds the wait); one reporting nothing to give is no longer waited for."""
        r = self.round
        if r is None or r.closed or peer.peer_id in r.received or peer.peer_id in r.partial:
            return
        if peer.samples > 0 and 0 <= r.step - peer.version <= self.run_cfg.max_staleness:
            r.expected.add(peer.peer_id)
        elif peer.samples == 0 and peer.peer_id not in r.uploading and peer.peer_id in r.expected:
            r.drop(peer.peer_id)
            self.maybe_finalize()

    def drop(self, peer_id: str) -> None:
        """A peer left or timed out: the open round no longer waits for it."""
        if self.round is not None and not self.round.closed:
            self.round.drop(peer_id)
            self.maybe_finalize()

    def maybe_finalize(self, now: float | None = None) -> None:
        r = self.round
        if r is None or r.closed:
            return
        now = self.clock() if now is None else now
        if r.received and r.everyone_arrived():
            reason = "all_arrived"
        elif now >= r.deadline:
            reason = "deadline"
        elif not r.expected and not r.uploading:
            reason = "peers_gone"
        else:
            return
        r.closed, r.finalized_by = True, reason
        self._finalizing = asyncio.get_running_loop().create_task(self._finalize(r))

    async def _finalize(self, r: Round) -> None:
        if not r.received:
            log.warning("round %d closed (%s) with no complete gradient; collecting again", r.step, r.finalized_by)
            if not r.slices:  # owners of a sliced round drop theirs when the next round id reaches them
                await self.reducer.run(self.reducer.reset)  # drop any part-wise chunks of failed uploads
            self.round = None
            self.maybe_open()
            return
        outcome = RoundLog(
            contributions=dict(r.received),
            loss=r.loss,
            duration_s=self.clock() - r.opened_at,
            deadline_s=r.deadline_s,
            finalized_by=r.finalized_by,
            lr=0.0,
            grad_norm=0.0,
            outcomes=dict(r.outcomes),
        )  # the record says what was not counted whole
        if r.slices:  # every owner finalizes its slice (dead ones are recovered inside)
            published, grad_norm = await self.backbone.finalize(r.step, r.round_id)
            lr = lr_at(r.step, self.config.master_optimizer(), self.run_cfg.total_steps)
            outcome = dataclasses.replace(outcome, lr=lr, grad_norm=grad_norm)
            committed = False
        else:
            version = await self.reducer.run(self._apply, outcome)  # commits with the version file
            if version is None:  # refused: nothing published, the next round is on the same version
                self.reducer.submit(self.reducer.reset)
                self.round = None
                self.maybe_open()
                return
            self.publisher.publish(version)
            self.reducer.submit(self.reducer.reset)  # off the critical path, yet before the next round's adds
            published, committed = Published(step=version.step, sha256=version.sha256, version=version), True
        await self.after_publish.step(
            published, outcome, r.samples, committed=committed, bookkeeping=lambda: self._round_applied(r, published)
        )

    def _round_applied(self, r: Round, published: Published) -> None:
        """This cycle's own bookkeeping once ``r``'s step is out: the inner steps behind it, the
        opening rule, the adaptive deadline; then the next round may open."""
        self.inner_steps_last_round = r.inner_steps / len(r.received)
        self.opening.published(published.step, r.received)  # (local SGD: they work on this step now)
        self.deadlines.observe(r)
        self.round = None
        log.info(
            "step %d: %d peers, %d samples, loss %s, %.2fs (%s)",
            published.step,
            len(r.received),
            r.samples,
            f"{r.loss:.4f}" if r.loss is not None else "n/a",
            self.clock() - r.opened_at,
            r.finalized_by,
        )
        self.maybe_open()

    def publish_local(self, version: Version) -> Published:
        """The relay's own version is the published one (single relay)."""
        published = Published(step=version.step, sha256=version.sha256, version=version)
        self.backbone.board.publish(published)
        return published

    # --- plan changes, between rounds ------------------------------------------------------------
    def _between_rounds_work(self) -> bool:
        """A plan change is pending or running: no round opens until the slices have moved."""
        if self._migration is not None and not self._migration.done():
            return True
        if self.backbone.pending is None or self.round is not None or self._finalizing_now():
            return False
        self._migration = asyncio.get_running_loop().create_task(self._migrate())
        return True

    def _finalizing_now(self) -> bool:
        """A round is being finalized (the finalize itself, opening the next round, does not count)."""
        task = self._finalizing
        return task is not None and not task.done() and task is not asyncio.current_task()

    async def _migrate(self) -> None:
        try:
            published, new_version = await self.backbone.migrate(self.step)
            if published is not None:
                record = RoundLog.recovery() if new_version else None
                await self.after_publish.commit_and_publish(published, record)
        except Exception:
            log.exception("moving slices failed; the relay keeps the current plan")
        finally:
            self._migration = None
            self.maybe_open()

    def _apply(self, outcome: RoundLog) -> Version | None:
        """Reducer thread, after every add of the round: mean, optimizer step, persist, commit.
        None: the step was refused -- it would have made the parameters or the
        optimizer state non-finite; the master is exactly as before it (:meth:`Publisher.apply_step`),
        nothing is written or published, and ``refused_steps`` (in ``GET /api/status``, kept in
        the store across restarts) counts it. The peers' uploads of that round are lost, as the
        step they would have made was."""
        self.reducer.finish_mean()
        try:
            report = self.publisher.apply_step()
        except NonFiniteStep as exc:
            self.refused_steps += 1
            self.store.set_meta("refused_steps", str(self.refused_steps))
            log.error(
                "step %d refused (%d contributor(s)): %s; the parameters stay at version %d",
                self.master.step + 1,
                len(outcome.contributions),
                exc,
                self.master.step,
            )
            return None
        version = self.publisher.write(report.step, {"run": self.run_cfg.name})
        self.store.commit(
            report.step, version.sha256, dataclasses.replace(outcome, lr=report.lr, grad_norm=report.grad_norm)
        )
        return version

    # --- rollback ---------------------------------------------------------------------------------
    async def rollback(self, to_step: int) -> int:
        """Publish the stored state of version ``to_step`` (parameters and optimizer state) as the
        next version, and return that version. Versions only move forward -- peers compare them --
        so rolling back to k at version N publishes N + 1 holding k's state. An open round is
        abandoned: its gradients were computed on the state being rolled back."""
        if not self.backbone.single:
            raise ApiError(
                409,
                "rollback_needs_single_relay",
                "aggregators own slices of the vector",
                "Stop the aggregators (their slices return to the relay), then roll back.",
            )
        if not self.store.state_path(to_step).exists():
            kept = sorted(
                int(p.stem.split("-")[1]) for p in self.store.state_path(0).parent.glob("step-*.safetensors")
            )
            raise ApiError(
                404,
                "no_checkpoint",
                f"no stored state for step {to_step}",
                f"Stored steps: {kept}. Keep more with server.keep_checkpoints, or start a new "
                "relay from a Hub checkpoint (hub.init_from).",
            )
        if self._finalizing is not None:
            await self._finalizing  # a round that already closed is applied first
        if self.round is not None:
            self.round.closed, self.round.finalized_by = True, "rollback"
            self.round = None
        version = await self.reducer.run(self._apply_rollback, to_step)
        self.publisher.publish(version)
        self.publish_local(version)
        log.warning("rolled back to the state of step %d, published as step %d", to_step, version.step)
        self.maybe_open()
        return version.step

    def _apply_rollback(self, to_step: int) -> Version:
        """Reducer thread: after every pending add, swap in the stored state and persist it."""
        new_step = self.step + 1
        self.publisher.load(to_step)
        self.master.step = new_step
        self.reducer.reset()
        version = self.publisher.write(
            new_step, {"run": self.run_cfg.name, "rolled_back_to": str(to_step)}, delta=False
        )
        self.store.commit(
            new_step,
            version.sha256,
            RoundLog(
                contributions={},
                loss=None,
                duration_s=0.0,
                deadline_s=0.0,
                finalized_by="rollback",
                lr=0.0,
                grad_norm=0.0,
            ),
        )
        return version
