"""Which shard a stream reads next: the :class:`ShardSource` seam and its two implementations.

* :class:`LocalShardOrder` is the paper's (s3.3): every peer walks all shards in its own random
  order, epoch after epoch, with no coordination.
* :class:`RelayShardSource` asks the relay's lease pool (:mod:`relay_server.data.pool`): the pool
  hands out the least-processed shard nobody holds, so peers rarely duplicate work, a departed
  peer's shard returns to the pool, and the run knows its data coverage. A static
  ``split_dataset_by_node`` cannot do this for a swarm whose size changes every minute.

A stream calls, per shard: ``next_shard()`` once, ``report`` as rows of it reach training, then
``release`` exactly once (:mod:`toolkit.data.reading` keeps those books).
"""

from __future__ import annotations

import logging
import random
import secrets
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from toolkit.errors import DataConfigError, RelayRejected, RelayUnreachable
from toolkit.wire.protocol import (
    MAX_SHARD_UPDATES,
    ShardLease,
    ShardLeaseRequest,
    ShardReport,
    ShardReportAck,
    ShardUpdate,
)

if TYPE_CHECKING:
    from toolkit.client import RelayClient
    from toolkit.data.dataset_config import DatasetSpec

log = logging.getLogger(__name__)

_MAX_QUEUED = 4 * MAX_SHARD_UPDATES  # unsent updates kept while the relay is unreachable


@runtime_checkable
class ShardSource(Protocol):
    """Where a data stream gets its shards (one shard = one data file).

    A stream calls, for each shard: ``next_shard()`` once, ``report`` zero or more times as rows
    of it reach training, then ``release`` exactly once. Several shards may be held at once (the
    shuffle buffer still holds rows of earlier shards). Implementations: :class:`LocalShardOrder`
    (no coordination) and :class:`RelayShardSource` (the relay's lease pool; a lease whose peer
    stops heartbeating expires on the relay).
    """

    def next_shard(self) -> str | None:
        """The next shard to read (a path or URL ``datasets`` can open), or None: no more data."""
        ...

    def report(self, shard: str, samples: int) -> None:
        """``samples`` more rows of ``shard`` reached training since the last report (a delta)."""
        ...

    def release(self, shard: str, *, finished: bool) -> None:
        """The stream holds ``shard`` no more: ``finished`` = every row was read and trained on;
        False = it stopped early (closed, or the shard failed), so the shard is not covered."""
        ...


class LocalShardOrder:
    """The default :class:`ShardSource`: every shard once per epoch, in a per-peer random order.

    The order of epoch ``e`` is a shuffle seeded by ``(seed, e)``, so a peer's order is
    reproducible and two peers with different seeds walk the shards differently (paper s3.3).
    ``epochs=None`` cycles forever, as a volunteer's stream must.
    """

    def __init__(self, shards: Sequence[str], seed: int | str, *, epochs: int | None = None) -> None:
        if not shards:
            raise DataConfigError("no_shards", "LocalShardOrder needs at least one shard")
        self.shards = tuple(shards)
        self.seed, self.epochs = seed, epochs
        self.epoch = 0
        self._pending: list[str] = []
        self.samples: Counter[str] = Counter()
        """Rows per shard that reached training, over all epochs (the data coverage)."""
        self.held: Counter[str] = Counter()
        self.finished: Counter[str] = Counter()
        """How many times each shard was read to its end and fully trained on."""

    def epoch_order(self, epoch: int) -> list[str]:
        order = list(self.shards)
        random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def next_shard(self) -> str | None:
        if not self._pending:
            if self.epochs is not None and self.epoch >= self.epochs:
                return None
            self._pending = self.epoch_order(self.epoch)[::-1]  # pop() from the end = walk in order
            self.epoch += 1
        shard = self._pending.pop()
        self.held[shard] += 1
        return shard

    def report(self, shard: str, samples: int) -> None:
        self.samples[shard] += samples

    def release(self, shard: str, *, finished: bool) -> None:
        self.held[shard] -= 1
        if self.held[shard] <= 0:
            del self.held[shard]
        if finished:
            self.finished[shard] += 1


# --- the relay's lease pool -------------------------------------------------------------------
class ShardLeaseClient:
    """The lease calls on top of a :class:`~toolkit.client.RelayClient` (one peer's view).

    Both calls carry a fresh ``request_id``, and the client's retries resend the same body, so a
    retry after a lost answer neither leaks a second lease nor counts progress twice.
    """

    def __init__(self, client: RelayClient, peer_id: str) -> None:
        self.client, self.peer_id = client, peer_id

    def lease(self, source: str) -> ShardLease:
        """A lease on the next shard of dataset ``source``."""
        body = ShardLeaseRequest(source=source, request_id=secrets.token_hex(8))
        return self.client.lease_shard(self.peer_id, body)

    def report(self, updates: Sequence[ShardUpdate]) -> ShardReportAck:
        """Progress deltas and releases, at most ``MAX_SHARD_UPDATES`` per call."""
        body = ShardReport(updates=list(updates), request_id=secrets.token_hex(8))
        return self.client.report_shards(self.peer_id, body)


class RelayShardSource:
    """A :class:`ShardSource` backed by the relay's lease pool, for one dataset of the mix.

    ``next_shard`` leases (the relay never answers "none": when every shard is leased it shares
    the least-held one, so a volunteer never idles). ``report`` deltas are summed locally and
    sent at most every ``report_interval_s`` (a progress report per 1,000 rows would be a request
    per second on a fast GPU); a ``release`` is sent at once with whatever is pending. If the
    relay cannot be reached, updates wait for the next attempt (training goes on); the lease
    itself is kept alive by the peer's heartbeats, not by reports.

    The ``client`` must not be used by another thread at the same time (``requests`` sessions are
    not thread-safe); the training loop's own client is fine, as the stream runs in that loop.
    """

    def __init__(
        self,
        client: RelayClient,
        peer_id: str,
        source: str,
        *,
        report_interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.leases = ShardLeaseClient(client, peer_id)
        self.source, self.report_interval_s, self.clock = source, report_interval_s, clock
        self.held: Counter[str] = Counter()
        self.samples: Counter[str] = Counter()
        """Rows per shard this stream reported (the same books as :class:`LocalShardOrder`)."""
        self.finished: Counter[str] = Counter()
        self.last_lease: ShardLease | None = None
        self._counted: Counter[str] = Counter()  # rows reported per held shard: its size once finished
        self._pending: Counter[str] = Counter()  # deltas not yet sent
        self._queue: list[ShardUpdate] = []  # releases not yet sent, in order
        self._last_sent = clock()

    def next_shard(self) -> str:
        lease = self.leases.lease(self.source)
        self.last_lease = lease
        self.held[lease.shard] += 1
        if lease.holders > 1:
            log.info(
                "dataset %r: every shard is leased; sharing %s with %d other lease(s)",
                self.source,
                lease.shard,
                lease.holders - 1,
            )
        else:
            log.debug(
                "dataset %r: leased %s (%d passes, %d rows so far)",
                self.source,
                lease.shard,
                lease.passes,
                lease.samples,
            )
        return lease.shard

    def report(self, shard: str, samples: int) -> None:
        self._pending[shard] += samples
        self._counted[shard] += samples
        self.samples[shard] += samples
        if self.clock() - self._last_sent >= self.report_interval_s:
            self.flush()

    def release(self, shard: str, *, finished: bool) -> None:
        # The size is only certain when this stream held the shard once: two leases of the same
        # shard (a peer holding every shard) would mix their counts.
        rows = self._counted[shard] if finished and self.held[shard] == 1 else None
        self.held[shard] -= 1
        if self.held[shard] <= 0:
            del self.held[shard]
            self._counted.pop(shard, None)
        if finished:
            self.finished[shard] += 1
        self._queue.append(
            ShardUpdate(
                source=self.source,
                shard=shard,
                samples=self._pending.pop(shard, 0),
                release=True,
                finished=finished,
                rows=rows,
            )
        )
        self.flush()

    def flush(self) -> bool:
        """Send every pending update now; False if the relay could not take them (kept for later)."""
        updates = self._queue + [
            ShardUpdate(source=self.source, shard=s, samples=n) for s, n in self._pending.items() if n
        ]
        self._last_sent = self.clock()
        sent = 0
        try:
            while sent < len(updates):
                chunk = updates[sent : sent + MAX_SHARD_UPDATES]
                ack = self.leases.report(chunk)
                if ack.unknown:
                    log.warning(
                        "dataset %r: the relay does not know shard(s) %s; their progress is lost "
                        "(did the run's data_files change?)",
                        self.source,
                        ack.unknown[:3],
                    )
                sent += len(chunk)
        except RelayUnreachable as exc:
            self._keep(updates[sent:])
            log.warning("dataset %r: shard progress not reported (%s); retrying later", self.source, exc.message)
            return False
        except RelayRejected as exc:  # a 4xx will not get better by resending: drop, say so
            self._keep([] if exc.status < 500 else updates[sent:])
            log.warning("dataset %r: the relay refused shard progress (%s)", self.source, exc)
            return False
        self._queue.clear()
        self._pending.clear()
        return True

    def _keep(self, unsent: list[ShardUpdate]) -> None:
        """Keep unsent updates as queued ones (pending deltas included), bounded."""
        self._pending.clear()
        if len(unsent) > _MAX_QUEUED:
            log.warning(
                "dataset %r: dropping %d old shard updates the relay never took",
                self.source,
                len(unsent) - _MAX_QUEUED,
            )
            unsent = unsent[-_MAX_QUEUED:]
        self._queue = unsent


def relay_shard_sources(client: RelayClient, peer_id: str, **kwargs: Any) -> Callable[[DatasetSpec], RelayShardSource]:
    """The ``shard_source`` factory for :func:`~toolkit.data.stream_texts` / ``batches_for_run``:
    one :class:`RelayShardSource` per dataset of the mix, sharing ``client``."""

    def factory(spec: DatasetSpec) -> RelayShardSource:
        return RelayShardSource(client, peer_id, spec.name, **kwargs)

    return factory


def shard_sources_for_run(
    dataset: Mapping[str, Any], client: RelayClient, peer_id: str
) -> Callable[[DatasetSpec], RelayShardSource] | None:
    """The relay's leases for a streamed run that uses them (``[dataset] leases``, default on);
    None = the default per-peer :class:`LocalShardOrder` (demo corpus, or ``leases = false``)."""
    if (dataset.get("kind") or "demo_corpus") != "stream":
        return None
    leases = dataset.get("leases", True)
    if not isinstance(leases, bool):
        raise DataConfigError("bad_dataset", f"dataset.leases must be true or false, got {leases!r}")
    return relay_shard_sources(client, peer_id) if leases else None
