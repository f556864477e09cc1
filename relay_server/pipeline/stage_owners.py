"""One parameter server per stage: each a :class:`~relay_server.backbone.slice_owner.SliceOwner`
of the stage's range of the flat vector, on the relay.

Why slice owners: they are the rounds every sliced run already uses -- ticketed, whole-or-nothing
uploads with digests and finite checks, the optimizer applied to the mean (exact large-batch
SGD per stage, the master on the server and no optimizer state on workers), versions a peer
downloads whole or as a delta and checks against the relay-signed manifest. A pipeline round is a
sliced round in which each worker uploads only its own stage's slice. Each stage keeps its version
files in its own store (``data_dir/stages/<k>``), so a restart resumes every stage at the step the
relay committed last; every step is also written whole into the relay's own store
(:mod:`.whole_model`), off the event loop like the stages' commits, for what reads a run's versions.

With delayed parameter updates a batch computes on the version before the latest: each stage
keeps serving that one too (:meth:`StageOwners.version`; its file is still in the store, which
always keeps the two newest versions).

Tied input/output embeddings (:mod:`.tied`): the last stage's owner reduces the head's gradient
of the tied matrix with its slice (its ``carry``), and :meth:`StageOwners.finalize` folds that
mean into stage 0's before the norm and the step.
"""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path

import numpy as np

from relay_server.backbone.slice_owner import SliceOwner
from relay_server.backbone.slicing import Owner, Published, manifest_version
from relay_server.core.config import RelayConfig
from relay_server.pipeline.tied import TiedEmbedding
from relay_server.pipeline.whole_model import write_whole_version
from relay_server.rounds.publisher import Version
from relay_server.rounds.reducer import robust_config
from relay_server.rounds.store import Store
from toolkit.wire.compression import RunCodecs
from toolkit.wire.protocol import ParamSpec

log = logging.getLogger(__name__)
PLAN_VERSION = "pipeline"


class StageOwners:
    def __init__(
        self,
        config: RelayConfig,
        layout: list[ParamSpec],
        codecs: RunCodecs,
        params: np.ndarray,
        cuts: list[tuple[int, int]],
        resume_step: int | None,
        whole_store: Store,
        tied: tuple[int, int] | None = None,
    ) -> None:
        """``whole_store``: the relay's own store, where each step's whole model goes. ``tied``:
        stage 0's range of a tied input/output embedding (:mod:`.tied`)."""
        self.config, self.cuts, self.num_params = config, cuts, int(params.size)
        self.tie = TiedEmbedding(*tied, len(cuts)) if tied is not None else None
        self.whole_store = whole_store
        self.whole_path: Path | None = None
        """The whole model's file of the step :meth:`finalize` last wrote (observers read it)."""
        data_dir = Path(config.server.data_dir) / "stages"
        # a late ban may return every stage to a version up to rollback_batches old (:mod:`.rollback`):
        # only where checks run, as only a check bans (the trust hooks roll back nothing otherwise)
        keep = config.server.keep_checkpoints
        if config.pipeline.check_share > 0 and config.pipeline.rollback_batches > 0:
            keep = max(keep, config.pipeline.rollback_batches + 2)
        self.stores = [Store(data_dir / str(k), keep=keep, fsync=config.server.fsync) for k in range(len(cuts))]
        self.owners: list[SliceOwner] = []
        self.kept: list[dict[int, Version]] = [{} for _ in cuts]
        """Each stage's latest version and the one before it (delayed updates compute on that), by step."""
        self.refused_rounds = 0  # batches in which some stage refused its step
        for k, (start, end) in enumerate(cuts):
            owner = SliceOwner(
                layout,
                {"params": params[start:end]},
                start=start,
                end=end,
                step=resume_step or 0,
                optimizer=config.optimizer,
                total_steps=config.run.total_steps,
                codecs=codecs,
                store=self.stores[k],
                fsync=config.server.fsync,
                robust=robust_config(config.rounds),
                run_name=config.run.name,
                plan_version=PLAN_VERSION,
                carry=self.tie.carry(k) if self.tie is not None else 0,
            )
            if resume_step is not None and self.stores[k].state_path(resume_step).exists():
                owner.publisher.restore(resume_step)  # a stage may be a step ahead: the relay's commit decides
                if resume_step > 0 and self.stores[k].state_path(resume_step - 1).exists():
                    self._keep(k, owner.publisher.describe(resume_step - 1))
            else:
                if resume_step is not None:
                    raise RuntimeError(
                        f"stage {k}'s store ({data_dir / str(k)}) does not hold step {resume_step}, "
                        "which the relay committed last: restore the whole data dir from one backup"
                    )
                version = owner.write_initial()
                owner.publisher.publish(version)
                self.stores[k].commit(version.step, version.sha256)
            self.owners.append(owner)
            self._keep(k, owner.publisher.latest)
        self.entries = [
            Owner(f"stage{k}", f"stage {k}", "", start, end, (end - start) / self.num_params)
            for k, (start, end) in enumerate(cuts)
        ]

    def close(self) -> None:
        for owner in self.owners:
            owner.close()
        for store in self.stores:
            store.close()

    @property
    def step(self) -> int:
        return self.owners[0].step

    def published(self) -> Published:
        """The current version: a manifest of every stage's slice and its hash."""
        shas = {
            e.owner_id: o.publisher.latest.sha256  # type: ignore[union-attr]  # __init__ publishes or restores each
            for e, o in zip(self.entries, self.owners)
        }
        return manifest_version(self.step, self.entries, shas, self.num_params, PLAN_VERSION)

    def version(self, stage: int, step: int) -> Version | None:
        """Stage ``stage``'s published version ``step`` if it is the latest or the one before it."""
        return self.kept[stage].get(step)

    def _keep(self, stage: int, version: Version | None) -> None:
        if version is not None:
            kept = self.kept[stage]
            kept[version.step] = version
            for old in [s for s in kept if s < version.step - 1]:
                del kept[old]

    def stage_of(self, start: int, end: int) -> int | None:
        return next((k for k, cut in enumerate(self.cuts) if cut == (start, end)), None)

    async def finalize(self, step: int, round_id: str) -> tuple[Published, float, list[int]]:
        """Every stage applies its optimizer to the mean of its round (clipping by the global
        norm over all stages when the run clips) and the whole model is written (:attr:`whole_path`);
        the new manifest, that norm and the samples each stage's round counted. A tied head's
        gradient is in stage 0's mean before any of that (:meth:`.tied.TiedEmbedding.fold`)."""
        if self.tie is not None:
            await self.tie.fold(self.owners, step, round_id)
        clip = self.config.optimizer.clip_grad_norm > 0
        global_norm = None
        if clip:
            squares = await asyncio.gather(*(o.grad_sq_norm(step, round_id) for o in self.owners))
            global_norm = math.sqrt(sum(squares))
        done = await asyncio.gather(*(o.finalize(step, round_id, global_norm) for o in self.owners))
        for k, (version, _, _) in enumerate(done):
            self._keep(k, version)
        refused = [k for k, (_, r, _) in enumerate(done) if r.refused]
        if refused:  # those stages publish their slice unchanged, never a non-finite one
            self.refused_rounds += 1
            log.error("step %d: stage(s) %s refused their step (it would have been non-finite)", step + 1, refused)
        for store, (version, _, _) in zip(self.stores, done):
            await asyncio.to_thread(store.commit, version.step, version.sha256)
        # before the relay commits the step (the caller): a committed step always has its file
        self.whole_path = await asyncio.to_thread(
            write_whole_version,
            self.whole_store,
            self.owners,
            self.num_params,
            done[0][0].step,
            self.config.run.name,
            self.config.server.fsync,
        )
        norm = global_norm if global_norm is not None else math.sqrt(sum(n * n for _, _, n in done))
        return self.published(), norm, [sum(r.received.values()) for _, r, _ in done]

    def holds(self, step: int) -> bool:
        """Whether every stage's store still holds version ``step``'s state (a rollback can reach it)."""
        return all(store.state_path(step).exists() for store in self.stores)

    async def rollback(self, to_step: int) -> Published:
        """Every stage's master and optimizer state as they were at version ``to_step``, published
        as the next version (versions only move forward: workers compare them, as a data-parallel
        rollback does, :meth:`relay_server.collaboration.round_cycle.RoundCycle.rollback`), peers
        download it whole; the whole model is written like a step's. Between rounds only."""
        new_step = self.step + 1

        def apply(owner: SliceOwner) -> Version:
            """On the owner's reducer thread, after any work pending there."""
            owner.publisher.load(to_step)
            owner.master.step = new_step
            owner.reducer.reset()
            return owner.publisher.write(new_step, owner.meta(rolled_back_to=str(to_step)), delta=False)

        versions = await asyncio.gather(*(o.reducer.run(apply, o) for o in self.owners))
        for k, (owner, version) in enumerate(zip(self.owners, versions)):
            owner.publisher.publish(version)
            self._keep(k, version)
            await asyncio.to_thread(self.stores[k].commit, version.step, version.sha256)
        self.whole_path = await asyncio.to_thread(
            write_whole_version,
            self.whole_store,
            self.owners,
            self.num_params,
            new_step,
            self.config.run.name,
            self.config.server.fsync,
        )
        log.warning("every stage rolled back to its state at version %d, published as version %d", to_step, new_step)
        return self.published()
