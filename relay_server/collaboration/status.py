"""What the collaboration reports about itself, built from its parts.

The run a peer receives on joining (:func:`run_info_of`), the progress every heartbeat answers
with (:func:`collab_state`), and the report behind ``GET /status``, the dashboard and the
observers -- peers online, recent rounds, leaderboard, plan, configuration (:func:`status_report`).
A feature that makes the run's steps itself (the pipeline) says what stands in for the rounds'
figures there (:class:`RunFigures`); one that adds figures of its own (local SGD's outer loop)
amends the report, and one whose peers must know of it adds ``RunInfo`` fields: the core names no
feature. Kept out of the state machine (:mod:`.machine`) because none of it changes state: these are
read-only views over the registry, the store and the open round, which the machine passes in.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from relay_server.core.config import OptimizerSection, RelayConfig, RunSection
from relay_server.rounds.master import lr_at
from relay_server.rounds.membership import Round
from relay_server.rounds.peer_registry import Peer, Registry
from relay_server.rounds.store import Store, finite_or_none
from relay_server.rounds.throughput import bounded_report
from relay_server.rounds.traffic import Traffic
from toolkit.wire.protocol import (
    PROTOCOL_VERSION,
    BatchProgress,
    CollabState,
    LeaderboardEntry,
    ParamSpec,
    PeerStatus,
    PlanInfo,
    RoundInfo,
    RoundRecord,
    RunInfo,
    RunSummary,
    StatusReport,
)


@dataclass(frozen=True)
class RunFigures:
    """What a feature whose service makes the run's steps (the pipeline) counts in place of the
    collaboration's round figures, which say nothing true about such a run: its steps are not
    rounds of samples that peers upload (the round bar read "0 of 32" against a 31 s batch, the
    workers "contributed 0"), and it has no averaging plan."""

    mode: str
    """The run's mode as observers see it (``RunSummary.mode``): "pipeline"."""
    progress: BatchProgress
    """The step in flight in the feature's unit, with its ETA (``StatusReport.progress``)."""
    samples_accumulated: int
    """Samples of the step in flight that are done (a pipeline: its finished micro-batches')."""
    credit: Callable[[str], tuple[int, int] | None]
    """peer id -> (tasks, samples) the relay credited it with; None: not one of the feature's peers."""
    averaging_plan: bool = False
    """Whether ``StatusReport.plan`` applies (False: reported as None, the panel hidden)."""
    peer_role: str = "stage_worker"
    """The role the run's peers play (one of :data:`~toolkit.wire.protocol.status.PEER_ROLES`)."""


def run_info_of(
    config: RelayConfig,
    layout: list[ParamSpec],
    num_params: int,
    compression: str,
    download_compression: str = "",
    features: Mapping[str, Any] | None = None,
) -> RunInfo:
    """What a joining peer needs to train with the others; ``features``: the fields the enabled
    features add (``local_sgd``, ``pipeline``: :attr:`relay_server.api.feature.Feature.run_info`)."""
    return RunInfo(
        run_name=config.run.name,
        protocol=PROTOCOL_VERSION,
        model=config.model.spec(),
        layout=layout,
        num_params=num_params,
        target_batch=config.run.target_batch,
        total_steps=config.run.total_steps,
        max_staleness=config.run.max_staleness,
        heartbeat_interval_s=config.rounds.heartbeat_interval_s,
        compression=compression,
        auth=config.auth.mode,
        download_compression="" if download_compression == compression else download_compression,
        download_feedback=config.run.download_feedback,
        precision=config.run.precision or None,
        dataset=dict(config.dataset),
        # the relay's own W&B mode is not forwarded: an offline relay must not make peers offline
        wandb={"project": config.wandb.project, "entity": config.wandb.entity} if config.wandb.project else {},
        **(features or {}),
    )


def round_info(r: Round | None) -> RoundInfo | None:
    """The open round as peers see it (None between rounds)."""
    if r is None or r.closed:
        return None
    return RoundInfo(
        step=r.step,
        round_id=r.round_id,
        deadline_in_s=r.remaining_s,
        expected_peers=len(r.expected),
        received_peers=len(r.received),
        plan_version=r.plan_version,
        slices=r.slices,
    )


def collab_state(
    registry: Registry,
    run_cfg: RunSection,
    step: int,
    r: Round | None,
    finished: bool,
    optimizer: OptimizerSection | None = None,
    samples_per_s: float = 0.0,
    figures: RunFigures | None = None,
) -> CollabState:
    """Progress as peers see it; with ``optimizer``, the lr of the next update (peers show it in
    their optimizer's ``param_groups``). ``samples_per_s``: the relay's measured figure
    (:class:`~relay_server.rounds.throughput.RoundRate`), which the ETA divides by; with
    ``figures`` (a feature makes the steps), the samples done and the ETA are the feature's."""
    rate = samples_per_s
    if figures is not None:
        collected, eta = figures.samples_accumulated, figures.progress.eta_s
    else:
        collected = registry.collected(step, run_cfg.max_staleness)
        remaining = max(0, run_cfg.target_batch - collected)
        eta = (remaining / rate) if rate > 0 else None
    return CollabState(
        step=step,
        target_batch=run_cfg.target_batch,
        samples_accumulated=collected,
        samples_per_s=rate,
        eta_s=eta,
        num_peers=len(registry.peers),
        round=round_info(r),
        finished=finished,
        lr=lr_at(step, optimizer, run_cfg.total_steps) if optimizer is not None else None,
    )


def run_summary(config: RelayConfig, num_params: int, mode: str | None = None) -> RunSummary:
    """The run's configuration; ``mode``: a feature's name for how the run steps (default ``run.mode``)."""
    opt, run_cfg = config.master_optimizer(), config.run
    return RunSummary(
        model=config.model.label(),
        num_params=num_params,
        optimizer=opt.name,
        lr=opt.lr,
        schedule=opt.schedule,
        target_batch=run_cfg.target_batch,
        max_staleness=run_cfg.max_staleness,
        precision=run_cfg.precision or None,
        compression="none",
        auth_mode=config.auth.mode,
        mode=mode or run_cfg.mode,
    )


class Leaderboard:
    """Samples and rounds by Hugging Face username, kept in memory: read from the store once at
    start, then credited as rounds commit. The dashboard polls every 1.5 s, and aggregating the
    peers table (one row per join, for ever) on each poll cost 341 ms at 200k rows."""

    def __init__(self, store: Store, registry: Registry, size: int = 100) -> None:
        self.store, self.registry, self.size = store, registry, size
        self._users: dict[str, list[Any]] = {u: [u, n, r] for u, n, r in store.leaderboard(limit=-1)}
        self._top: list[tuple[str, int, int]] | None = None

    def credit(self, contributions: dict[str, int]) -> None:
        """A round committed: each contributing peer's user gains its samples and one round."""
        for peer_id, samples in contributions.items():
            peer = self.registry.get(peer_id)
            username = peer.username if peer is not None else (self.store.known_peer(peer_id) or ("", "?"))[1]
            entry = self._users.setdefault(username, [username, 0, 0])
            entry[1] += samples
            entry[2] += 1
        self._top = None

    def top(self) -> list[tuple[str, int, int]]:
        """(username, samples, rounds), best first: O(users) once per round, then cached."""
        if self._top is None:
            best = heapq.nsmallest(
                self.size, (e for e in self._users.values() if e[1] > 0), key=lambda e: (-e[1], e[0])
            )
            self._top = [(u, n, r) for u, n, r in best]
        return self._top


def status_report(
    config: RelayConfig,
    store: Store,
    registry: Registry,
    state: CollabState,
    plan: PlanInfo,
    num_params: int,
    started: float,
    leaderboard: Leaderboard,
    traffic: Traffic,
    refused_steps: int = 0,
    figures: RunFigures | None = None,
) -> StatusReport:
    """Everything the dashboard shows, ``state`` being the collaboration's progress just now
    (``figures``: what a feature that makes the steps counts instead of the rounds' figures).
    O(peers online + the leaderboard's size), whatever the number of peers that ever joined."""
    run_cfg, now = config.run, time.monotonic()
    online = registry.peers.values()
    role = figures.peer_role if figures is not None else "trainer"
    credit = figures.credit if figures is not None else (lambda peer_id: None)
    peers = [peer_status(p, now, role, credit(p.peer_id)) for p in online]
    measured, measured_over = store.rate.samples_per_s()
    recent = store.recent_rounds()
    outcomes = store.round_outcomes([row[0] for row in recent])  # refused / partial / banned uploads
    # finite_or_none: a data dir written by an older relay may hold an inf grad_norm; JSON cannot carry it
    rounds = [
        RoundRecord(
            step=s,
            contributors=c,
            samples=n,
            loss=finite_or_none(loss),
            duration_s=d,
            deadline_s=dl,
            finalized_by=by,
            finalized_at=at,
            lr=finite_or_none(lr),
            grad_norm=finite_or_none(norm),
            outcomes=outcomes.get(s, {}),
        )
        for s, c, n, loss, d, dl, by, at, lr, norm in recent
    ]
    by_user = registry.online_by_user
    board = [
        LeaderboardEntry(username=u, samples=n, rounds=r, peers_online=by_user.get(u, 0))
        for u, n, r in leaderboard.top()
    ]
    return StatusReport(
        run_name=run_cfg.name,
        step=state.step,
        total_steps=run_cfg.total_steps,
        finished=state.finished,
        target_batch=run_cfg.target_batch,
        num_params=num_params,
        samples_accumulated=state.samples_accumulated,
        samples_per_s=measured,
        samples_per_s_rounds=measured_over,
        eta_s=state.eta_s,
        reported_samples_per_s=sum(p.samples_per_s for p in peers if p.role == "trainer"),
        loss=rounds[-1].loss if rounds else None,
        num_peers=len(peers),
        peers=peers,
        recent_rounds=rounds,
        round=state.round,
        auth_mode=config.auth.mode,
        uptime_s=now - started,
        leaderboard=board,
        plan=plan if figures is None or figures.averaging_plan else None,
        config=run_summary(config, num_params, figures.mode if figures is not None else None),
        traffic=traffic.report(),
        refused_steps=refused_steps,
        progress=figures.progress if figures is not None else None,
    )


def peer_status(p: Peer, now: float, run_role: str = "trainer", credit: tuple[int, int] | None = None) -> PeerStatus:
    """One peer online as the dashboard lists it, in its role: an expert host (it joined saying so)
    shows no device, samples/s or contribution, since it trains nothing; on a run whose steps a
    feature makes, its peers play that feature's role (``run_role``: a pipeline's stage workers,
    :func:`place_peers` adds their stage), with the tasks and samples the relay credited them
    (``credit``); the rest are trainers, whose self-reported samples/s is bounded by what their
    reports' growth makes plausible."""
    host = p.device.get("role") == "expert_host"
    role = "expert_host" if host else run_role
    reported, capped = (
        bounded_report(p.samples_per_s, p.accumulated, now - p.joined_at) if role == "trainer" else (0.0, False)
    )
    return PeerStatus(
        peer_id=p.peer_id,
        name=p.name,
        username=p.username,
        device="" if host else p.device_label,
        version=p.version,
        samples_per_s=reported,
        samples_per_s_capped=capped,
        role=role,
        samples_contributed=credit[1] if credit is not None else p.contributed,
        tasks_done=credit[0] if credit is not None else None,
        last_seen_s=now - p.last_seen,
        online=True,
        precision=p.precision,
        first_contribution_s=p.first_contribution_s,
    )


def place_peers(
    report: StatusReport, experts_per_host: Mapping[str, int], stage_of: Mapping[str, int]
) -> StatusReport:
    """``report`` with each expert host's experts and each stage worker's stage (what the relay's
    expert directory and pipeline coordinator know; a peer holding experts is a host whatever it
    said when it joined)."""

    def placed(p: PeerStatus) -> PeerStatus:
        if p.peer_id in experts_per_host:
            return dataclasses.replace(
                p,
                role="expert_host",
                experts_hosted=experts_per_host[p.peer_id],
                device="",
                samples_per_s=0.0,
                samples_per_s_capped=False,
            )
        if p.role == "expert_host":
            return dataclasses.replace(p, experts_hosted=0)
        if p.role == "stage_worker":
            return dataclasses.replace(p, stage=stage_of.get(p.peer_id))
        return p

    peers = [placed(p) for p in report.peers]
    return dataclasses.replace(
        report, peers=peers, reported_samples_per_s=sum(p.samples_per_s for p in peers if p.role == "trainer")
    )
