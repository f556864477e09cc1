"""The collaboration: turns peers' progress into rounds and rounds into optimizer steps.

Life of a round (DESIGN.md s3): peers heartbeat their unsent samples; when the eligible samples
reach the target batch the relay opens round ``s`` for the peers holding them; each uploads the
sum of its gradients; the relay reduces as chunks arrive; the round finalizes when every expected
peer delivered, left or failed -- or at the adaptive deadline, whichever is first; the master
takes one optimizer step, the new version is persisted, then published to waiting peers.

With extra aggregators (:mod:`relay_server.backbone.backbone`) the vector is cut into slices: a peer asks
for a ticket instead of uploading here (same checks), sends each slice to its owner, then says
it is done; the round closes on the same rules, every owner finalizes its slice, and the new
version is a manifest of the slices' hashes. Without aggregators none of that runs.

This module admits peers (join, heartbeat, leave), keeps house and wires the parts together; their
gradients (whole uploads, tickets, done) are :mod:`.intake` (``collab.gradients``), the open round
and the steps it makes :mod:`.round_cycle`, the reports :mod:`.status`, the version the relay
serves first (fresh or resumed) :mod:`.starting_version`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

from relay_server.backbone.backbone import Backbone
from relay_server.backbone.slice_owner import gradient_meta
from relay_server.backbone.slicing import Published
from relay_server.collaboration.intake import GradientIntake
from relay_server.collaboration.opening import OpeningRule
from relay_server.collaboration.publishing import AfterPublish
from relay_server.collaboration.round_cycle import RoundCycle
from relay_server.collaboration.starting_version import StartingVersion, initial_model
from relay_server.collaboration.status import (
    Leaderboard,
    RunFigures,
    collab_state,
    run_info_of,
    run_summary,
    status_report,
)
from relay_server.core.config import RelayConfig
from relay_server.core.errors import ApiError, unknown_peer
from relay_server.core.loop_clock import LoopClock
from relay_server.observers.events import ObserverThread
from relay_server.rounds.master import MasterState, layout_of
from relay_server.rounds.peer_registry import Peer, Registry
from relay_server.rounds.publisher import Publisher
from relay_server.rounds.reducer import Reducer
from relay_server.rounds.store import Store
from relay_server.rounds.traffic import Traffic
from toolkit.models.flat import flatten
from toolkit.wire.compression import run_codecs
from toolkit.wire.protocol import (
    PROTOCOL_VERSION,
    CollabState,
    Heartbeat,
    JoinRequest,
    JoinResponse,
    PlanInfo,
    RunSummary,
    StateInfo,
    StatusReport,
)

log = logging.getLogger(__name__)

_gradient_meta = gradient_meta  # its old home (tools and tests import it from here)


class Collaboration:
    def __init__(
        self,
        config: RelayConfig,
        store: Store,
        observers: ObserverThread | None = None,
        opening: OpeningRule | None = None,
        parameters_kept_elsewhere: bool = False,
        run_info_fields: Mapping[str, Any] | None = None,
    ) -> None:
        """``opening``: when rounds open, as the run's mode plugs it in (default: sync's target
        batch, :class:`~relay_server.collaboration.opening.TargetBatch`).
        ``parameters_kept_elsewhere``: a feature keeps the run's parameters and resumes them from
        its own store after a restart (the pipeline's stage owners), so the collaboration restores
        no version of its own; a fresh run still writes version 0 here. ``run_info_fields``: what
        the enabled features tell a joining peer (``RunInfo``'s ``local_sgd``, ``pipeline``)."""
        self.config, self.store = config, store
        self.observers = observers or ObserverThread([])
        self.run_cfg, self.rounds_cfg = config.run, config.rounds
        model = initial_model(config, store)
        self.layout = layout_of(model)
        params = flatten(model)
        del model  # the master adopts `params`; the model's own tensors go now, not at the end of __init__
        self.codecs = run_codecs(config.run.compression, config.run.download_compression)
        self.run_info = run_info_of(
            config, self.layout, int(params.size), self.codecs.up.name, self.codecs.down.name, run_info_fields or {}
        )
        self.backbone = Backbone(config, store, self.layout, self.codecs, params, self.run_info)
        self.registry = Registry(config.rounds.peer_ttl_s)
        self.loop_clock = LoopClock()  # the relay's clock: deadlines on the relay count on it
        self.loop_clock.on_stall.append(self.excuse_silence)
        self.backbone.peer_ids = lambda: list(self.registry.peers)
        self.leaderboard = Leaderboard(store, self.registry)
        self.traffic = Traffic()  # bytes both ways; the samples are counted as steps are published
        self.after_publish = AfterPublish(
            store, self.backbone, self.leaderboard, self.traffic, self.observers, self.status
        )  # every publisher's (rounds, the pipeline) last steps
        self.rounds = RoundCycle(
            config, store, self.backbone, self.registry, self.after_publish, clock=self.loop_clock, opening=opening
        )
        self.gradients = GradientIntake(
            max_staleness=config.run.max_staleness,
            rounds=self.rounds,
            registry=self.registry,
            backbone=self.backbone,
            traffic=self.traffic,
            admit=self.peer,
        )
        """Peers' gradients for the open round: whole uploads, sliced rounds' tickets and done."""
        self.starting = StartingVersion(config, store, self.rounds, self.backbone, parameters_kept_elsewhere)
        self.started = time.monotonic()
        self.figures: Callable[[], RunFigures | None] = lambda: None
        """What a feature that makes the run's steps counts instead of the rounds' figures
        (set by the feature set while such a feature runs: :meth:`report_figures_from`)."""
        self.amendments: tuple[Callable[[StatusReport], StatusReport], ...] = ()
        """What the running features add to the report (:meth:`amend_reports_with`)."""

    def report_figures_from(self, figures: Callable[[], RunFigures | None]) -> None:
        """Status and progress take ``figures`` in place of the rounds' own (the pipeline's)."""
        self.figures = figures

    def amend_reports_with(self, *amendments: Callable[[StatusReport], StatusReport]) -> None:
        """:meth:`status` passes its report through ``amendments`` in order (local SGD's outer
        loop): the core report names no feature, and the observers' step events carry them too."""
        self.amendments = amendments

    async def start(self) -> None:
        """Before serving: finish resuming (:meth:`StartingVersion.gather`: a relay restarted
        while aggregators owned slices gathers its last version from them)."""
        await self.starting.gather()

    def close(self) -> None:
        self.backbone.close()

    # --- properties ---------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The published version (:attr:`RoundCycle.step`)."""
        return self.rounds.step

    @property
    def num_params(self) -> int:
        return self.run_info.num_params

    # The relay's own slice: the whole vector unless aggregators own parts of it.
    @property
    def master(self) -> MasterState:
        return self.rounds.master

    @property
    def reducer(self) -> Reducer:
        """The relay's own slice's reducer, or an empty one (:attr:`RoundCycle.reducer`)."""
        return self.rounds.reducer

    @property
    def publisher(self) -> Publisher:
        return self.rounds.publisher

    @property
    def finished(self) -> bool:
        return self.rounds.finished

    def state(self) -> CollabState:
        return collab_state(
            self.registry,
            self.run_cfg,
            self.step,
            self.rounds.round,
            self.finished,
            self.config.master_optimizer(),
            self.store.rate.samples_per_s()[0],
            self.figures(),
        )

    # --- registry -----------------------------------------------------------------------------
    def join(self, req: JoinRequest, username: str) -> JoinResponse:
        if req.protocol != PROTOCOL_VERSION:
            raise ApiError(
                400,
                "protocol_mismatch",
                f"peer speaks protocol {req.protocol}, relay {PROTOCOL_VERSION}",
                "Install the same collabtrain version as the relay (pip install -U collabtrain).",
            )
        pinned = self.run_cfg.precision
        if pinned and req.precision != pinned:
            raise ApiError(
                409,
                "precision_mismatch",
                f"this run trains in {pinned} only; the peer asked for {req.precision or 'no policy'}",
                "Let the toolkit choose (it follows the run's pin), or join from hardware that runs it.",
            )
        peer = Peer(
            peer_id=secrets.token_hex(16),
            name=req.peer_name,
            username=username,
            device=dict(req.device),
            precision=req.precision,
            version=self.step,
        )
        self.registry.add(peer)
        self.store.upsert_peer(peer.peer_id, peer.name, username, json.dumps(req.device))
        log.info("peer %s (%s, %s) joined at step %d", peer.name, username, peer.device_label, self.step)
        return JoinResponse(peer_id=peer.peer_id, run=self.run_info, state=self.state())

    def peer(self, peer_id: str) -> Peer:
        """The live peer, re-admitting one the relay knew before a restart."""
        peer = self.registry.get(peer_id)
        if peer is None:
            known = self.store.known_peer(peer_id)
            if known is None:
                raise unknown_peer(peer_id)
            name, username, device = known
            peer = self.registry.add(
                Peer(peer_id=peer_id, name=name, username=username, device=json.loads(device), precision=None)
            )
            log.info("peer %s is back", name)
        self.registry.touch(peer)
        return peer

    def heartbeat(self, peer_id: str, hb: Heartbeat) -> CollabState:
        peer = self.peer(peer_id)
        if hb.version > self.step:
            raise ApiError(
                409,
                "version_ahead",
                f"peer claims version {hb.version} but the relay is at {self.step}",
                "Download the current parameters (the relay may have been rolled back).",
            )
        self.registry.report(peer, hb)
        self.backbone.planning.observe_samples_per_s(peer.peer_id, hb.samples_per_s)
        self.rounds.maybe_open(peer)
        self.rounds.update_membership(peer)
        return self.state()

    def leave(self, peer_id: str) -> None:
        peer = self.registry.remove(peer_id)
        if peer is not None:
            log.info("peer %s left", peer.name)
            self._forget(peer.peer_id)

    def _forget(self, peer_id: str) -> None:
        self.backbone.planning.forget_peer(peer_id)
        self.rounds.drop(peer_id)

    # --- versions, housekeeping, reports ---------------------------------------------------------
    async def rollback(self, to_step: int) -> int:
        """Publish the stored state of version ``to_step`` as the next version (:meth:`RoundCycle.rollback`)."""
        return await self.rounds.rollback(to_step)

    async def wait_for_step(self, min_step: int, timeout_s: float) -> Published | None:
        """Long-poll: the first published version with ``step >= min_step``, or None."""
        return await self.backbone.board.wait(min_step, timeout_s)

    async def tick(self) -> None:
        """Housekeeping, every fraction of a second: expire silent peers and aggregators, enforce
        deadlines, re-plan on changed measurements."""
        for peer in self.registry.expire():
            log.info("peer %s timed out", peer.name)
            self._forget(peer.peer_id)
        if self.backbone.board.latest is None:  # no version yet: a pipeline's stages load after the ticker starts
            return
        self.rounds.maybe_finalize()
        self.backbone.expire()
        self.backbone.maybe_replan()
        if self.rounds.round is None:
            self.rounds.maybe_open()  # also starts a pending plan change

    async def run_ticker(self, period_s: float = 0.1) -> None:
        """Beat the relay's clock (:mod:`relay_server.core.loop_clock`: a stall it finds is
        excused before this tick expires anyone), then :meth:`tick`, every ``period_s``."""
        self.loop_clock.resume()
        try:
            while True:
                self.loop_clock.beat()
                try:
                    await self.tick()
                except Exception:  # the ticker (and the relay's clock) must outlive any one bad tick
                    log.exception("relay tick failed")
                await asyncio.sleep(period_s)
        finally:
            self.loop_clock.report.flush(final=True)

    def excuse_silence(self, seconds: float) -> None:
        """The relay itself did not listen for ``seconds`` (its event loop stalled: a slow disk,
        swap, a starved VM): heartbeats sent meanwhile wait unread in its sockets, so that time
        counts toward no peer's or aggregator's silence. Without this, one stall longer than a TTL
        declares every peer and aggregator dead at the next tick, and a sliced run recovers slices
        from the relay's (older) copy for nothing. (The loop clock's report logs the stalls.)"""
        self.registry.excuse_silence(seconds)
        self.backbone.aggregators.excuse_silence(seconds)

    def state_info(self) -> StateInfo:
        latest = self.backbone.board.latest
        return StateInfo(step=latest.step, num_params=self.num_params, sha256=latest.sha256)

    def plan_info(self) -> PlanInfo:
        """Who aggregates what. Until extra aggregators join, the relay owns the whole vector."""
        return self.backbone.plan_info()

    def run_summary(self) -> RunSummary:
        figures = self.figures()
        return run_summary(self.config, self.num_params, figures.mode if figures is not None else None)

    def status(self) -> StatusReport:
        figures = self.figures()
        report = status_report(
            self.config,
            self.store,
            self.registry,
            self.state(),
            self.plan_info(),
            self.num_params,
            self.started,
            self.leaderboard,
            self.traffic,
            self.rounds.refused_steps + self.backbone.refused_rounds,
            figures,
        )
        for amend in self.amendments:
            report = amend(report)
        return report
