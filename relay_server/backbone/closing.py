"""Closing a sliced round: every owner of the executing plan steps its slice of the vector.

Split from :mod:`.backbone`, which decides what happens to the owners that fail (recovery).
Without clipping this is one call per owner -- ``finalize`` -- and the global norm reported in
the round's record is summed from the slices' own norms. With ``optimizer.clip_grad_norm > 0``
it is two: every owner closes the round and answers its mean gradient's squared norm
(``grad_norm``), the relay sums them into the global norm, and only then does any owner step,
each clipping by that global norm -- the steps a relay alone would take. An owner that fails
either call is dead for the coordinator, like a failed finalize: its slice is recovered. One that
dies between the calls still counted in the norm (its slice's gradient existed); one that fails
the first call did not (its gradient is lost with it, so the live slices clip by the norm of the
gradient actually applied).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from relay_server.backbone.aggregators import Aggregators
from relay_server.backbone.slice_owner import SliceOwner
from relay_server.backbone.slicing import Owner
from relay_server.backbone.state_transfer import CallFailed, InternalClient
from relay_server.planning.policy import RELAY_ID
from toolkit.wire.protocol import ROUTES, FinalizeRequest, GradNormReport, GradNormRequest, SliceReport

T = TypeVar("T")


@dataclass
class Closed:
    """What closing a round produced: the live owners' reports, the dead, the global norm."""

    reports: dict[str, SliceReport]
    dead: list[Owner]
    grad_norm: float

    @property
    def refused(self) -> int:
        """Owners whose step was refused: their slices were published unchanged."""
        return sum(report.refused for report in self.reports.values())


@dataclass
class RoundCloser:
    """The calls of one round's closing, to the relay's own slice and the aggregators."""

    owners: list[Owner]
    local: SliceOwner | None
    aggregators: Aggregators
    client: InternalClient | None
    plan_version: str

    async def close(self, step: int, round_id: str, *, clip: bool) -> Closed:
        dead: list[Owner] = []
        owners, global_norm = self.owners, None
        if clip:
            norms = await self._each(owners, lambda o: self._sq_norm(o, step, round_id), "grad norm", dead)
            owners = [o for o in owners if o.owner_id in norms]
            global_norm = math.sqrt(sum(norms.values()))
        reports = await self._each(owners, lambda o: self._finalize(o, step, round_id, global_norm), "finalize", dead)
        if global_norm is None:
            global_norm = math.sqrt(sum(r.grad_norm**2 for r in reports.values()))
        return Closed(reports, dead, global_norm)

    async def _each(
        self, owners: list[Owner], call: Callable[[Owner], Awaitable[T]], what: str, dead: list[Owner]
    ) -> dict[str, T]:
        """``call`` every owner at once; one that fails (``CallFailed``) is marked dead."""
        results = await asyncio.gather(*(call(o) for o in owners), return_exceptions=True)
        out: dict[str, T] = {}
        for owner, result in zip(owners, results):
            if isinstance(result, CallFailed):
                self.aggregators.mark_dead(owner.owner_id, f"{what} failed: {result}")
                dead.append(owner)
            elif isinstance(result, BaseException):
                raise result
            else:
                out[owner.owner_id] = result
        return out

    def _url(self, owner: Owner, route: str) -> str:
        if not self.aggregators.alive(owner.owner_id):
            raise CallFailed("already dead")
        return self.aggregators[owner.owner_id].url + ROUTES[route]

    async def _sq_norm(self, owner: Owner, step: int, round_id: str) -> float:
        if owner.owner_id == RELAY_ID:
            # RELAY_ID's owner is the relay's own slice: local holds it
            return await self.local.grad_sq_norm(step, round_id)  # type: ignore[union-attr]
        # an aggregator's slice: the client is attach()'s, made when the app started
        report = await self.client.call(  # type: ignore[union-attr]
            "POST",
            self._url(owner, "grad_norm"),
            GradNormReport,
            GradNormRequest(step=step, round_id=round_id, plan_version=self.plan_version),
        )
        if (report.step, report.round_id, report.start, report.end) != (step, round_id, owner.start, owner.end):
            raise CallFailed(f"answered {report}")
        return report.sq_norm  # finite and >= 0: the schema checked

    async def _finalize(self, owner: Owner, step: int, round_id: str, global_norm: float | None) -> SliceReport:
        if owner.owner_id == RELAY_ID:
            # RELAY_ID's owner is the relay's own slice: local holds it
            version, r, norm = await self.local.finalize(step, round_id, global_norm)  # type: ignore[union-attr]
            return SliceReport(
                step=version.step,
                start=owner.start,
                end=owner.end,
                sha256=version.sha256,
                peers=len(r.received),
                grad_norm=norm,
                refused=r.refused,
            )
        # an aggregator's slice: the client is attach()'s, made when the app started
        report = await self.client.call(  # type: ignore[union-attr]
            "POST",
            self._url(owner, "finalize"),
            SliceReport,
            FinalizeRequest(step=step, round_id=round_id, plan_version=self.plan_version, grad_norm=global_norm),
        )
        if (report.step, report.start, report.end) != (step + 1, owner.start, owner.end):
            raise CallFailed(f"answered {report}")
        return report
