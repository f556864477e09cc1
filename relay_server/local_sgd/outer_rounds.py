"""When the relay opens an outer round of ``run.mode = "local_sgd"``.

In local SGD a peer reports no samples while its inner loop runs, then all it processed at once
when its inner budget ends (:mod:`toolkit.optimizer.local_sgd`); the upload, reduction and step
are sync mode's own (the outer optimizer is the master's, :meth:`RelayConfig.master_optimizer`).

The rule: the outer round on version ``step`` opens once every live peer working on ``step``
finished its inner budget, or once the finished ones hold ``run.target_batch`` samples, or
``local_sgd.straggler_wait_s`` after the first one finished (caps on waiting for stragglers: a
paused notebook keeps heartbeating). With a time budget (``local_sgd.inner_seconds``) peers that started from
the same version finish together whatever their speed, so all of them contribute. A peer that
dies mid-inner-loop stops heartbeating and leaves the registry after ``rounds.peer_ttl_s``: the
round then opens without it (it loses only its own inner steps). A peer that finishes after the
round closed holds a pseudo-gradient on an old version; with ``run.max_staleness = 0`` (required
in this mode) it is dropped -- the peer counts it (``LocalSgd.late_rounds``) and restarts from
the new global parameters (:mod:`toolkit.optimizer.local_sgd` says why it is not applied late).
"Working on ``step``" means reporting version ``step``, or having contributed to the round that
produced ``step`` while still reporting an older version: such a peer has not heard of ``step``
yet, but its next inner loop is on it. With ``[local_sgd] overlap`` this matters: a peer whose
previous budget ended during the round finishes its next one as soon as the result arrives, and
must not open the round before the others even learned of the new version. A peer whose
pseudo-gradient is in flight reports, once it knows of ``step``, the version it will rebase onto
(``step``) with no samples -- waited for here like any peer that loaded it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from relay_server.rounds.peer_registry import Registry


class OuterRoundRule:
    """Whether the outer round on version ``step`` should open now (module docstring)."""

    def __init__(self, target_batch: int, straggler_wait_s: float) -> None:
        self.target_batch, self.straggler_wait_s = target_batch, straggler_wait_s
        self._first_finished: tuple[int, float] | None = None  # (step, when a peer first finished on it)
        self._contributors: tuple[int, frozenset[str]] = (-1, frozenset())  # (step, who made it)

    def published(self, step: int, contributors: Iterable[str]) -> None:
        """The round whose pseudo-gradients these peers sent produced ``step``."""
        self._contributors = (step, frozenset(contributors))

    def due(self, registry: Registry, step: int, ahead: int = 0, now: float | None = None) -> bool:
        """Scans the peers only once someone finished (not on every heartbeat of the inner loops).
        ``ahead`` (samples being computed) means nothing here: a peer reports only at its budget's end."""
        finished = registry.collected(step, 0)
        if finished == 0:
            return False
        now = time.monotonic() if now is None else now
        if self._first_finished is None or self._first_finished[0] != step:
            self._first_finished = (step, now)
        if finished >= self.target_batch or now - self._first_finished[1] >= self.straggler_wait_s:
            return True
        made, contributors = self._contributors
        if made != step:
            contributors = frozenset()
        return all(
            p.samples > 0
            for p in registry.peers.values()
            if p.version == step or (p.version < step and p.peer_id in contributors)
        )
