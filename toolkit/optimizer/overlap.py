"""``[local_sgd] overlap = true``: local SGD's outer round runs behind the next inner steps.

This is a *one-step-delayed outer update* (as DiLoCoX and "eager updates" for DiLoCo do). When
the inner budget ends on version ``t`` the peer puts ``theta_t - x_s`` into the accumulator, keeps
its local parameters ``x_s`` as a snapshot, and hands the outer round to the background worker
(:meth:`OverlappedRound.outer_job`: report until the relay opens the round, then sync mode's own
``take_upload`` / ``round_job``: upload, wait for version ``t + 1``); it goes on training from
``x_s`` meanwhile. When ``theta_{t+1}`` has arrived, the next ``step()`` rebases after its inner
step: ``x <- theta_{t+1} + (x - x_s)`` -- the inner steps taken meanwhile are carried onto the new
global parameters, the inner optimizer's state stays -- and that loop's pseudo-gradient is
``theta_{t+1} - x`` at its end, on version ``t + 1``. If the next budget ends before the result,
the peer waits then: that wait is what :attr:`LocalSgd.busy_fraction
<toolkit.optimizer.local_sgd.LocalSgd.busy_fraction>` sees. The cost: each pseudo-gradient was
computed on parameters one outer step older than those it is applied to, and the peer holds one
more copy of the parameters (the snapshot).

Why not Streaming DiLoCo's fragments: they cut *peak* bandwidth by synchronizing a slice of the
layers at staggered times, but each fragment is then an outer round with its own version -- the
relay's one version per step, its whole-vector delta downloads and the registry's version rule
would all have to become per-fragment. A whole-model delayed round hides the same time behind
compute with none of that, and the bytes still move once per H inner steps.

Versions stay consistent with :class:`OuterRoundRule <relay_server.local_sgd.outer_rounds.OuterRoundRule>`:
while a round is in flight a peer with nothing to send reports the version it will rebase onto
(:meth:`OverlappedRound.working_version`: the relay's newest once it heard of it), the relay
counts the previous round's contributors as working on the new version until they report it,
and an upload under way still reports its samples (``RoundParticipation.sending``), so the relay never drops the
peer from the round it is uploading to.

Every way the round can end leaves the accumulator empty and the model on global parameters plus
the peer's own steps since the snapshot: a result is loaded as the rebase; a pseudo-gradient the
relay refused, or one it moved past (late), is dropped and the peer rebases onto the newest global
parameters; a lost round (relay restart) goes back into the accumulator and to the worker while
the relay stays on its version; no round within ``round_wait_s`` (relay gone) drops it; the run
finishing and ``close()`` settle or stop the worker's job and leave the model on the newest global
parameters.

Kept apart from :mod:`toolkit.optimizer.local_sgd` (the inner loop, the blocking round) as the
object :class:`~toolkit.optimizer.local_sgd.LocalSgd` holds only with overlap on: it owns the
snapshot and the round in flight's timing, and reaches the inner loop, the optimizer and its
rounds through their public methods.
"""

from __future__ import annotations

import logging
import time
from concurrent import futures
from typing import TYPE_CHECKING

import torch

from toolkit.errors import CollabError

if TYPE_CHECKING:
    from toolkit.client import RelayClient
    from toolkit.optimizer.core import CollaborativeOptimizer
    from toolkit.optimizer.local_sgd import LocalSgd
    from toolkit.optimizer.participation import Outcome

log = logging.getLogger("toolkit.optimizer")

WAIT_POLL_S = 0.05
"""How often a peer waiting for its outer round looks again (reports stay rate-limited by
``report_interval_s``)."""


class OverlappedRound:
    """The outer round of one :class:`~toolkit.optimizer.local_sgd.LocalSgd` behind its next inner
    steps (module docstring)."""

    def __init__(self, local: LocalSgd, opt: CollaborativeOptimizer) -> None:
        self.local, self.opt, self.rounds = local, opt, opt.rounds
        self.snapshot: list[torch.Tensor] | None = None  # the local parameters whose pseudo-gradient is in flight
        self.flight_version = -1  # the version that pseudo-gradient is on
        self.give_up = 0.0  # when it is dropped if its round has not happened

    def working_version(self) -> int:
        """The version this inner loop's pseudo-gradient will be relative to, as reports say it
        while there is nothing to send: with a round in flight, the relay's newest version once it
        moved past the round (the rebase lands there), so :class:`OuterRoundRule
        <relay_server.local_sgd.outer_rounds.OuterRoundRule>` waits for this peer on that version."""
        opt = self.opt
        if self.snapshot is not None:
            return max(opt.version, opt.collab_state.step, 0)
        return max(opt.version, 0)

    def step(self) -> None:
        """``LocalSgd.after_step`` with overlap: move the round in flight on; at the budget end, wait
        for it if it is still in flight, then launch the next one."""
        opt = self.opt
        self._advance()
        if not opt.finished and self.local.budget_spent():
            self._wait_for_flight()
            if not opt.finished:
                self._launch()
        if opt.finished:
            self._finish()

    def _launch(self) -> None:
        """The budget ended with no round in flight: put ``global - local`` into the accumulator,
        keep the local parameters as the snapshot, start the next inner loop, and hand the outer
        round to the worker (:meth:`outer_job`)."""
        opt, local = self.opt, self.local
        if local.samples == 0 or self.snapshot is not None:
            # (a snapshot still here: no global copy to rebase onto, the relay is gone; these
            # steps stay in the model and are carried by the rebase once it is back)
            local.restart()
            return
        opt.accumulator.add(
            local.pseudo_gradient(), local.samples, local.loss_sum / local.samples, opt.version, weight=local.samples
        )
        self.snapshot = [p.detach().clone() for p in self.rounds.params]
        self.flight_version = opt.version
        self.give_up = time.monotonic() + opt.round_wait_s
        local.restart()
        self._advance()

    def outer_job(self, client: RelayClient) -> Outcome | None:
        """In the worker: report until the relay opens the outer round on the snapshot's version,
        then upload and wait for the result (:meth:`RoundParticipation.round_job <toolkit.optimizer.
        rounds.RoundParticipation.round_job>`). None when there is nothing to upload any more (the
        relay moved on, the run finished, the peer closes, ``round_wait_s`` ran out): the training
        thread's next :meth:`_advance` sorts that out."""
        opt, rounds, version = self.opt, self.rounds, self.flight_version
        while not rounds.stopping.is_set() and time.monotonic() < self.give_up:
            try:
                state = opt.report_progress(client)
            except CollabError as exc:  # a blip: report again
                opt.note_error(exc)
            else:
                if state.finished or state.step != version or not opt.samples:
                    return None
                r = state.round
                if r is not None and r.step == version and rounds.new_round(r.round_id):
                    upload = rounds.take_upload(client, r.step, r.round_id)
                    return None if upload is None else rounds.round_job(client, upload, r.round_id)
            rounds.stopping.wait(max(opt.report_interval_s, WAIT_POLL_S))
        return None

    def _advance(self) -> None:
        """Move the round in flight on without blocking (training thread): settle what the worker
        brought back (a result is loaded as the rebase), report when due, drop the pseudo-gradient
        if the relay moved on (rebasing then too), and put the outer round back in the worker's
        hands while the pseudo-gradient waits for its round (after a lost round, or at launch)."""
        opt, rounds = self.opt, self.rounds
        opt.sync()
        if self.snapshot is None or opt.finished or rounds.pending is not None or rounds.sending is not None:
            return
        if time.monotonic() >= self.give_up and (opt.samples or rounds.limbo is not None):
            self._abandon()
        elif opt.samples and rounds.limbo is None:
            rounds.submit(self.outer_job)
        elif not opt.samples and rounds.limbo is None and opt.collab_state.step <= self.flight_version:
            # the round refused our pseudo-gradient and the relay is still on our version: carry
            # the inner steps since the snapshot onto the global parameters held
            rounds.load(force=True)

    def _wait_for_flight(self) -> None:
        """The next budget ended before the round in flight did: wait for it (what
        :attr:`LocalSgd.busy_fraction` measures), reporting meanwhile; bounded by ``round_wait_s``
        from the launch plus one worker job (whose upload and wait are bounded themselves)."""
        opt = self.opt
        while self.snapshot is not None and not opt.finished:
            pending = self.rounds.pending
            if pending is not None:
                futures.wait([pending], timeout=max(opt.report_interval_s, WAIT_POLL_S))
            elif time.monotonic() >= self.give_up + opt.round_wait_s:
                return  # not even a global copy to rebase onto (relay gone): the caller keeps going
            else:
                time.sleep(WAIT_POLL_S)
            self._advance()

    def _abandon(self) -> None:
        """No outer round within ``round_wait_s`` (the relay is gone or stuck): drop the
        pseudo-gradient and rebase onto the newest global parameters this peer can get."""
        opt, rounds = self.opt, self.rounds
        rounds.discard(f"no outer round for step {self.flight_version} within {opt.round_wait_s:.0f}s; dropped")
        rounds.drop_limbo()
        try:
            rounds.load_latest()
        except CollabError as exc:
            opt.note_error(exc)
        if self.snapshot is not None:
            rounds.load(force=True)  # no-op if the public copy is unusable: the next sync retries

    def rebase_carry(self, params: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Called by the rounds just before they copy global parameters into the model: with a
        round in flight, ``snapshot - local`` (computed in place in the snapshot, which is then
        released), so that ``theta - carry = theta + (local - snapshot)`` keeps the inner steps
        taken since the snapshot; None otherwise (a plain load)."""
        snapshot, self.snapshot = self.snapshot, None
        if snapshot is None:
            return None
        with torch.no_grad():
            torch._foreach_sub_(snapshot, [p.detach() for p in params])
        return snapshot

    def drop(self) -> None:
        """Forget the snapshot (leaving: nothing will be rebased)."""
        self.snapshot = None

    def _finish(self) -> None:
        """The run finished: settle the last round (its result is published, so the worker's wait
        ends at once) and leave the model on the final global parameters (the inner steps since
        the last snapshot can count nowhere)."""
        opt, rounds = self.opt, self.rounds
        pending = rounds.take_pending()
        if pending is not None:
            try:
                rounds.settle(pending.result(timeout=opt.round_wait_s))
            except (TimeoutError, CollabError) as exc:
                log.info("the run finished with an outer round unsettled (%s)", type(exc).__name__)
        whole = pending is None or pending.done()  # else the worker may still write the public copy
        if whole:
            try:
                rounds.download(opt.client)
            except CollabError as exc:
                opt.note_error(exc)
        self.local.leave(public_whole=whole)
