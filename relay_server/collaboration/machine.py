"""The collaboration: turns peers' progress into rounds and rounds into optimizer steps.

Life of a round (DESIGN.md s3): peers heartbeat their unsent samples; when the eligible samples
reach the target batch the relay opens round ``s`` for the peers holding them; each uploads the
sum of its gradients; the relay reduces as chunks arrive; the round finalizes when every expected
peer delivered, left or failed -- or at the adaptive deadline, whichever is first; the master
takes one optimizer step, the new version is persisted, then published to waiting peers.

With extra aggregators (:mod:`relay_server.backbone.coordinator`) the vector is cut into slices: a peer asks
for a ticket instead of uploading here (same checks), sends each slice to its owner, then says
it is done; the round closes on the same rules, every owner finalizes its slice, and the new
version is a manifest of the slices' hashes. Without aggregators none of that runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time

import torch

from relay_server.backbone.coordinator import Backbone, Published
from relay_server.core.config import RelayConfig
from relay_server.core.errors import ApiError, round_closed, round_closed_partial, unknown_peer
from relay_server.rounds.master import MasterState, flatten, layout_of, lr_at
from relay_server.observers.events import ObserverThread, StepEvent
from relay_server.rounds.registry import Peer, Registry
from relay_server.rounds.publisher import Publisher, Version
from relay_server.rounds.reducer import Reducer, UploadProgress
from relay_server.rounds.membership import DeadlinePolicy, Round, RoundClosedMidUpload
from relay_server.backbone.slice_owner import gradient_meta
from relay_server.rounds.store import RoundLog, Store
from relay_server.backbone.tickets import sign_ticket
from toolkit.models import build_model
from toolkit.wire.protocol import (PROTOCOL_VERSION, CollabState, DoneRequest, Heartbeat, JoinRequest, JoinResponse,
                              LeaderboardEntry, ModelSpec, ParamsManifest, PeerStatus, PlanInfo, RoundInfo,
                              RoundRecord, RunInfo,
                              RunSummary, StateInfo, StatusReport, Ticket, TicketRequest, UploadReceipt)
from toolkit.wire.compression import get_codec
from toolkit.wire.tensor_container import AsyncContainerReader

log = logging.getLogger(__name__)

_gradient_meta = gradient_meta  # its old home (tools and tests import it from here)


class Collaboration:
    def __init__(self, config: RelayConfig, store: Store, observers: ObserverThread | None = None) -> None:
        self.config, self.store = config, store
        self.observers = observers or ObserverThread([])
        self.run_cfg, self.rounds_cfg = config.run, config.rounds
        model = self._initial_model()
        self.layout = layout_of(model)
        params = flatten(model)
        del model  # the master adopts `params`; the model's own tensors go now, not at the end of __init__
        self.codec = get_codec(config.run.compression)
        self.run_info = RunInfo(
            run_name=config.run.name, protocol=PROTOCOL_VERSION,
            model=ModelSpec(factory=config.model.factory, kwargs=dict(config.model.kwargs)),
            layout=self.layout, num_params=int(params.size), target_batch=config.run.target_batch,
            total_steps=config.run.total_steps, max_staleness=config.run.max_staleness,
            heartbeat_interval_s=config.rounds.heartbeat_interval_s, compression=self.codec.name, auth=config.auth.mode,
            precision=config.run.precision or None, dataset=dict(config.dataset),
            # the relay's own W&B mode is not forwarded: an offline relay must not make peers offline
            wandb={"project": config.wandb.project, "entity": config.wandb.entity} if config.wandb.project else {})
        self.backbone = Backbone(config, store, self.layout, self.codec, params, self.run_info)
        self.backbone.peer_ids = lambda: list(self.registry.peers)
        step = store.latest_step()
        manifest = store.get_meta("manifest") if step is not None else None
        self._resume: tuple[int, ParamsManifest] | None = None
        if manifest:  # aggregators held slices of it: gathered in start(), which can talk to them
            self._resume = (step, ParamsManifest.loads(manifest))
        elif step is not None:
            self.publisher.restore(step)
            log.info("resumed from %s at step %d", store.dir, step)
        else:
            version = self.publisher.write(0, {"run": config.run.name})
            store.commit(0, version.sha256)
            self.publisher.latest = version
        if self._resume is None:
            self._publish_local(self.publisher.latest)
        self.registry = Registry(config.rounds.peer_ttl_s)
        self.deadlines = DeadlinePolicy(config.rounds)
        self.round: Round | None = None
        self._finalizing: asyncio.Task | None = None
        self._migration: asyncio.Task | None = None
        self.started = time.monotonic()

    async def start(self) -> None:
        """Before serving: a relay restarted while aggregators owned slices gathers its last
        version from them (``Backbone.resume``)."""
        if self._resume is None:
            return
        step, manifest = self._resume
        published, new_version = await self.backbone.resume(step, manifest)
        record = RoundLog(contributions={}, loss=None, duration_s=0.0, deadline_s=0.0, finalized_by="recovery",
                          lr=0.0, grad_norm=0.0) if new_version else None
        await asyncio.to_thread(self.store.commit, published.step, published.sha256, record, {"manifest": ""})
        self.backbone.board.publish(published)
        self._resume = None
        log.info("resumed from %s at step %d", self.store.dir, published.step)

    def close(self) -> None:
        self.backbone.close()

    def _initial_model(self) -> torch.nn.Module:
        torch.manual_seed(self.config.run.seed)
        model = build_model(self.config.model.factory, dict(self.config.model.kwargs))
        if self.config.model.init_checkpoint:
            from safetensors.torch import load_file

            model.load_state_dict(load_file(self.config.model.init_checkpoint))
        elif self.config.hub.init_from and self.store.latest_step() is None:
            from relay_server.observers.hub_checkpoints import init_model_from_hub

            init_model_from_hub(model, self.config)  # a restart resumes from the data dir instead
        return model

    # --- properties ---------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The published version: the master's step counter moves on the reducer thread before
        the new version is durable, so everything peers and observers see keys off the board."""
        return self.backbone.board.latest.step

    @property
    def num_params(self) -> int:
        return self.run_info.num_params

    # The relay's own slice: the whole vector unless aggregators own parts of it.
    @property
    def master(self) -> MasterState:
        return self.backbone.local.master

    @property
    def reducer(self) -> Reducer:
        """The relay's own slice's reducer (an empty one while aggregators own every slice:
        moderation excludes banned peers through it either way)."""
        local = self.backbone.local
        return local.reducer if local is not None else self.backbone.empty_reducer

    @property
    def publisher(self) -> Publisher:
        return self.backbone.local.publisher

    @property
    def finished(self) -> bool:
        return 0 < self.run_cfg.total_steps <= self.step

    def _open_round(self) -> RoundInfo | None:
        r = self.round
        if r is None or r.closed:
            return None
        return RoundInfo(step=r.step, round_id=r.round_id, deadline_in_s=max(0.0, r.deadline - time.monotonic()),
                         expected_peers=len(r.expected), received_peers=len(r.received),
                         plan_version=r.plan_version, slices=r.slices)

    def state(self) -> CollabState:
        collected = self.registry.collected(self.step, self.run_cfg.max_staleness)
        rate = self.registry.samples_per_s()
        remaining = max(0, self.run_cfg.target_batch - collected)
        return CollabState(step=self.step, target_batch=self.run_cfg.target_batch,
                           samples_accumulated=collected, samples_per_s=rate,
                           eta_s=(remaining / rate) if rate > 0 else None,
                           num_peers=len(self.registry.peers), round=self._open_round(),
                           finished=self.finished)

    # --- registry -----------------------------------------------------------------------------
    def join(self, req: JoinRequest, username: str) -> JoinResponse:
        if req.protocol != PROTOCOL_VERSION:
            raise ApiError(400, "protocol_mismatch", f"peer speaks protocol {req.protocol}, relay {PROTOCOL_VERSION}",
                           "Install the same collabtrain version as the relay (pip install -U collabtrain).")
        pinned = self.run_cfg.precision
        if pinned and req.precision != pinned:
            raise ApiError(409, "precision_mismatch", f"this run trains in {pinned} only; the peer asked for "
                           f"{req.precision or 'no policy'}",
                           "Let the toolkit choose (it follows the run's pin), or join from hardware that runs it.")
        peer = Peer(peer_id=secrets.token_hex(16), name=req.peer_name, username=username,
                    device=dict(req.device), precision=req.precision, version=self.step)
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
            peer = self.registry.add(Peer(peer_id=peer_id, name=name, username=username,
                                          device=json.loads(device), precision=None))
            log.info("peer %s is back", name)
        self.registry.touch(peer)
        return peer

    def heartbeat(self, peer_id: str, hb: Heartbeat) -> CollabState:
        peer = self.peer(peer_id)
        if hb.version > self.step:
            raise ApiError(409, "version_ahead", f"peer claims version {hb.version} but the relay is at {self.step}",
                           "Download the current parameters (the relay may have been rolled back).")
        self.registry.report(peer, hb)
        self.backbone.planning.observe_samples_per_s(peer.peer_id, hb.samples_per_s)
        self._maybe_open_round()
        self._update_membership(peer)
        return self.state()

    def _update_membership(self, peer: Peer) -> None:
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
            self._maybe_finalize()

    def leave(self, peer_id: str) -> None:
        peer = self.registry.remove(peer_id)
        if peer is not None:
            log.info("peer %s left", peer.name)
            self._forget(peer.peer_id)

    def _forget(self, peer_id: str) -> None:
        self.backbone.planning.forget_peer(peer_id)
        if self.round is not None and not self.round.closed:
            self.round.drop(peer_id)
            self._maybe_finalize()

    # --- rounds -------------------------------------------------------------------------------
    def _maybe_open_round(self) -> None:
        if self.round is not None or self.finished or self._between_rounds_work():
            return
        eligible = self.registry.eligible(self.step, self.run_cfg.max_staleness)
        if sum(p.samples for p in eligible) < self.run_cfg.target_batch:
            return
        self.round = Round(step=self.step, round_id=secrets.token_hex(8), expected={p.peer_id for p in eligible},
                           deadline_s=self.deadlines.window_s(), plan_version=self.backbone.plan_version,
                           slices=self.backbone.round_slices())
        log.info("round %d open: %d peers, window %.1fs", self.step, len(eligible), self.round.deadline_s)

    async def receive_gradient(self, step: int, peer_id: str, reader: AsyncContainerReader) -> UploadReceipt:
        """Stream one peer's gradient sum into the round's reduction, chunk by chunk."""
        started = time.monotonic()
        peer = self.peer(peer_id)
        r = self.round
        if r is None or r.closed or r.step != step:
            raise round_closed(step, self.step)
        if r.slices:
            raise ApiError(409, "ticket_required", f"round {step} is sliced among aggregators",
                           "Ask for a ticket and upload each slice to its owner (the toolkit does this).")
        _check_not_sent(r, peer_id)
        header = await reader.read_header()
        meta = gradient_meta(header.metadata)
        self.reducer.check(header)
        if meta.peer_id != peer_id or meta.step != step:
            raise ApiError(422, "bad_meta", "gradient metadata names another peer or round")
        self._check_contribution(step, peer, meta.version, meta.samples, "upload claims")
        was_expected = r.begin(peer_id)
        progress = UploadProgress()
        peer.inflight += 1
        try:
            await self.reducer.reduce(reader, header, meta.samples, lambda: not r.closed, progress, peer_id)
            if r.closed:  # the deadline passed while the last chunk was being reduced
                raise RoundClosedMidUpload()
        except BaseException as exc:
            reduced = progress.chunks_added > 0
            r.abort(peer_id, reduced=reduced, was_expected=was_expected)
            if isinstance(exc, RoundClosedMidUpload):
                raise (round_closed_partial(step) if reduced else round_closed(step, self.step)) from None
            raise
        else:
            self._credit(r, peer, meta.samples, meta.loss_sum)
            self.backbone.planning.record_transfer(peer_id, "up", step, header.header_bytes + header.data_bytes, started)
        finally:
            peer.inflight -= 1
            self.registry.touch(peer)
            self._maybe_finalize()
        return UploadReceipt(step=step, accepted_samples=meta.samples, received_peers=len(r.received))

    def _check_contribution(self, step: int, peer: Peer, version: int, samples: int, claim: str) -> None:
        """A gradient (whole or sliced) may lag the master by ``max_staleness`` versions and may
        not claim more samples than the peer's progress reports since its last upload."""
        if not 0 <= step - version <= self.run_cfg.max_staleness:
            raise ApiError(409, "stale_gradient", f"gradient from version {version} is too old for round {step}",
                           "Discard it and download the latest parameters.")
        if samples > peer.claimable:
            raise ApiError(422, "samples_exceed_report", f"{claim} {samples} samples, "
                           f"progress reports since the last upload said {peer.claimable}",
                           "Send a heartbeat before uploading.")

    def _credit(self, r: Round, peer: Peer, samples: int, loss_sum: float) -> None:
        r.complete(peer.peer_id, samples, loss_sum)
        peer.samples = max(0, peer.samples - samples)
        peer.claimable = max(0, peer.claimable - samples)
        if peer.first_contribution_s is None:
            peer.first_contribution_s = time.monotonic() - peer.joined_at

    # --- sliced rounds: ticket, uploads to the owners, done -------------------------------------
    def issue_ticket(self, step: int, peer_id: str, req: TicketRequest) -> Ticket:
        """The checks a whole-vector upload gets, then a signed permission to upload the slices."""
        peer = self.peer(peer_id)
        r = self.round
        if r is None or r.closed or r.step != step or r.round_id != req.round_id:
            raise round_closed(step, self.step)
        if not r.slices:
            raise ApiError(409, "no_ticket_needed", f"round {step} is not sliced",
                           "Upload the whole gradient to the relay (ROUTES['gradient']).")
        _check_not_sent(r, peer_id)
        self._check_contribution(step, peer, req.version, req.samples, "the ticket asks for")
        if [(d.start, d.end) for d in req.slices] != [(s.start, s.end) for s in r.slices]:
            raise ApiError(422, "bad_slices", "the ticket request does not list this round's slices",
                           "Split the gradient by the round's slices (RoundInfo.slices).")
        r.tickets[peer_id] = (req.samples, req.loss_sum, r.begin(peer_id))
        expires = time.time() + max(0.0, r.deadline - time.monotonic()) + 30.0
        return sign_ticket(Ticket(round_id=r.round_id, step=step, peer_id=peer_id, samples=req.samples,
                                  version=req.version, plan_version=r.plan_version, expires_at=expires,
                                  slices=list(req.slices)), self.backbone.ticket_key)

    def done(self, step: int, peer_id: str, req: DoneRequest) -> UploadReceipt:
        """The peer finished uploading its slices. Delivering any slice counts the peer in (the
        owners reduced part-wise); delivering none releases it, as a refused upload would."""
        peer = self.peer(peer_id)
        r = self.round
        if r is None or r.round_id != req.round_id or r.step != step or peer_id not in r.tickets:
            raise round_closed(step, self.step)
        if r.closed:
            raise round_closed_partial(step) if req.delivered or req.partial else round_closed(step, self.step)
        samples, loss_sum, was_expected = r.tickets.pop(peer_id)
        if peer_id in r.uploading:
            if req.delivered:
                self._credit(r, peer, samples, loss_sum)
            else:
                r.abort(peer_id, reduced=req.partial, was_expected=was_expected)
        self.registry.touch(peer)
        self._maybe_finalize()
        return UploadReceipt(step=step, accepted_samples=samples if req.delivered else 0,
                             received_peers=len(r.received))

    def _maybe_finalize(self, now: float | None = None) -> None:
        r = self.round
        if r is None or r.closed:
            return
        now = time.monotonic() if now is None else now
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
            self._maybe_open_round()
            return
        outcome = RoundLog(contributions=dict(r.received), loss=r.loss, duration_s=time.monotonic() - r.opened_at,
                           deadline_s=r.deadline_s, finalized_by=r.finalized_by, lr=0.0, grad_norm=0.0)
        if r.slices:
            published = await self._finalize_sliced(r, outcome)
        else:
            version = await self.reducer.run(self._apply, outcome)
            self.publisher.publish(version)
            self.reducer.submit(self.reducer.reset)  # off the critical path, yet before the next round's adds
            published = self._publish_local(version)
        self.deadlines.observe(r)
        self.round = None
        log.info("step %d: %d peers, %d samples, loss %s, %.2fs (%s)", published.step, len(r.received), r.samples,
                 f"{r.loss:.4f}" if r.loss is not None else "n/a", time.monotonic() - r.opened_at, r.finalized_by)
        self._maybe_open_round()
        if self.observers.observers:
            status = self.status()
            path = published.version.path if published.version else None
            self.observers.publish(StepEvent(step=published.step, record=status.recent_rounds[-1], status=status,
                                             state_path=path))

    def _publish_local(self, version: Version) -> Published:
        """The relay's own version is the published one (single relay)."""
        published = Published(step=version.step, sha256=version.sha256, version=version)
        self.backbone.board.publish(published)
        return published

    async def _finalize_sliced(self, r: Round, outcome: RoundLog) -> Published:
        """Every owner finalizes its slice (dead ones are recovered inside), then commit and publish."""
        published, grad_norm = await self.backbone.finalize(r.step, r.round_id)
        outcome = dataclasses.replace(outcome, lr=lr_at(r.step, self.config.optimizer, self.run_cfg.total_steps),
                                      grad_norm=grad_norm)
        manifest = published.manifest.dumps().decode() if published.manifest else ""
        await asyncio.to_thread(self.store.commit, published.step, published.sha256, outcome, {"manifest": manifest})
        self.backbone.board.publish(published)
        self.backbone.after_publish(published)
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
                manifest = published.manifest.dumps().decode() if published.manifest else ""
                record = RoundLog(contributions={}, loss=None, duration_s=0.0, deadline_s=0.0,
                                  finalized_by="recovery", lr=0.0, grad_norm=0.0) if new_version else None
                await asyncio.to_thread(self.store.commit, published.step, published.sha256, record,
                                        {"manifest": manifest})
                self.backbone.board.publish(published)
                self.backbone.after_publish(published)
        except Exception:
            log.exception("moving slices failed; the relay keeps the current plan")
        finally:
            self._migration = None
            self._maybe_open_round()

    def _apply(self, outcome: RoundLog) -> Version:
        """Reducer thread, after every add of the round: mean, optimizer step, persist, commit."""
        self.reducer.finish_mean()
        report = self.master.apply_gradient()
        version = self.publisher.write(report.step, {"run": self.run_cfg.name})
        self.store.commit(report.step, version.sha256,
                          dataclasses.replace(outcome, lr=report.lr, grad_norm=report.grad_norm))
        return version

    async def rollback(self, to_step: int) -> int:
        """Publish the stored state of version ``to_step`` (parameters and optimizer state) as the
        next version, and return that version. Versions only move forward -- peers compare them --
        so rolling back to k at version N publishes N + 1 holding k's state. An open round is
        abandoned: its gradients were computed on the state being rolled back."""
        if not self.backbone.single:
            raise ApiError(409, "rollback_needs_single_relay", "aggregators own slices of the vector",
                           "Stop the aggregators (their slices return to the relay), then roll back.")
        if not self.store.state_path(to_step).exists():
            kept = sorted(int(p.stem.split("-")[1]) for p in self.store.state_path(0).parent.glob("step-*.safetensors"))
            raise ApiError(404, "no_checkpoint", f"no stored state for step {to_step}",
                           f"Stored steps: {kept}. Keep more with server.keep_checkpoints, or start a new "
                           "relay from a Hub checkpoint (hub.init_from).")
        if self._finalizing is not None:
            await self._finalizing  # a round that already closed is applied first
        if self.round is not None:
            self.round.closed, self.round.finalized_by = True, "rollback"
            self.round = None
        version = await self.reducer.run(self._apply_rollback, to_step)
        self.publisher.publish(version)
        self._publish_local(version)
        log.warning("rolled back to the state of step %d, published as step %d", to_step, version.step)
        self._maybe_open_round()
        return version.step

    def _apply_rollback(self, to_step: int) -> Version:
        """Reducer thread: after every pending add, swap in the stored state and persist it."""
        new_step = self.step + 1
        self.publisher.load(to_step)
        self.master.step = new_step
        self.reducer.reset()
        version = self.publisher.write(new_step, {"run": self.run_cfg.name, "rolled_back_to": str(to_step)},
                                       delta=False)
        self.store.commit(new_step, version.sha256, RoundLog(contributions={}, loss=None, duration_s=0.0,
                                                             deadline_s=0.0, finalized_by="rollback", lr=0.0,
                                                             grad_norm=0.0))
        return version

    async def wait_for_step(self, min_step: int, timeout_s: float) -> Published | None:
        """Long-poll: the first published version with ``step >= min_step``, or None."""
        return await self.backbone.board.wait(min_step, timeout_s)

    async def tick(self) -> None:
        """Housekeeping, every fraction of a second: expire silent peers and aggregators, enforce
        deadlines, re-plan on changed measurements."""
        for peer in self.registry.expire():
            log.info("peer %s timed out", peer.name)
            self._forget(peer.peer_id)
        self._maybe_finalize()
        self.backbone.expire()
        self.backbone.maybe_replan()
        if self.round is None:
            self._maybe_open_round()  # also starts a pending plan change

    async def run_ticker(self, period_s: float = 0.1) -> None:
        while True:
            await self.tick()
            await asyncio.sleep(period_s)

    def state_info(self) -> StateInfo:
        latest = self.backbone.board.latest
        return StateInfo(step=latest.step, num_params=self.num_params, sha256=latest.sha256)

    def plan_info(self) -> PlanInfo:
        """Who aggregates what. Until extra aggregators join, the relay owns the whole vector."""
        return self.backbone.plan_info()

    def run_summary(self) -> RunSummary:
        opt = self.config.optimizer
        return RunSummary(model=self.config.model.factory, num_params=self.num_params, optimizer=opt.name,
                          lr=opt.lr, schedule=opt.schedule, target_batch=self.run_cfg.target_batch,
                          max_staleness=self.run_cfg.max_staleness, precision=self.run_cfg.precision or None,
                          compression="none", auth_mode=self.config.auth.mode)

    def status(self) -> StatusReport:
        state, now = self.state(), time.monotonic()
        contributed = self.store.contributions()
        online = self.registry.peers.values()
        peers = [PeerStatus(peer_id=p.peer_id, name=p.name, username=p.username, device=p.device_label,
                            version=p.version, samples_per_s=p.samples_per_s,
                            samples_contributed=contributed.get(p.peer_id, 0), last_seen_s=now - p.last_seen,
                            online=True, precision=p.precision, first_contribution_s=p.first_contribution_s)
                 for p in online]
        rounds = [RoundRecord(step=s, contributors=c, samples=n, loss=loss, duration_s=d, deadline_s=dl,
                              finalized_by=by, finalized_at=at, lr=lr, grad_norm=norm)
                  for s, c, n, loss, d, dl, by, at, lr, norm in self.store.recent_rounds()]
        leaderboard = [LeaderboardEntry(username=u, samples=n, rounds=r,
                                        peers_online=sum(p.username == u for p in online))
                       for u, n, r in self.store.leaderboard()]
        return StatusReport(run_name=self.run_cfg.name, step=self.step, total_steps=self.run_cfg.total_steps,
                            finished=self.finished, target_batch=self.run_cfg.target_batch,
                            num_params=self.num_params, samples_accumulated=state.samples_accumulated,
                            samples_per_s=state.samples_per_s, eta_s=state.eta_s,
                            loss=rounds[-1].loss if rounds else None, num_peers=len(peers), peers=peers,
                            recent_rounds=rounds, round=state.round, auth_mode=self.config.auth.mode,
                            uptime_s=now - self.started, leaderboard=leaderboard, plan=self.plan_info(),
                            config=self.run_summary())


def _check_not_sent(r: Round, peer_id: str) -> None:
    if peer_id in r.received or peer_id in r.uploading or peer_id in r.partial:
        raise ApiError(409, "duplicate_upload", f"peer already sent a gradient for round {r.step}",
                       "Keep accumulating; the next round takes the new samples.")
