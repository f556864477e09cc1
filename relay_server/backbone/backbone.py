"""The relay's side of extra aggregators: who owns which slice of the vector, and moving slices.

Roles (DESIGN.md s3-6). The relay keeps the registry, the rounds and the store, and owns a slice
itself (``local``; in the LP it is a receiver with no compute). Each live aggregator owns the
slice the executing plan assigns it. With no aggregator the relay owns ``[0, P)`` and everything
runs exactly as a single relay (``single``): whole-vector uploads, parameters served from the
relay's own version file. The plan comes from measurements (:mod:`relay_server.planning.policy`);
a new solution moves slices only when an owner appears or disappears or a share moves by more
than ``aggregators.min_share_change``. Who the aggregators are and whether they live is
:mod:`.aggregators`; what a slicing is made of (owners, manifests, stitched state) is :mod:`.slicing`.

Moving slices (a *migration*) happens only between rounds: the relay assembles the whole state
(parameters, public copy, optimizer state) at the published step from the current owners, then
each new owner pulls its slice from the relay. Cost: the state crosses the relay's link twice
(in and out), about 2 x 16 bytes/param with Adam -- which is why the hysteresis exists. Every
new owner's first version is downloaded whole by peers (a delta needs the previous version's
public copy of exactly that slice on the owner).

Recovery (:mod:`relay_server.backbone.recovery`). When an aggregator dies (silent past ``ttl_s``, or a
failed grad-norm/finalize/assign/state call) the round completes without it: its slice takes the relay's
copy -- parameters at most ``params_copy_every`` steps old (default one), optimizer state at
most ``state_copy_every`` steps old -- the plan is re-solved without it, and peers download the new version whole. Peers whose
upload to it failed lose only that slice's contribution. If it dies between rounds and the
copy does not hold the published version of its slice, the copy is published as the next
version right away (a step without a gradient): waiting for a round could wait forever when
no peer downloaded that version before the owner died.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from relay_server.backbone.aggregators import Aggregator, Aggregators
from relay_server.backbone.closing import RoundCloser
from relay_server.backbone.link_load import relay_link_load, state_bytes_per_param
from relay_server.backbone.recovery import RecoveryCopy
from relay_server.backbone.slice_owner import SliceOwner
from relay_server.backbone.slicing import (
    RELAY_ONLY,
    NotReady,
    Owner,
    Published,
    manifest_version,
    owners_for,
    plan_info,
    restore_dead,
    stitch,
)
from relay_server.backbone.state_transfer import CallFailed, InternalClient, cut
from relay_server.backbone.tickets import new_ticket_key
from relay_server.core.config import RelayConfig
from relay_server.core.errors import ApiError
from relay_server.planning.planner import Plan
from relay_server.planning.policy import RELAY_ID, Planning
from relay_server.planning.problem import PeerCapacity
from relay_server.rounds.master import slice_boundaries
from relay_server.rounds.publisher import Board
from relay_server.rounds.reducer import Reducer, robust_config
from relay_server.rounds.store import Store
from toolkit.wire.compression import RunCodecs
from toolkit.wire.protocol import (
    ROUTES,
    AggregatorHeartbeat,
    AggregatorRegistration,
    AggregatorWelcome,
    AssignRequest,
    ParamsManifest,
    ParamSpec,
    PlanInfo,
    PlanInput,
    PlanSlice,
    RunInfo,
    SliceReport,
)

log = logging.getLogger(__name__)


class Backbone:
    def __init__(
        self,
        config: RelayConfig,
        store: Store,
        layout: list[ParamSpec],
        codecs: RunCodecs,
        params: np.ndarray,
        run_info: RunInfo,
    ) -> None:
        self.config, self.store, self.layout, self.codecs, self.run_info = config, store, layout, codecs, run_info
        self.cfg = config.aggregators
        self.num_params = int(params.size)
        self.boundaries = slice_boundaries(
            layout, config.master_optimizer()
        )  # where the plan may cut (None: anywhere)
        self.planning = Planning(self.cfg, self.num_params, config.run.target_batch)
        self.local: SliceOwner | None = self._new_owner(
            {"params": params}, 0, self.num_params, 0, RELAY_ONLY, adopt=True
        )
        self.owners = [Owner(RELAY_ID, RELAY_ID, "", 0, self.num_params, 1.0)]
        self.plan: Plan | None = None  # the executing plan (None: relay only)
        self.board = Board()  # of Published
        self.ticket_key = new_ticket_key()
        self.aggregators = Aggregators(config, self.planning, run_info, self.ticket_key)
        self.pending: Plan | None = None
        self.migrating = False
        self.staging: tuple[int, dict[str, np.ndarray]] | None = None  # state served to new owners
        self.copy: RecoveryCopy | None = None
        self._copy_task: asyncio.Task[None] | None = None
        self.client: InternalClient | None = None
        self.peer_ids: Callable[[], list[str]] = lambda: list(self.planning.samples_per_s)
        self._checked = -math.inf
        self._empty_reducer: Reducer | None = None
        self.refused_rounds = 0  # sliced rounds in which some owner refused its step

    def _new_owner(
        self, state: dict[str, np.ndarray], start: int, end: int, step: int, plan_version: str, *, adopt: bool = False
    ) -> SliceOwner:
        return SliceOwner(
            self.layout,
            state,
            start=start,
            end=end,
            step=step,
            optimizer=self.config.master_optimizer(),
            total_steps=self.config.run.total_steps,
            codecs=self.codecs,
            store=self.store,
            download_feedback=self.config.run.download_feedback,
            fsync=self.config.server.fsync,
            robust=robust_config(self.config.rounds),
            run_name=self.config.run.name,
            plan_version=plan_version,
            on_transfer=self.planning.record_transfer,
            adopt=adopt,
        )

    def attach(self, admin_token: str) -> None:
        """Called by the app's lifespan: the token internal calls carry."""
        self.client = InternalClient(admin_token, self.cfg.call_timeout_s)

    async def aclose(self) -> None:
        if self._copy_task is not None:
            self._copy_task.cancel()
        if self.client is not None:
            await self.client.close()

    def close(self) -> None:
        if self.local is not None:
            self.local.close()
        if self._empty_reducer is not None:
            self._empty_reducer.close()

    @property
    def empty_reducer(self) -> Reducer:
        """A reducer over no elements, for callers of the relay's reducer when it owns no slice."""
        if self._empty_reducer is None:
            self._empty_reducer = Reducer(np.zeros(0, dtype=np.float32), self.codecs.up)
        return self._empty_reducer

    # --- what the rest of the relay asks ----------------------------------------------------------
    @property
    def single(self) -> bool:
        """The relay owns the whole vector: the single-relay path, unchanged."""
        return len(self.owners) == 1 and self.owners[0].owner_id == RELAY_ID

    @property
    def plan_version(self) -> str:
        return self.plan.version if self.plan is not None and not self.single else RELAY_ONLY

    def round_slices(self) -> list[PlanSlice]:
        return [] if self.single else [o.plan_slice() for o in self.owners]

    def plan_info(self) -> PlanInfo:
        load = relay_link_load(
            self.config,
            self.codecs,
            self.owners,
            self.num_params,
            len(self.peer_ids()),
            state_bytes_per_param(self.local, self.copy, self.num_params),
        )
        return dataclasses.replace(
            plan_info(self.plan, self.plan_version, self.owners, self.planning, self.aggregators.statuses()),
            relay_link=load,
        )

    # --- aggregators (:mod:`.aggregators`) -------------------------------------------------------
    def register(self, req: AggregatorRegistration) -> AggregatorWelcome:
        return self.aggregators.register(req)

    def heartbeat(self, aggregator_id: str, hb: AggregatorHeartbeat) -> None:
        self.aggregators.heartbeat(aggregator_id, hb)

    def expire(self) -> None:
        self.aggregators.expire({o.owner_id for o in self.owners})

    # --- the plan ---------------------------------------------------------------------------------
    def maybe_replan(self, *, now: float | None = None) -> None:
        """Re-solve when membership or measurements changed materially (rate-limited); a solution
        that moves slices becomes ``pending`` until the relay is between rounds."""
        if (not self.aggregators and self.single) or self.migrating:
            return  # no aggregator ever joined (or all are gone and their slices recovered)
        now = time.monotonic() if now is None else now
        if now - self._checked < 0.5:  # the relay ticks every 0.1 s; inputs need not be rebuilt as often
            return
        self._checked = now
        caps, inputs = self._capacities()
        if self.planning.due(caps, now):
            plan = self.planning.solve(caps, inputs)
            if plan is not None and self._moves_slices(plan):
                self.pending = plan

    def _capacities(self) -> tuple[list[PeerCapacity], list[PlanInput]]:
        return self.planning.capacities(self.aggregators.live(), self.peer_ids())

    def _moves_slices(self, plan: Plan) -> bool:
        current = {o.owner_id: o.fraction for o in self.owners}
        if set(plan.fractions) != set(current) or any(not self.aggregators.alive(o) for o in current):
            alive = all(self.aggregators.alive(o) for o in current)
            # cuts snapped to tensor boundaries can leave an owner without a slice: same cuts, no move
            return not (alive and self._cuts(self._owners_for(plan)) == self._cuts(self.owners))
        return max(abs(plan.fractions[k] - current[k]) for k in current) > self.cfg.min_share_change

    @staticmethod
    def _cuts(owners: list[Owner]) -> list[tuple[str, int, int]]:
        return [(o.owner_id, o.start, o.end) for o in owners]

    # --- rounds -----------------------------------------------------------------------------------
    async def finalize(self, step: int, round_id: str) -> tuple[Published, float]:
        """Every owner closes round ``round_id`` and applies its step (:mod:`.closing`: first the
        global norm when clipping); returns version ``step + 1`` and the mean gradient's global
        norm. An owner that does not answer is dead: its slice is recovered and the slices re-planned."""
        closer = RoundCloser(self.owners, self.local, self.aggregators, self.client, self.plan_version)
        closed = await closer.close(step, round_id, clip=self.config.master_optimizer().clip_grad_norm > 0)
        if closed.refused:  # those slices hold version step + 1 unchanged: nothing non-finite is published
            self.refused_rounds += 1
            log.error(
                "step %d: %d slice(s) refused their step (it would have been non-finite)", step + 1, closed.refused
            )
        if closed.dead:
            return await self._recover(step + 1, closed.dead), closed.grad_norm
        shas = {o.owner_id: closed.reports[o.owner_id].sha256 for o in self.owners}
        return self._published(step + 1, shas), closed.grad_norm

    def _published(self, step: int, shas: dict[str, str]) -> Published:
        return manifest_version(step, self.owners, shas, self.num_params, self.plan_version)

    # --- migrations -------------------------------------------------------------------------------
    async def migrate(self, step: int) -> tuple[Published | None, bool]:
        """Between rounds: install the pending plan at the published ``step``. Returns the new
        publication (None if nothing moved) and whether it is a new version: when a dead owner's
        slice has no copy of ``step``, its copy's older parameters go into version ``step + 1``
        (a step without a gradient) -- waiting for a round instead could wait forever, if no peer
        managed to download ``step`` before the owner died."""
        plan, self.pending = self.pending, None
        if plan is None:
            return None, False
        dead = [o for o in self.owners if not self.aggregators.alive(o.owner_id)]
        self.migrating = True
        try:
            try:
                state, _ = await self._assemble(step, dead=dead, strict=True)
            except NotReady as exc:
                log.warning("%s: publishing the copy as step %d", exc, step + 1)
                return await self._recover(step + 1, dead, bump=True), True
            return await self._install(plan, step, state), False
        finally:
            self.migrating = False

    async def _recover(self, step: int, dead: list[Owner], *, bump: bool = False) -> Published:
        """Rebuild version ``step`` from the live owners (at ``step``, or at ``step - 1`` with
        ``bump``: a version without a gradient) and the copy of the dead owners' slices, then
        re-plan without the dead."""
        self.migrating = True
        try:
            state, _ = await self._assemble(step - 1 if bump else step, dead=dead, strict=False)
            self.pending = None
            return await self._install(self.planning.solve(*self._capacities()), step, state)
        finally:
            self.migrating = False

    async def _assemble(self, step: int, *, dead: list[Owner], strict: bool) -> tuple[dict[str, np.ndarray], bool]:
        """The whole state at ``step``: live owners export theirs, dead ones' come from the copy
        (``strict``: only if the copy holds exactly the published parameters of that slice).
        Also returns whether any slice came from the copy."""
        parts: dict[Owner, dict[str, np.ndarray]] = {}
        dead = list(dead)
        for owner in self.owners:
            if owner in dead:
                continue
            if owner.owner_id == RELAY_ID:
                # RELAY_ID's owner is the relay's own slice: local holds it
                got_step, parts[owner] = await self.local.reducer.run(self.local.export)  # type: ignore[union-attr]
            else:
                try:
                    # an aggregator's slice: the client is attach()'s, made when the app started
                    meta, parts[owner], _ = await self.client.fetch_tensors(  # type: ignore[union-attr]
                        self.aggregators[owner.owner_id].url + ROUTES["slice_state"], {"step": str(step)}
                    )
                    got_step = int(meta.get("step", -1))
                except CallFailed as exc:
                    self.aggregators.mark_dead(owner.owner_id, f"state pull failed: {exc}")
                    dead.append(owner)
                    continue
            if got_step != step:
                raise RuntimeError(f"owner {owner.owner_id} is at step {got_step}, expected {step}")
        state = stitch(parts, self.num_params, self.copy)
        published = self.board.latest.manifest if self.board.latest else None
        restore_dead(state, dead, self.copy, step, published, strict=strict)
        return state, bool(dead)

    async def _install(self, plan: Plan | None, step: int, state: dict[str, np.ndarray]) -> Published:
        """Make ``plan``'s owners hold ``state`` at ``step`` (the relay alone when ``plan`` is None
        or an aggregator fails to take its slice). Every owner's first version is downloaded whole."""
        self.staging = (step, state)
        owners = self._owners_for(plan)
        version = plan.version if plan is not None else RELAY_ONLY
        try:
            shas = await self._assign(owners, version, step, state)
        except CallFailed as exc:
            log.warning("plan %s could not be installed (%s); the relay takes the whole vector", version, exc)
            plan, owners, version = None, self._owners_for(None), RELAY_ONLY
            shas = await self._assign(owners, version, step, state)
        self.plan, self.owners = plan, owners
        self.copy = RecoveryCopy.of(state, step, {(o.start, o.end): shas[o.owner_id] for o in owners})
        self.staging = None
        if not self.single:
            await self.copy.save(self._copy_path(), fsync=self.config.server.fsync)
        log.info("step %d now sliced as %s", step, ", ".join(f"{o.name}[{o.start}:{o.end}]" for o in owners))
        if self.single:  # the relay owns the whole vector: local holds it, its first version published above
            latest = self.local.publisher.latest  # type: ignore[union-attr]
            return Published(step=step, sha256=latest.sha256, version=latest)  # type: ignore[union-attr]
        return self._published(step, shas)

    def _owners_for(self, plan: Plan | None) -> list[Owner]:
        return owners_for(plan, self.num_params, self.aggregators, self.boundaries)

    async def _assign(
        self, owners: list[Owner], version: str, step: int, state: dict[str, np.ndarray]
    ) -> dict[str, str]:
        """New local owner from ``state``; remote owners pull theirs. Returns each slice's sha256."""

        async def remote(owner: Owner) -> str:
            agg = self.aggregators[owner.owner_id]
            if not agg.alive:
                raise CallFailed(f"{agg.name} is dead")
            try:  # the client is attach()'s, made when the app started
                report = await self.client.call(  # type: ignore[union-attr]
                    "POST",
                    agg.url + ROUTES["assign"],
                    SliceReport,
                    AssignRequest(plan_version=version, step=step, start=owner.start, end=owner.end),
                )
            except CallFailed as exc:
                self.aggregators.mark_dead(owner.owner_id, f"assign failed: {exc}")
                raise
            if (report.step, report.start, report.end) != (step, owner.start, owner.end):
                raise CallFailed(f"{agg.name} answered {report}")
            return report.sha256

        mine = next((o for o in owners if o.owner_id == RELAY_ID), None)
        old, self.local = self.local, None
        if mine is not None:
            self.local = await asyncio.to_thread(
                self._new_owner, cut(state, mine.start, mine.end), mine.start, mine.end, step, version
            )
            self.local.publisher.publish(await self.local.reducer.run(self.local.write_initial))
        if old is not None:
            await asyncio.to_thread(old.close)
        shas = {}
        results = await asyncio.gather(*(remote(o) for o in owners if o.owner_id != RELAY_ID), return_exceptions=True)
        for owner, result in zip([o for o in owners if o.owner_id != RELAY_ID], results):
            if isinstance(result, BaseException):
                raise result if isinstance(result, CallFailed) else CallFailed(repr(result))
            shas[owner.owner_id] = result
        if mine is not None:  # self.local was made from mine above, its first version published
            shas[RELAY_ID] = self.local.publisher.latest.sha256  # type: ignore[union-attr]
        return shas

    def staged(self, start: int, end: int, step: int) -> dict[str, np.ndarray]:
        if self.staging is None or self.staging[0] != step:
            raise ApiError(409, "no_staged_state", f"no state of step {step} is being handed out")
        return cut(self.staging[1], start, end)

    # --- the recovery copy ------------------------------------------------------------------------
    def after_publish(self, published: Published) -> None:
        """Start pulling the remote slices of ``published`` into the copy (in the background), on
        the steps ``params_copy_every`` and ``state_copy_every`` name."""
        busy = self._copy_task is not None and not self._copy_task.done()
        due = published.step % self.cfg.params_copy_every == 0 or published.step % self.cfg.state_copy_every == 0
        if published.manifest is None or self.copy is None or busy or not due:
            return
        self._copy_task = asyncio.get_running_loop().create_task(self._pull_copy(published.manifest))

    async def _pull_copy(self, manifest: ParamsManifest) -> None:
        with_state = manifest.step % self.cfg.state_copy_every == 0
        urls = {
            s.aggregator_id: self.aggregators[s.aggregator_id].url
            for s in manifest.slices
            if s.aggregator_id != RELAY_ID and self.aggregators.alive(s.aggregator_id)
        }
        # after_publish() starts this only with a copy; the client is attach()'s, made when the app started
        await self.copy.pull(self.client, manifest, urls, with_state)  # type: ignore[union-attr, arg-type]
        if with_state:
            await self.copy.save(self._copy_path(), fsync=self.config.server.fsync)  # type: ignore[union-attr]

    def _copy_path(self) -> Path:
        return self.store.dir / "state" / "recovery-copy.safetensors"

    # --- restarts ---------------------------------------------------------------------------------
    async def resume(self, step: int, manifest: ParamsManifest) -> tuple[Published, bool]:
        """After a relay restart with aggregators: gather the state of version ``step`` from the
        relay's own slice file and the aggregators named in ``manifest`` (which keep theirs), into
        the relay alone. A slice whose aggregator is gone comes from the persisted copy, and the
        result is published as ``step + 1`` (returns True then). The aggregators re-register and
        the next plan slices the vector again."""
        self.owners = []
        for s in manifest.slices:
            self.owners.append(Owner(s.aggregator_id, s.aggregator_id[:8], s.url, s.start, s.end, 0.0))
            if s.aggregator_id != RELAY_ID:
                self.aggregators.add(Aggregator(s.aggregator_id, s.aggregator_id[:8], s.url))
        mine = next((o for o in self.owners if o.owner_id == RELAY_ID), None)
        old, self.local = self.local, None
        if mine is not None:
            self.local = await asyncio.to_thread(
                self._new_owner,
                {"params": np.zeros(mine.end - mine.start, np.float32)},
                mine.start,
                mine.end,
                step,
                manifest.plan_version,
            )
            await asyncio.to_thread(self.local.publisher.restore, step)
        if old is not None:
            await asyncio.to_thread(old.close)
        self.copy = RecoveryCopy.load(self._copy_path())
        try:
            state, from_copy = await self._assemble(step, dead=[], strict=False)
        except RuntimeError as exc:
            raise RuntimeError(
                f"cannot resume step {step}: {exc}. Start the aggregators that held it, or start "
                "a new relay from a checkpoint (hub.init_from)."
            ) from None
        self.aggregators.clear()  # they register again (new ids, new ticket key)
        if from_copy:
            log.warning("resumed with slices from the relay's copy: publishing them as step %d", step + 1)
        published = await self._install(None, step + 1 if from_copy else step, state)
        log.info("resumed step %d from the relay's slice and %d aggregator(s)", step, len(manifest.slices) - 1)
        return published, from_copy
