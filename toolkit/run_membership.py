"""A peer's place in the run, whatever role it plays: join, heartbeat, join again, back off, leave.

Every role (the trainer, the expert host, the stage worker) is a member of the run the same way,
so the policy lives here once instead of in three loops that had drifted apart (a fixed 2 s wait
in one, a doubling backoff in another, no rejoin at all in the third):

* **join**: one ``POST /api/join`` with the role's :class:`~toolkit.wire.protocol.JoinRequest`;
  :attr:`Membership.peer_id` is the id the relay gave (this object owns it; a role reads it).
* **heartbeat**: :meth:`Membership.beat` sends what the role reports (its ``report()`` builds the
  :class:`~toolkit.wire.protocol.Heartbeat`), and :meth:`Membership.keep_alive` does so on a
  thread every ``interval_s`` since the last beat, so a long forward pass or a long poll does not
  look like a dead peer. (The trainer's background worker, which also runs its delayed rounds,
  hands its reports to :meth:`Membership.beat` itself, through its own client.)
* **rejoin on** ``unknown_peer``: a relay that lost its data dir no longer knows the peer id (one
  that merely restarted re-admits it by itself). The member joins again with the same request, at
  most once per lost id even when the heartbeat thread and the role's loop find out together,
  and tells the role (``on_rejoin``) so it redoes what was tied to the old id (its stage, its
  leases).
* **backoff**: :class:`Backoff`, exponential from ``first_s``, capped at ``max_s``, each wait
  jittered down by up to ``jitter`` of it so that the hosts of a restarted relay do not all come
  back in the same instant. :meth:`Membership.recover` is the one policy a role's loop applies to
  an error it can wait out.
* **leave**: stops the heartbeat thread first (no heartbeat may follow the leave: the relay would
  re-admit the peer it just removed), then says goodbye, best effort.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from toolkit.client import RelayClient
from toolkit.errors import CollabError
from toolkit.wire.protocol import CollabState, Heartbeat, JoinRequest, JoinResponse

log = logging.getLogger(__name__)


@dataclass
class Backoff:
    """How long to wait after the n-th failure in a row: ``first_s * 2**n`` capped at ``max_s``,
    then drawn uniformly from ``[(1 - jitter) * that, that]``. ``rng`` makes the draw
    deterministic in tests (``Backoff(rng=random.Random(0))``)."""

    first_s: float = 1.0
    max_s: float = 8.0
    jitter: float = 0.5
    rng: random.Random = field(default_factory=random.Random)
    failures: int = 0
    """Failures in a row since the last :meth:`reset`."""

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.max_s:
            raise ValueError(f"Backoff needs 0 < first_s <= max_s, got first_s={self.first_s}, max_s={self.max_s}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"Backoff jitter is a fraction in [0, 1), got {self.jitter}")

    def next(self) -> float:
        """The wait after one more failure."""
        ceiling = min(self.first_s * 2.0 ** min(self.failures, 62), self.max_s)
        self.failures += 1
        return ceiling * (1.0 - self.jitter * self.rng.random())

    def reset(self) -> None:
        """A success: the next failure waits ``first_s`` (jittered) again."""
        self.failures = 0


def idle_report() -> Heartbeat:
    """The heartbeat of a member with no progress to report (an expert host)."""
    return Heartbeat(version=0, samples=0, samples_per_s=0.0)


class Membership:
    """One peer's membership of the run (the module docstring says the policy).

        ``report()`` builds each heartbeat; ``on_rejoin(joined)`` runs after the relay gave a new peer
        id (on the thread that found the old one gone: set a flag for the role's loop rather than
        doing the role's work there). ``clock`` is what heartbeat times are measured on; ``what`` names
    the member in log lines ("host", "stage worker").
    """

    def __init__(
        self,
        client: RelayClient,
        request: JoinRequest,
        *,
        report: Callable[[], Heartbeat] = idle_report,
        on_rejoin: Callable[[JoinResponse], None] | None = None,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
        what: str = "peer",
    ) -> None:
        self.client, self.request, self.what = client, request, what
        self.report, self.on_rejoin = report, on_rejoin
        self.backoff = backoff or Backoff()
        self.clock = clock
        self.peer_id = ""
        self.joined: JoinResponse | None = None
        """The relay's answer to the latest join (the run, the state then)."""
        self.state: CollabState | None = None
        """The relay's latest answer: to the join, then to each heartbeat (for a panel)."""
        self.rejoins = 0
        self.last_beat_at = float("-inf")
        """When the last heartbeat (or the join) was attempted, on ``clock``."""
        self.last_error: CollabError | None = None
        """The last heartbeat's failure (None once one succeeds again)."""
        self._lock = threading.Lock()  # one join at a time: two threads finding the id gone rejoin once
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._left = False

    def play(
        self, *, report: Callable[[], Heartbeat], on_rejoin: Callable[[JoinResponse], None] | None = None
    ) -> None:
        """The role this member plays from now on: what its heartbeats report, and what it redoes
        after a rejoin (for a role built once the member has joined: the stage worker)."""
        self.report, self.on_rejoin = report, on_rejoin

    # --- join -------------------------------------------------------------------------------------
    def join(self) -> JoinResponse:
        """Join the run; raises what the relay refused (the role decides whether that ends it)."""
        with self._lock:
            return self._join()

    def _join(self, client: RelayClient | None = None) -> JoinResponse:
        self.last_beat_at = self.clock()  # a join is a sign of life too
        joined = (client or self.client).join(self.request)
        self.peer_id, self.joined, self.state = joined.peer_id, joined, joined.state
        self._left = False
        return joined

    def rejoin(self, lost: str, client: RelayClient | None = None) -> JoinResponse:
        """Join again (through ``client``: the calling thread's, default this member's) after the
        relay forgot ``lost``; a no-op when another thread already replaced that id (the latest
        join's answer is returned either way)."""
        with self._lock:
            if self.peer_id != lost or self.joined is None:
                # None only before the first join(), and nothing can be lost before it
                return self.joined  # type: ignore[return-value]
            log.warning("the relay no longer knows this %s; joining again", self.what)
            joined = self._join(client)
            self.rejoins += 1
        if self.on_rejoin is not None:
            self.on_rejoin(joined)
        return joined

    # --- heartbeat --------------------------------------------------------------------------------
    def beat(self, report: Heartbeat | None = None, client: RelayClient | None = None) -> CollabState:
        """One heartbeat: ``report`` (default: the role's ``report()``) through ``client`` (the
        calling thread's, default this member's); ``unknown_peer`` joins again (and the join's
        state is returned). Any other refusal is raised."""
        peer_id = self.peer_id
        self.last_beat_at = self.clock()
        try:
            state = (client or self.client).heartbeat(peer_id, report if report is not None else self.report())
        except CollabError as exc:
            if exc.code != "unknown_peer":
                raise
            state = self.rejoin(peer_id, client).state
        self.state = state
        return state

    def keep_alive(self, interval_s: float) -> None:
        """Heartbeat on a daemon thread, ``interval_s`` after the last beat, until :meth:`leave`
        (or :meth:`stop`). A failure is kept in :attr:`last_error` and logged; the next beat
        tries again."""
        if self._thread is not None:
            return
        self._stopping.clear()
        self._thread = threading.Thread(
            target=self._keep_alive, args=(interval_s,), daemon=True, name="collab-membership"
        )
        self._thread.start()

    def _keep_alive(self, interval_s: float) -> None:
        while not self._stopping.wait(max(0.0, self.last_beat_at + interval_s - self.clock())):
            if self.clock() - self.last_beat_at < interval_s:
                continue  # the role reported meanwhile: that was the heartbeat
            try:
                self.beat()
                self.last_error = None
            except CollabError as exc:
                self.last_error = exc
                log.warning("heartbeat failed: %s", exc.message)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop heartbeating; waits for a heartbeat in flight so none follows."""
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    # --- recovery ---------------------------------------------------------------------------------
    def recover(self, exc: CollabError, wait: Callable[[float], object]) -> bool:
        """The policy for an error a role's loop can wait out: the peer id forgotten -> join
        again, True (the role redoes what hung on the old id: its stage, its leases); anything
        else, or a join that fails -> ``wait(backoff)`` (a stop event's ``wait``), False. Call
        :meth:`succeeded` after the loop's next success."""
        if exc.code == "unknown_peer":
            try:
                self.beat()  # rejoins, unless another thread did already
                return True
            except CollabError as again:
                log.warning("could not join again: %s", again.message)
        wait(self.backoff.next())
        return False

    def succeeded(self) -> None:
        self.backoff.reset()

    # --- leave ------------------------------------------------------------------------------------
    def leave(self) -> None:
        """Stop heartbeating, then tell the relay this peer is gone (best effort; once)."""
        self.stop()
        if self._left or not self.peer_id:
            return
        self._left = True
        try:
            self.client.leave(self.peer_id)
        except CollabError as exc:
            log.debug("leave not delivered: %s", exc)
