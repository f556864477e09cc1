"""Audits of stage gradients: the one result of a stage worker no per-task check reaches.

A worker's stage gradient -- the sum of its parameter gradients over the micro-batches whose
backward it ran -- never crosses a boundary: it goes up once, summed, at the round
(:mod:`relay_server.pipeline.batch_rounds`), to the stage's parameter server. The spot checks of
:mod:`.checks` compare boundaries (activations, the gradient of a stage's input), so a worker
honest in every boundary and lying only in that upload was counted. With the default mean
aggregation nothing bounded it.

**What an audit is.** When the relay issues a round's ticket it knows exactly which micro-batches
the upload covers, and it still holds every boundary they were computed from (until the round
closes). For a chosen ticket the relay's own copy of the stage (:class:`~.referee.Referee`) computes
the sum the worker must send -- the same stage code, dropout masks and precision, on the version
the batch computed on -- starting at once, while the worker encodes and uploads. The upload is
streamed into the parameter server's reducer as any other; once its last chunk passed, and before
its commit point, the decoded slice is compared with the referee's (:meth:`GradientAudits.verify`):

* within the tolerance: it commits, as it would have;
* beyond it: the upload is refused and nothing of it is counted (the reducer's commit point), the
  worker is banned, and its stage gradients of the round are recomputed by other workers from the
  same held boundaries (the round closes on those, exact);
* the referee could not compute it (the relay's parameters are another version's, as with delayed
  updates; the run's gradient codec loses too much to compare; no referee): the audit is
  *unserved* and the upload commits unaudited, as an unchecked result does.

**Which tickets.** An HMAC of the ticket's contributor id and round under a secret drawn when the
relay starts, against the run's base share (``[pipeline] check_share``): a worker cannot tell an
audited upload from another. A new worker's first :attr:`AuditDeps.probation` uploads and the
monitors' suspects are always audited. Every unaudited upload is reported ``unchecked``: a later
ban rolls back the batches it was counted in (:mod:`relay_server.pipeline.rollback`).

**Tolerance.** The referee's sum passes through the run's gradient codec before the comparison, as
the worker's did: two honest sums differ by float rounding (the order of the adds, another
BLAS), and through a lossy codec by a quantization step where that rounding crosses one. The
tolerance is the pipeline checks' for the run's precision (:func:`.compare.tolerance`, boundary
codec "none"): 3e-3 in fp32, 3e-2 in bf16. Codecs whose error is not a rounding of each value
(top-k, low-rank: the sum's small values are dropped or projected) are not audited.

**Cost.** One backward of the stage per audited micro-batch on the relay's CPU (the share times a
stage's backward per micro-batch), off the event loop, overlapping the upload; the audited upload
is held in memory once (its slice's float32 size). The upload waits for the referee at most
until its deadline: an audit that cannot finish in time is unserved, never a cut honest upload.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from relay_server.core.errors import ApiError
from relay_server.trust.compare import distance
from toolkit.wire.compression import Codec

if TYPE_CHECKING:
    from relay_server.trust.referee import Referee

log = logging.getLogger(__name__)
AUDITABLE_CODECS = ("none", "float16", "int8")
"""Gradient codecs whose decoded values are each a rounding of the value encoded."""


class GradientLie(ApiError):
    """An audited upload was beyond the tolerance of the referee's sum: refused, its worker banned."""

    def __init__(self, worker: str, reason: str) -> None:
        super().__init__(
            403,
            "banned",
            f"this worker was banned from the pipeline: {reason}",
            "A worker's stage gradients are audited against the relay's own computation; run the unmodified toolkit.",
        )
        self.worker, self.reason = worker, reason


@dataclass(frozen=True)
class AuditDeps:
    share: float
    """The run's base share (``[pipeline] check_share``); 0 turns audits off."""
    tolerance: float
    codec: Codec
    """The run's gradient codec (``[run] compression``): what an upload went through."""
    referee: Referee | None
    suspect: Callable[[str], bool]
    """The monitors: a worker whose every result is checked now."""
    probation: int = 2
    """A new worker's uploads audited for sure."""


@dataclass
class Audit:
    worker: str
    stage: int
    batch: int
    microbatches: list[int]
    reference: asyncio.Task[np.ndarray | None]


@dataclass
class AuditCounters:
    audits: int = 0
    agreed: int = 0
    lies: int = 0
    unserved: int = 0
    microbatches: int = 0
    """Micro-batches the referee computed a backward of for an audit: the audits' compute."""
    probation_microbatches: int = 0
    """Of those, the ones audited because their worker was new (a fixed cost per joining worker)."""
    max_agreeing_distance: float = 0.0
    audited_by: dict[str, int] = field(default_factory=dict)
    """worker -> its uploads audited so far (its probation)."""


class GradientAudits:
    def __init__(self, deps: AuditDeps) -> None:
        self.deps = deps
        self.secret = secrets.token_bytes(32)  # which uploads are audited: unknowable outside this process
        self.pending: dict[str, Audit] = {}  # contributor id -> its audit
        self.counters = AuditCounters()

    @property
    def enabled(self) -> bool:
        return self.deps.share > 0 and self.deps.referee is not None

    def chosen(self, round_id: str, contributor: str, worker: str) -> bool:
        """Whether the upload ``contributor`` of round ``round_id`` is audited (no state changes)."""
        if not self.enabled:
            return False
        if self.deps.suspect(worker) or self.counters.audited_by.get(worker, 0) < self.deps.probation:
            return True
        digest = hmac.new(self.secret, f"{round_id}/{contributor}".encode(), hashlib.sha256).digest()
        return int.from_bytes(digest[:8], "big") < self.deps.share * 2**64

    def begin(
        self,
        round_id: str,
        contributor: str,
        worker: str,
        stage: int,
        version: int,
        batch: int,
        inputs: Sequence[tuple[int, Mapping[str, bytes]]] | None,
    ) -> bool:
        """A ticket :meth:`chosen` was issued for ``worker``'s gradient of ``stage`` over the
        micro-batches of ``inputs`` (each with the stored boundaries its backward read; None: the
        relay no longer holds them all): the referee starts computing the sum it must be, on
        ``version`` (the one the batch computed on). Whether the audit is under way (else it is
        unserved, and the upload will commit unaudited)."""
        new = self.counters.audited_by.get(worker, 0) < self.deps.probation and not self.deps.suspect(worker)
        self.counters.audits += 1
        self.counters.audited_by[worker] = self.counters.audited_by.get(worker, 0) + 1
        if self.deps.codec.name not in AUDITABLE_CODECS or inputs is None:
            self.counters.unserved += 1
            return False
        referee = self.deps.referee
        assert referee is not None  # enabled
        reference = asyncio.get_running_loop().create_task(
            asyncio.to_thread(referee.stage_gradient, stage, version, inputs)
        )
        self.counters.microbatches += len(inputs)
        self.counters.probation_microbatches += len(inputs) if new else 0
        self.pending[contributor] = Audit(worker, stage, batch, [m for m, _ in inputs], reference)
        return True

    def audited(self, contributor: str) -> bool:
        return contributor in self.pending

    async def verify(self, contributor: str, values: np.ndarray, wait_s: float) -> None:
        """The whole decoded upload of ``contributor``: agree, or raise :class:`GradientLie`. An
        audit whose reference is not ready within ``wait_s`` (the upload's deadline) is unserved."""
        audit = self.pending.pop(contributor, None)
        if audit is None:
            return
        try:
            truth = await asyncio.wait_for(asyncio.shield(audit.reference), timeout=max(0.0, wait_s))
        except TimeoutError:
            log.warning(
                "stage %d gradient audit of %s not ready in %.1f s: unserved", audit.stage, audit.worker[:16], wait_s
            )
            truth = None
        except Exception:  # a referee that cannot compute decides nothing
            log.exception("the relay could not audit stage %d's gradient of %s", audit.stage, audit.worker[:16])
            truth = None
        if truth is None or truth.shape != values.shape:
            self.counters.unserved += 1
            return
        expected = self.deps.codec.decode(self.deps.codec.encode(truth), n=truth.size)
        d = distance(expected, values)
        if d <= self.deps.tolerance:
            self.counters.agreed += 1
            self.counters.max_agreeing_distance = max(self.counters.max_agreeing_distance, d)
            return
        self.counters.lies += 1
        reason = (
            f"its stage {audit.stage} gradient of micro-batches {audit.microbatches} (batch {audit.batch}) is "
            f"{d:.3g} (relative L2) from the relay's own computation, tolerance {self.deps.tolerance:.3g}"
        )
        log.warning("pipeline worker %s lied in its stage gradient: %s", audit.worker[:16], reason)
        raise GradientLie(audit.worker, reason)

    def drop(self, contributor: str) -> None:
        """The ticket is void (its upload refused, cut or never sent): its audit goes."""
        audit = self.pending.pop(contributor, None)
        if audit is not None:
            audit.reference.cancel()

    def round_over(self) -> None:
        for contributor in list(self.pending):
            self.drop(contributor)
