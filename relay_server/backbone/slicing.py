"""A slicing of the vector, as data: the owners of the executing plan, what a published version
is, the whole state put back together from its slices, and the plan as reported.

Split from :mod:`.backbone`, which decides when to slice and talks to the owners; what is
here does no I/O and calls nobody. A plan's fractions become contiguous slices
(:func:`owners_for`); a sliced version is a manifest of its slices' hashes, named by the
manifest's own hash (:func:`manifest_version`); a migration or a recovery stitches the owners'
exported parts into whole-vector arrays (:func:`stitch`) and fills a dead owner's slice from the
relay's recovery copy (:func:`restore_dead`); :func:`plan_info` is the executing plan as the
dashboard and ``GET /plan`` show it.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from relay_server.backbone.aggregators import Aggregator
from relay_server.backbone.recovery import RecoveryCopy
from relay_server.planning.planner import Plan
from relay_server.planning.policy import RELAY_ID, Planning
from relay_server.rounds.publisher import Version
from toolkit.wire.protocol import AggregatorStatus, ParamsManifest, PlanInfo, PlanSlice, SliceVersion

log = logging.getLogger(__name__)

RELAY_ONLY = "relay-only"


@dataclass(frozen=True)
class Owner:
    """One slice of the executing plan."""

    owner_id: str
    name: str
    url: str  # "" for the relay
    start: int
    end: int
    fraction: float

    def plan_slice(self) -> PlanSlice:
        return PlanSlice(
            aggregator_id=self.owner_id,
            name=self.name,
            start=self.start,
            end=self.end,
            fraction=self.fraction,
            url=self.url,
        )


@dataclass(frozen=True)
class Published:
    """A published version: the relay's own version file (single relay) or a manifest of slices."""

    step: int
    sha256: str
    version: Version | None = None
    manifest: ParamsManifest | None = None


class NotReady(Exception):
    """A migration cannot run now: a dead owner's slice has no copy of the published version."""


def owners_for(
    plan: Plan | None, num_params: int, aggregators: Mapping[str, Aggregator], boundaries: Sequence[int] | None = None
) -> list[Owner]:
    """``plan``'s fractions cut contiguously (the relay alone when ``plan`` is None), each cut on
    one of ``boundaries`` when given (tensor boundaries, for an optimizer with per-tensor
    quantities: :func:`relay_server.rounds.master.slice_boundaries`)."""
    if plan is None:
        return [Owner(RELAY_ID, RELAY_ID, "", 0, num_params, 1.0)]
    out = []
    for owner_id, start, end in plan.slices(num_params, boundaries):
        agg = aggregators.get(owner_id)
        out.append(
            Owner(
                owner_id, agg.name if agg else RELAY_ID, agg.url if agg else "", start, end, plan.fractions[owner_id]
            )
        )
    return out


def manifest_version(
    step: int, owners: list[Owner], shas: dict[str, str], num_params: int, plan_version: str
) -> Published:
    """The sliced version ``step``: each owner's slice and the sha256 of its version file."""
    manifest = ParamsManifest(
        step=step,
        num_params=num_params,
        plan_version=plan_version,
        slices=[
            SliceVersion(aggregator_id=o.owner_id, url=o.url, start=o.start, end=o.end, sha256=shas[o.owner_id])
            for o in owners
        ],
    )
    return Published(step=step, sha256=hashlib.sha256(manifest.dumps()).hexdigest(), manifest=manifest)


def stitch(
    parts: dict[Owner, dict[str, np.ndarray]], num_params: int, copy: RecoveryCopy | None
) -> dict[str, np.ndarray]:
    """Whole-vector arrays from the owners' exported slices (zeros where no part covers; the
    arrays the copy holds are all present, for :func:`restore_dead` to fill)."""
    names = sorted({name for part in parts.values() for name in part} | set(copy.state if copy else ()))
    state = {name: np.zeros(num_params, dtype=np.float32) for name in names if not name.startswith("opt_scalar.")}
    for owner, part in parts.items():
        for name, array in part.items():
            if name.startswith("opt_scalar."):
                state[name] = array
            else:
                state[name][owner.start : owner.end] = array
    return state


def restore_dead(
    state: dict[str, np.ndarray],
    dead: list[Owner],
    copy: RecoveryCopy | None,
    step: int,
    published: ParamsManifest | None,
    *,
    strict: bool,
) -> None:
    """Fill each dead owner's slice of ``state`` from the relay's copy (``strict``: only if the
    copy holds exactly the ``published`` parameters of that slice, else :class:`NotReady`)."""
    for owner in dead:
        rng = (owner.start, owner.end)
        want = next((s.sha256 for s in published.slices if (s.start, s.end) == rng), None) if published else None
        if strict and not (copy and copy.holds(rng, step, want)):
            raise NotReady(f"the relay's copy of [{owner.start}, {owner.end}) is not step {step}'s")
        try:
            params_step, opt_step = copy.fill(state, rng)  # type: ignore[union-attr]  # no copy: caught below
        except (AttributeError, KeyError):
            raise RuntimeError(
                f"slice [{owner.start}, {owner.end}) of dead aggregator {owner.owner_id} has no copy"
            ) from None
        log.warning(
            "slice [%d, %d) of dead aggregator %s restored from the relay's copy: parameters of "
            "step %d, optimizer state of step %d (now step %d)",
            owner.start,
            owner.end,
            owner.owner_id,
            params_step,
            opt_step,
            step,
        )


def plan_info(
    plan: Plan | None, version: str, owners: list[Owner], planning: Planning, aggregators: list[AggregatorStatus]
) -> PlanInfo:
    return PlanInfo(
        version=version,
        steps_per_s=plan.steps_per_s if plan else None,
        slices=[o.plan_slice() for o in owners],
        computes=dict(plan.computes) if plan else {},
        inputs=list(planning.inputs),
        predicted_round_s=_finite(plan.predicted_round_s) if plan else None,
        solved_at=planning.solved_at,
        aggregators=aggregators,
    )


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
