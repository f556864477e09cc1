"""Unit tests of the lease pool (relay_server.data.pool) and of the peer's RelayShardSource, in one
process: the policy, its invariant under random operation sequences, the ledger, and a real
stream (local shard files, offline) leasing from a pool through an in-process fake client."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay_server.core.errors import ApiError
from relay_server.data.pool import ShardLedger, ShardPool
from toolkit.data import RelayShardSource, StreamConfig, shard_sources_for_run, stream_texts
from toolkit.errors import DataConfigError, RelayRejected, RelayUnreachable
from toolkit.wire.protocol import ROUTES, ShardLease, ShardReport, ShardReportAck, ShardUpdate

SHARDS = [f"s{i:02d}.jsonl" for i in range(6)]


def pool_of(n: int = 6, **kwargs) -> ShardPool:
    return ShardPool({"a": [f"s{i:02d}.jsonl" for i in range(n)]}, **kwargs)


def finish(pool: ShardPool, peer: str, shard: str, rows: int) -> None:
    pool.report(peer, [ShardUpdate(source="a", shard=shard, samples=rows, release=True, finished=True, rows=rows)])


# --- the policy ---------------------------------------------------------------------------------
def test_unleased_shards_go_first_and_each_to_one_peer():
    pool = pool_of()
    got = [pool.lease(f"peer{i % 3}", "a").shard for i in range(6)]
    assert sorted(got) == sorted(SHARDS)  # six leases, six different shards, whoever asks
    assert all(c.holders == 1 for c in pool.coverage().shards)


def test_least_processed_first_passes_then_rows():
    pool = pool_of(4)
    finish(pool, "x", "s00.jsonl", 50)  # 1 pass
    pool.report("x", [ShardUpdate(source="a", shard="s01.jsonl", samples=30)], alive=False)  # 0 passes, 30 rows
    pool.report("x", [ShardUpdate(source="a", shard="s02.jsonl", samples=5)], alive=False)  # 0 passes, 5 rows
    order = [pool.lease("y", "a").shard for _ in range(4)]
    assert order == ["s03.jsonl", "s02.jsonl", "s01.jsonl", "s00.jsonl"]


def test_when_every_shard_is_leased_the_least_leased_then_least_processed_is_shared():
    pool = pool_of(3)
    for peer in ("p", "q", "r"):
        pool.lease(peer, "a")
    pool.report(
        "p",
        [
            ShardUpdate(source="a", shard=s, samples=n)
            for s, n in (("s00.jsonl", 9), ("s01.jsonl", 2), ("s02.jsonl", 5))
        ],
        alive=False,
    )
    shared = pool.lease("late", "a")
    assert (shared.shard, shared.holders) == ("s01.jsonl", 2)  # all held once: the least processed
    again = pool.lease("later", "a")
    assert (again.shard, again.holders) == ("s02.jsonl", 2)  # s01 now has two leases: next least-leased


def test_ties_are_deterministic_per_peer_and_spread_across_peers():
    first = [pool_of(16).lease(f"peer-{i}", "a").shard for i in range(24)]
    assert first == [pool_of(16).lease(f"peer-{i}", "a").shard for i in range(24)]
    assert len(set(first)) >= 8  # not everyone starts on the same file


def test_expire_returns_a_departed_peers_shards_and_keeps_their_counts():
    pool = pool_of(2)
    held = pool.lease("gone", "a").shard
    pool.report("gone", [ShardUpdate(source="a", shard=held, samples=12)])
    other = pool.lease("stays", "a").shard
    assert pool.expire({"stays"}) == [("a", held)]
    assert pool.held_by("gone") == {} and pool.held_by("stays") == {("a", other): 1}
    coverage = {c.shard: c for c in pool.coverage().shards}
    assert coverage[held].holders == 0 and coverage[held].samples == 12
    assert pool.lease("new", "a").shard == held  # back in the pool, unleased again


def test_a_peer_holding_a_shard_twice_loses_both_leases_when_it_goes():
    pool = pool_of(1)
    shard = pool.lease("p", "a").shard
    pool.lease("p", "a")
    assert pool.expire(set()) == [("a", shard)] and pool.coverage().shards[0].holders == 0
    events = [(e[5], e[6]) for e in pool.take_changes()[1]]
    assert events == [("start", 0), ("grant", 1), ("grant", 2), ("expire", 1), ("expire", 0)]


def test_release_and_finish_end_one_lease_and_finish_counts_a_pass():
    pool = pool_of(1)
    shard = pool.lease("p", "a").shard
    assert pool.lease("p", "a").holders == 2  # one peer may hold a shard twice (every shard is its own)
    pool.report("p", [ShardUpdate(source="a", shard=shard, samples=3, release=True)])
    finish(pool, "p", shard, 40)
    (c,) = pool.coverage().shards
    assert (c.holders, c.passes, c.samples, c.rows) == (0, 1, 43, 40)
    assert pool.summary()[0].min_passes == 1 and pool.summary()[0].finished == 1


def test_a_retried_request_is_answered_not_applied_twice():
    pool = pool_of()
    first = pool.lease("p", "a", request_id="r1")
    assert pool.lease("p", "a", request_id="r1") == first
    assert pool.lease("p", "a", request_id="r2").shard != first.shard
    update = [ShardUpdate(source="a", shard=first.shard, samples=7)]
    pool.report("p", update, request_id="u1")
    assert pool.report("p", update, request_id="u1").accepted == 1
    assert {c.shard: c.samples for c in pool.coverage().shards}[first.shard] == 7


def test_progress_on_a_lost_lease_reattaches_it_only_for_a_live_peer():
    pool = pool_of(2)
    shard = pool.lease("p", "a").shard
    pool.expire(set())  # e.g. the relay restarted, or p was silent past the TTL
    pool.report("p", [ShardUpdate(source="a", shard=shard, samples=1)], alive=False)
    assert pool.held_by("p") == {}
    pool.report("p", [ShardUpdate(source="a", shard=shard, samples=1)])
    assert pool.held_by("p") == {("a", shard): 1}  # still reading it: the pool knows again
    assert pool.lease("q", "a").shard != shard


def test_unknown_sources_and_shards_are_named():
    pool = pool_of(1)
    with pytest.raises(ApiError, match="no dataset named 'b'") as err:
        pool.lease("p", "b")
    assert err.value.status == 404 and "['a']" in err.value.hint
    ack = pool.report(
        "p",
        [
            ShardUpdate(source="a", shard="elsewhere.jsonl", samples=3),
            ShardUpdate(source="a", shard="s00.jsonl", samples=3),
        ],
    )
    assert (ack.accepted, ack.unknown) == (1, ["elsewhere.jsonl"])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["lease", "release", "finish", "progress", "expire"]),
            st.integers(0, 4),
            st.integers(0, 1000),
        ),
        max_size=80,
    ),
    st.integers(1, 7),
)
def test_no_shard_is_shared_while_an_unleased_one_remains(ops, n_shards):
    """Random lease/release/progress/expire sequences from five peers: every grant of a shard
    that already had a lease happens only when every shard of the source had one."""
    pool, live = pool_of(n_shards), {f"p{i}" for i in range(5)}
    for op, who, amount in ops:
        peer = f"p{who}"
        held = list(pool.held_by(peer))
        if op == "lease":
            before = {c.shard: c.holders for c in pool.coverage().shards}
            lease = pool.lease(peer, "a")
            if before[lease.shard] > 0:
                assert min(before.values()) > 0, (before, lease)
                assert before[lease.shard] == min(before.values())  # and the least-leased one
            live.add(peer)
        elif op in ("release", "finish") and held:
            shard = held[amount % len(held)][1]
            pool.report(
                peer,
                [
                    ShardUpdate(
                        source="a", shard=shard, samples=amount, release=True, finished=op == "finish", rows=amount
                    )
                ],
            )
        elif op == "progress" and held:
            pool.report(peer, [ShardUpdate(source="a", shard=held[0][1], samples=amount)])
        elif op == "expire":
            live.discard(peer)
            pool.expire(live)
    holders = {c.shard: c.holders for c in pool.coverage().shards}
    assert sum(holders.values()) == sum(sum(pool.held_by(f"p{i}").values()) for i in range(5))
    replayed: Counter = Counter()  # the lease log, one event per lease begun or ended, tells the same story
    for _seq, _at, _source, shard, _peer, event, leases in pool.take_changes()[1][1:]:
        replayed[shard] += 1 if event in ("grant", "reclaim") else -1
        assert replayed[shard] == leases
    assert {s: replayed[s] for s in holders} == holders


# --- the ledger -----------------------------------------------------------------------------------
def test_counts_and_the_lease_log_survive_a_new_pool(tmp_path):
    dataset = {"kind": "stream", "sources": [{"name": "a", "data_files": [str(tmp_path / s) for s in SHARDS[:3]]}]}
    ledger = ShardLedger(tmp_path / "relay.sqlite")
    pool = ShardPool.from_dataset(dataset, ledger)
    shard = pool.lease("p", "a").shard
    pool.report("p", [ShardUpdate(source="a", shard=shard, samples=30, release=True, finished=True, rows=30)])
    ledger.write(*pool.take_changes())
    assert pool.take_changes() == ([], [])
    ledger.close()

    ledger = ShardLedger(tmp_path / "relay.sqlite")
    again = ShardPool.from_dataset(dataset, ledger)
    assert {c.shard: (c.samples, c.passes, c.rows) for c in again.coverage().shards}[shard] == (30, 1, 30)
    assert again.lease("q", "a").shard != shard  # the finished one is no longer first
    ledger.write(*again.take_changes())
    events = [(e[5], e[4]) for e in ledger.events()]
    assert events == [("start", ""), ("grant", "p"), ("finish", "p"), ("start", ""), ("grant", "q")]
    assert [e[0] for e in ledger.events()] == [1, 2, 3, 4, 5]  # the log's order continues
    ledger.close()


def test_a_failed_write_keeps_the_changes_for_the_next(tmp_path):
    pool = pool_of(2)
    pool.lease("p", "a")
    rows, events = pool.take_changes()
    pool.restore_changes(rows, events)
    assert pool.take_changes() == (rows, events)


@pytest.mark.parametrize(
    "section,expected",
    [
        ({"kind": "demo_corpus"}, None),
        ({}, None),
        ({"kind": "stream", "leases": False, "sources": [{"data_files": ["x.txt"]}]}, None),
    ],
)
def test_runs_without_leases_have_no_pool(section, expected):
    assert ShardPool.from_dataset(section) is expected
    assert shard_sources_for_run(section, client=None, peer_id="p") is None  # type: ignore[arg-type]


def test_a_bad_leases_value_is_a_config_error():
    with pytest.raises(DataConfigError, match="leases must be true or false"):
        StreamConfig.from_dict({"kind": "stream", "leases": "yes", "sources": [{"data_files": ["x.txt"]}]})
    with pytest.raises(DataConfigError, match="names must be unique"):
        StreamConfig.from_dict({"sources": [{"name": "a", "data_files": ["x"]}, {"name": "a", "data_files": ["y"]}]})


# --- the peer side: RelayShardSource --------------------------------------------------------------
class PoolClient:
    """Stands in for RelayClient: ``_call`` goes straight to a ShardPool, and may fail on demand."""

    def __init__(self, pool: ShardPool) -> None:
        self.pool, self.calls, self.fail = pool, [], None

    def lease_shard(self, peer_id, request):
        return self._call("POST", ROUTES["shard_lease"].format(peer_id=peer_id), ShardLease, request)

    def report_shards(self, peer_id, report):
        return self._call("POST", ROUTES["shard_report"].format(peer_id=peer_id), ShardReportAck, report)

    def _call(self, method, path, schema, body=None, **kwargs):
        peer_id = path.split("/")[3]
        self.calls.append((path.rsplit("/", 1)[-1], json.loads(body.dumps())))
        if self.fail is not None:
            raise self.fail
        if path == ROUTES["shard_lease"].format(peer_id=peer_id):
            return ShardLease.from_json(self.pool.lease(peer_id, body.source, body.request_id).to_json())
        assert path == ROUTES["shard_report"].format(peer_id=peer_id) and isinstance(body, ShardReport)
        return ShardReportAck.from_json(self.pool.report(peer_id, body.updates, body.request_id).to_json())


def test_progress_is_batched_by_time_and_releases_go_at_once():
    pool, now = pool_of(3), [0.0]
    client = PoolClient(pool)
    source = RelayShardSource(client, "p", "a", report_interval_s=5.0, clock=lambda: now[0])
    shard = source.next_shard()
    for _ in range(10):  # t = 0 .. 9 s: one report is due at t = 5 s
        source.report(shard, 100)
        now[0] += 1.0
    reports = [body["updates"] for call, body in client.calls if call == "report"]
    assert [[u["samples"] for u in updates] for updates in reports] == [[600]]
    source.release(shard, finished=True)
    last = client.calls[-1][1]["updates"]
    assert last == [{"source": "a", "shard": shard, "samples": 400, "release": True, "finished": True, "rows": 1000}]
    (c,) = [c for c in pool.coverage().shards if c.shard == shard]
    assert (c.samples, c.passes, c.rows, c.holders) == (1000, 1, 1000, 0)


def test_an_unreachable_relay_keeps_updates_and_a_refusal_drops_them(caplog):
    pool = pool_of(2)
    client = PoolClient(pool)
    source = RelayShardSource(client, "p", "a", report_interval_s=0.0)
    shard = source.next_shard()
    client.fail = RelayUnreachable("relay_unreachable", "down")
    source.report(shard, 7)
    source.release(shard, finished=False)
    assert len(source._queue) == 2 and "retrying later" in caplog.text  # progress + release, in order
    client.fail = None
    assert source.flush() and source._queue == []
    (c,) = [c for c in pool.coverage().shards if c.shard == shard]
    assert (c.samples, c.holders) == (7, 0)
    other = source.next_shard()
    client.fail = RelayRejected("bad_schema", "no", status=400)
    source.report(other, 3)
    assert source._queue == [] and "refused" in caplog.text  # a 4xx will not get better by resending


def test_a_real_stream_leases_reports_and_releases_every_row(tmp_path):
    """stream_texts -> RelayShardSource -> pool: two peers on one pool; every consumed row is
    counted on its shard, closing returns every lease, and the peers read different shards."""
    for i in range(6):
        (tmp_path / f"s{i}.jsonl").write_text("".join(json.dumps({"text": f"s{i} r{j}"}) + "\n" for j in range(40)))
    dataset = {
        "kind": "stream",
        "shuffle_buffer": 8,
        "report_every": 5,
        "cache_dir": str(tmp_path / "cache"),
        "sources": [{"name": "a", "data_files": [str(tmp_path / "s*.jsonl")]}],
    }
    pool = ShardPool.from_dataset(dataset)
    config = StreamConfig.from_dict(dataset)
    streams, consumed = {}, Counter()
    for peer in ("p", "q"):
        client = PoolClient(pool)
        streams[peer] = stream_texts(config, seed=peer, shard_source=shard_sources_for_run(dataset, client, peer))
    rng = random.Random(0)
    for _ in range(150):  # interleaved, as two peers streaming at once
        peer = rng.choice("pq")
        text = next(streams[peer])
        consumed[(peer, text.split()[0])] += 1
        assert not ({k[1] for k in pool.held_by("p")} & {k[1] for k in pool.held_by("q")})
    for s in streams.values():
        s.close()
    coverage = {Path(c.shard).stem: c for c in pool.coverage().shards}
    assert all(c.holders == 0 for c in coverage.values())
    for shard in coverage:
        assert coverage[shard].samples == consumed[("p", shard)] + consumed[("q", shard)]
    assert sum(c.samples for c in coverage.values()) == 150
