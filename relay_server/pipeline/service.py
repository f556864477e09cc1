"""The pipeline as the relay runs it: built from ``[pipeline]`` and the collaboration's services,
ticked until stopped. Outside HTTP, so the routes (:mod:`relay_server.pipeline.feature`) only
translate requests, and a test or a tool can build, tick and read it without a server.

What a tick does, in order: excuse a stall of the relay's loop that just ended, hand the tasks of
workers that left the registry back to the pool, recompute what silent workers hold, expire
leases, then the coordinator's own upkeep (lapses, holds, restarts, empty stages, deliveries
no worker reported, a finalize to retry).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from relay_server.collaboration.machine import Collaboration
from relay_server.collaboration.publishing import AfterPublish
from relay_server.core.config import RelayConfig
from relay_server.pipeline.batch_rounds import BatchOutcome
from relay_server.pipeline.boundaries import Boundaries
from relay_server.pipeline.coordinator import PipelineCoordinator, PipelineDeps, PipelineShape
from relay_server.pipeline.plan import Planner
from relay_server.pipeline.stage_owners import StageOwners
from relay_server.pipeline.workers import Workers
from relay_server.rounds.master import lr_at
from relay_server.rounds.store import RoundLog
from relay_server.tasks.broker import TaskBroker
from relay_server.tasks.payload_store import PayloadStore
from toolkit.wire.compression import boundary_codec

if TYPE_CHECKING:
    from relay_server.pipeline.model_cut import ModelCut
    from relay_server.pipeline.run_memory import PipelineMemory
    from relay_server.trust.referee import Referee

log = logging.getLogger(__name__)
TICK_S = 0.1


class PipelinePublisher:
    """A batch's step, recorded as the pipeline's round and sent through the relay's one
    after-publish sequence (:class:`relay_server.collaboration.publishing.AfterPublish`)."""

    def __init__(self, config: RelayConfig, after_publish: AfterPublish, owners: StageOwners) -> None:
        self.config, self.after_publish, self.owners = config, after_publish, owners

    async def __call__(self, batch: BatchOutcome) -> None:
        record = RoundLog(
            contributions=batch.contributions,
            loss=batch.loss_sum / batch.samples if batch.samples else None,
            duration_s=batch.elapsed_s,
            deadline_s=0.0,
            finalized_by=batch.finalized_by,
            lr=lr_at(batch.published.step - 1, self.config.optimizer, self.config.run.total_steps),
            grad_norm=batch.grad_norm,
            samples=batch.samples,
        )
        # the whole model the stages' finalize wrote: what export, evaluation and Hub checkpoints read
        await self.after_publish.step(batch.published, record, batch.samples, state_path=self.owners.whole_path)


class PipelineService:
    """The coordinator, its stages' parameter servers and the ticker, over one collaboration."""

    def __init__(
        self, config: RelayConfig, collab: Collaboration, owners: StageOwners, coordinator: PipelineCoordinator
    ) -> None:
        self.config, self.collab, self.owners, self.coordinator = config, collab, owners, coordinator
        self.ticker: asyncio.Task[None] | None = None
        self.memory: PipelineMemory | None = None
        """What the relay and each stage's worker are predicted to hold (``GET /api/pipeline``)."""

    @classmethod
    async def build(cls, config: RelayConfig, collab: Collaboration) -> PipelineService:
        """Cut the model, resume or start every stage, mint the first batch; publish its version."""
        from relay_server.pipeline.model_cut import cut_model  # torch and the stage code: pipeline relays only
        from relay_server.pipeline.run_memory import predict_memory

        cfg = config.pipeline
        cut = await asyncio.to_thread(cut_model, config)
        resume = collab.store.latest_step() if collab.store.get_meta("manifest") else None
        owners = await asyncio.to_thread(
            StageOwners,
            config,
            collab.layout,
            collab.codecs,
            collab.master.flat.numpy(),
            cut.cuts,
            resume,
            collab.store,
            cut.tied,
        )
        broker = TaskBroker(
            PayloadStore(1 << 20, None),
            max_queued_rows=1 << 30,
            initial_lease_s=cfg.initial_lease_s,
            lease_floor_s=cfg.lease_floor_s,
            lease_factor=cfg.lease_factor,
            clock=collab.loop_clock,
        )  # leases count on the relay's clock: a stall expires none
        shape = PipelineShape(
            layers=list(cut.layers),
            microbatch_size=cfg.microbatch_size,
            microbatches_per_batch=cfg.microbatches_per_batch,
            shapes=cut.shapes,
            codec=boundary_codec(cfg.boundary_codec),
            dispatch=cfg.dispatch,
            rebalance_every=cfg.rebalance_every_batches,
            max_staleness=config.run.max_staleness,
            check_share=cfg.check_share,
            precision=config.run.precision,
            probation=cfg.probation_checks,
            rollback_batches=cfg.rollback_batches,
        )
        deps = PipelineDeps(
            owners=owners,
            broker=broker,
            boundaries=Boundaries(cfg.boundary_memory_mb << 20, Path(config.server.data_dir) / "boundaries"),
            workers=Workers([e - s for s, e in cut.cuts], cut.stage_bytes(), sticky=cfg.dispatch == "static"),
            planner=Planner(cut.model, cut.plan_config, list(cut.layers)),
            ticket_key=collab.backbone.ticket_key,
            publish=PipelinePublisher(config, collab.after_publish, owners),
            clock=collab.loop_clock,
            referee=_referee(config, cut, owners) if cfg.check_share > 0 else None,
            on_ban=lambda worker, reason: _ban_user(config, collab, worker, reason),
        )
        service = cls(config, collab, owners, PipelineCoordinator(shape, deps))
        service.memory = predict_memory(config, cut)
        if resume is not None:  # the workers' credit so far, as the store committed it
            service.coordinator.figures.resume(await asyncio.to_thread(collab.store.contributions))
        collab.backbone.board.publish(owners.published())
        log.info(
            "pipeline: %d stages of %s layers, %d micro-batches of %d per batch; waiting for workers",
            len(cut.cuts),
            cut.layers,
            cfg.microbatches_per_batch,
            cfg.microbatch_size,
        )
        log.info(
            "pipeline memory predicted: this relay %d MiB, a worker of each stage %s MiB (GET /api/pipeline "
            "states every term)",
            service.memory.relay.total >> 20,
            [w >> 20 for w in service.memory.worker_bytes()],
        )
        return service

    async def start(self) -> None:
        self.ticker = asyncio.create_task(self._tick_forever())

    async def stop(self) -> None:
        if self.ticker is not None:
            self.ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.ticker
        self.owners.close()

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.tick()
            except Exception:  # the ticker must outlive any one bad tick
                log.exception("pipeline tick failed")

    def tick(self) -> None:
        coordinator, registry = self.coordinator, self.collab.registry
        self.collab.loop_clock.beat()  # a stall just ended is excused before silence is judged below
        live = registry.peers
        for worker in [w for w in coordinator.workers.by_id if w not in live]:
            log.info("pipeline worker %s left: its tasks go back to the pool", worker[:16])
            coordinator.worker_left(worker)
        now = time.monotonic()
        coordinator.orphan_silent(
            {
                w: now - peer.last_seen
                for w in coordinator.workers.by_id
                if (peer := registry.get(w)) is not None and peer.inflight == 0
            }
        )
        coordinator.broker.tick()
        coordinator.guard.note_lapses()
        coordinator.guard.expire_holds()
        coordinator.restart_lost()
        coordinator.staff_empty_stages()
        coordinator.trust.expire()  # a spot check no worker can serve any more is dropped, not waited for
        coordinator.check_delivered()  # an owner's commit no worker reported (it died right after)
        coordinator.rounds.retry_finalize()


def _referee(config: RelayConfig, cut: ModelCut, owners: StageOwners) -> Referee:
    """The relay's own copy of the stages (:mod:`relay_server.trust.referee`), on the masters the
    stages' parameter servers hold."""
    from relay_server.trust.referee import Referee

    return Referee(
        config.model.spec(),
        list(cut.layers),
        lambda k: (owners.step, owners.owners[k].master.flat.numpy()),
        width=cut.shapes.width,
        microbatch_size=config.pipeline.microbatch_size,
        codec=boundary_codec(config.pipeline.boundary_codec),
        precision=config.run.precision,
    )


def _ban_user(config: RelayConfig, collab: Collaboration, worker: str, reason: str) -> None:
    """A pipeline worker was caught lying: on a run with verified usernames its user is banned
    like one an organizer bans (the store's ban list, ``GET /api/admin/bans``; every peer of the
    user leaves); on an open run, where nobody has a verified name, the pipeline refuses its id."""
    peer = collab.registry.get(worker)
    if peer is None or not peer.username or config.auth.mode == "open":
        return
    collab.store.ban(peer.username, f"pipeline results failed a spot check: {reason}"[:500])
    for other in [p.peer_id for p in list(collab.registry.peers.values()) if p.username == peer.username]:
        collab.leave(other)
