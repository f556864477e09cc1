"""Streaming data: small Parquet / JSON lines / text shards generated in tmp_path, read offline,
with every socket connection refused and recorded (none may happen)."""

from __future__ import annotations

import gzip
import json
import logging
import os
import random
import socket
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from toolkit.data import (
    BYTE_EOS,
    DataConfigError,
    DatasetSpec,
    DataSourceError,
    LocalShardOrder,
    ShardSource,
    StreamConfig,
    batches_for_run,
    byte_tokenize,
    pack,
    read_shard,
    shuffle_buffer,
    stream_batches,
    stream_texts,
)
from toolkit.data import reading as data  # infer_format, check_offline_env, _MAX_EMPTY_SHARDS

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch):
    """HF offline mode, scoped to the test, and no network at all.

    ``datasets`` reads HF_DATASETS_OFFLINE when it is imported (``datasets.config.HF_HUB_OFFLINE``),
    so an in-process test sets both the variable and the value it was read into;
    ``test_offline_mode_in_a_fresh_process`` checks the real import-time behaviour.
    """
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    attempts: list[object] = []

    def refuse(self, address, *args):
        if self.family == socket.AF_UNIX:
            return real_connect(self, address, *args)
        attempts.append(address)
        raise OSError(f"network access in a test: {address}")

    real_connect = socket.socket.connect
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    yield
    assert attempts == [], f"tests must not touch the network: {attempts}"


def _rows(tag: str, n: int) -> list[str]:
    return [f"{tag} row {i:05d}" for i in range(n)]


def write_shard(path: Path, texts: list[str], column: str = "text") -> str:
    """One shard file; the format follows the suffix (.parquet / .jsonl[.gz] / .txt[.gz])."""
    name = path.name
    if name.endswith(".parquet"):
        pq.write_table(pa.table({column: texts, "n": list(range(len(texts)))}), path, row_group_size=64)
    elif ".jsonl" in name:
        _write(path, "".join(json.dumps({column: t, "n": i}) + "\n" for i, t in enumerate(texts)))
    else:
        _write(path, "".join(t + "\n" for t in texts))
    return str(path)


def _write(path: Path, content: str) -> None:
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(content)
    else:
        path.write_text(content, encoding="utf-8")


@pytest.fixture
def cache(tmp_path: Path) -> str:
    return str(tmp_path / "hf-cache")


def make_dataset(tmp_path: Path, tag: str, sizes: list[int], suffix: str = ".parquet") -> list[str]:
    folder = tmp_path / tag
    folder.mkdir(exist_ok=True)
    return [write_shard(folder / f"{tag}-{i:02d}{suffix}", _rows(f"{tag}{i}", n)) for i, n in enumerate(sizes)]


def one_epoch(seed: int | str = 0):
    return lambda spec: LocalShardOrder(spec.shards(), seed=seed, epochs=1)


# --- formats -----------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".jsonl.gz", ".txt", ".txt.gz"])
def test_each_format_streams_its_rows_in_order(tmp_path, cache, suffix):
    shard = write_shard(tmp_path / f"shard{suffix}", _rows("x", 150))
    assert list(read_shard(shard, cache_dir=cache, batch_rows=32)) == _rows("x", 150)


def test_a_whole_dataset_of_mixed_formats_streams_once_per_epoch(tmp_path, cache):
    shards = [
        write_shard(tmp_path / f"s{i}{suffix}", _rows(f"s{i}", 40))
        for i, suffix in enumerate([".parquet", ".jsonl", ".txt.gz"])
    ]
    config = StreamConfig(
        datasets=(DatasetSpec(name="d", data_files=(str(tmp_path / "s*"),)),), shuffle_buffer=16, cache_dir=cache
    )
    assert DatasetSpec(name="d", data_files=(str(tmp_path / "s*"),)).shards() == shards  # sorted glob
    got = list(stream_texts(config, seed=0, shard_source=one_epoch()))
    assert sorted(got) == sorted(_rows("s0", 40) + _rows("s1", 40) + _rows("s2", 40))


def test_format_is_inferred_and_unknown_ones_are_config_errors():
    assert [data.infer_format(p) for p in ("a.parquet", "b.jsonl.gz", "c.JSON", "d.txt.zst", "hf://x/y.txt")] == [
        "parquet",
        "json",
        "json",
        "text",
        "text",
    ]
    with pytest.raises(DataConfigError, match="cannot tell the format"):
        data.infer_format("shard.csv")


# --- shard order --------------------------------------------------------------------------------
def test_per_peer_shard_orders_differ_and_are_deterministic():
    shards = [f"shard-{i:02d}.parquet" for i in range(12)]

    def walk(seed, n=36):
        order = LocalShardOrder(shards, seed=seed)
        return [order.next_shard() for _ in range(n)]

    a, b = walk("peer-a"), walk("peer-b")
    assert a == walk("peer-a")  # deterministic by seed
    assert a[:12] != b[:12]  # peers walk differently
    for epoch in range(3):  # every epoch is a permutation of all shards, reshuffled
        assert sorted(a[12 * epoch : 12 * epoch + 12]) == shards
    assert a[:12] != a[12:24]
    finite = LocalShardOrder(shards[:2], seed=1, epochs=2)
    assert [finite.next_shard() for _ in range(5)][4] is None


def test_local_shard_order_satisfies_the_protocol():
    assert isinstance(LocalShardOrder(["a.txt"], seed=0), ShardSource)


# --- shuffle buffer -------------------------------------------------------------------------------
def test_shuffle_buffer_shuffles_and_respects_its_size():
    size, n = 100, 5000
    read = []

    def source():
        for i in range(n):
            read.append(i)
            yield i

    out = []
    for item in shuffle_buffer(source(), size, random.Random(0)):
        assert len(read) - len(out) <= size + 1  # never more than `size` held (plus the one in hand)
        out.append(item)
    assert sorted(out) == list(range(n))  # a permutation: nothing lost or duplicated
    assert out != list(range(n))
    lead = [item - k for k, item in enumerate(out[: n - size])]
    assert max(lead) <= size - 1  # item k was read at most size-1 items ahead
    # Each held item is picked uniformly, so an item waits Geometric(1/size) reads in the buffer:
    # mean wait = size. (A FIFO, or always picking one slot, gives a very different mean.)
    position = {item: k for k, item in enumerate(out)}
    waits = [position[i] + size - i for i in range(size, n - 10 * size)]
    assert 0.9 * size < sum(waits) / len(waits) < 1.1 * size
    assert list(shuffle_buffer(range(10), 1, random.Random(0))) == list(range(10))  # size 1 = off
    assert list(shuffle_buffer(range(10), 100, random.Random(0))) != list(range(10))  # short stream: drained shuffled


def test_the_shuffle_buffer_mixes_across_shard_boundaries(tmp_path, cache):
    shards = make_dataset(tmp_path, "b", [60, 60, 60], ".txt")
    config = StreamConfig(
        datasets=(DatasetSpec(name="b", data_files=tuple(shards)),), shuffle_buffer=50, cache_dir=cache
    )
    order = LocalShardOrder(shards, seed=3, epochs=1).epoch_order(0)
    got = list(stream_texts(config, seed=3, shard_source=one_epoch(3)))
    assert sorted(got) == sorted(sum((_rows(f"b{i}", 60) for i in range(3)), []))
    shard_of = [order.index(shards[int(t[1])]) for t in got]  # position of each row's shard in the walk
    assert shard_of != sorted(shard_of)  # rows of a later shard come out before rows of an earlier one
    first, second = shard_of.index(1), max(i for i, s in enumerate(shard_of) if s == 0)
    assert first < second


# --- mixing -------------------------------------------------------------------------------------
def test_mixing_proportions_over_20000_samples(tmp_path, cache):
    wiki = make_dataset(tmp_path, "wiki", [700, 700], ".parquet")
    oscar = make_dataset(tmp_path, "oscar", [1500, 1500], ".txt")
    config = StreamConfig(
        datasets=(
            DatasetSpec(name="wikipedia", data_files=tuple(wiki), probability=0.23),
            DatasetSpec(name="oscar", data_files=tuple(oscar), probability=0.77),
        ),
        shuffle_buffer=200,
        cache_dir=cache,
    )
    stream = stream_texts(config, seed="peer-1")
    got = [next(stream) for _ in range(20_000)]
    stream.close()
    share = sum(t.startswith("wiki") for t in got) / len(got)
    assert abs(share - 0.23) < 0.02, share
    again = stream_texts(config, seed="peer-1")
    assert [next(again) for _ in range(500)] == got[:500]  # deterministic by seed
    again.close()
    other = stream_texts(config, seed="peer-2")
    assert [next(other) for _ in range(500)] != got[:500]
    other.close()


def test_mixing_ends_when_a_dataset_runs_out(tmp_path, cache):
    small, large = make_dataset(tmp_path, "s", [20], ".txt"), make_dataset(tmp_path, "l", [500], ".txt")
    config = StreamConfig(
        datasets=(
            DatasetSpec(name="s", data_files=tuple(small), probability=0.5),
            DatasetSpec(name="l", data_files=tuple(large), probability=0.5),
        ),
        shuffle_buffer=1,
        cache_dir=cache,
    )
    got = list(stream_texts(config, seed=0, shard_source=one_epoch()))
    assert sum(t.startswith("s") for t in got) == 20 and len(got) < 100


# --- tokenization and packing ---------------------------------------------------------------------
def test_tokenization_is_lazy(tmp_path, cache):
    shards = make_dataset(tmp_path, "t", [500, 500], ".parquet")
    config = StreamConfig(
        datasets=(DatasetSpec(name="t", data_files=tuple(shards)),), shuffle_buffer=300, cache_dir=cache
    )
    calls = []

    def tokenize(text: str) -> list[int]:
        calls.append(text)
        return byte_tokenize(text)

    batches = stream_batches(config, batch_size=2, seq_len=31, seed=0, tokenize=tokenize)
    assert calls == []  # nothing happens until the first batch is asked for
    batch = next(batches)
    doc_len = len(byte_tokenize(_rows("t0", 1)[0]))  # 15 tokens per row
    assert batch.shape == (2, 32) and batch.dtype == torch.long
    assert len(calls) == -(-64 // doc_len)  # exactly the documents this batch needed, not the buffer's 300
    next(batches)
    assert len(calls) == -(-128 // doc_len)
    batches.close()


def test_pack_cuts_disjoint_windows_of_the_token_stream():
    docs = [list(range(0, 7)), list(range(7, 20)), list(range(20, 33))]
    batches = list(pack(docs, batch_size=2, seq_len=4))
    assert len(batches) == 3  # 33 tokens -> 3 batches of 10, the last 3 tokens dropped
    assert torch.equal(torch.cat([b.reshape(-1) for b in batches]), torch.arange(30))
    assert batches[0].tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    long_doc = list(range(1000))  # one document spanning many batches
    assert torch.equal(torch.cat([b.reshape(-1) for b in pack([long_doc], 4, 9)]), torch.arange(1000))


def test_byte_tokenize():
    assert byte_tokenize("hé") == [104, 0xC3, 0xA9, BYTE_EOS]
    assert BYTE_EOS not in byte_tokenize("any ünïcode text ✓ \x00\x7f")[:-1]


# --- shard bookkeeping (the lease seam) ------------------------------------------------------------
class RecordingSource(LocalShardOrder):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events: list[tuple] = []

    def report(self, shard, samples):
        self.events.append(("report", Path(shard).name, samples))
        super().report(shard, samples)

    def release(self, shard, *, finished):
        self.events.append(("release", Path(shard).name, finished))
        super().release(shard, finished=finished)


def test_report_counts_the_rows_of_each_shard_that_reached_training(tmp_path, cache):
    sizes = [30, 50, 70]
    shards = make_dataset(tmp_path, "r", sizes, ".jsonl")
    config = StreamConfig(
        datasets=(DatasetSpec(name="r", data_files=tuple(shards)),), shuffle_buffer=40, report_every=7, cache_dir=cache
    )
    sources: list[RecordingSource] = []

    def factory(spec):
        sources.append(RecordingSource(spec.shards(), seed=5, epochs=1))
        return sources[0]

    assert len(list(stream_texts(config, seed=5, shard_source=factory))) == sum(sizes)
    source = sources[0]
    assert source.samples == Counter({s: n for s, n in zip(shards, sizes)})
    assert source.finished == Counter(shards) and not source.held
    assert all(0 < e[2] <= 7 for e in source.events if e[0] == "report")
    releases = [e for e in source.events if e[0] == "release"]
    assert sorted(r[1] for r in releases) == sorted(Path(s).name for s in shards) and all(r[2] for r in releases)


def test_closing_the_stream_reports_what_was_trained_and_releases_unfinished_shards(tmp_path, cache):
    shards = make_dataset(tmp_path, "c", [100, 100], ".parquet")
    config = StreamConfig(
        datasets=(DatasetSpec(name="c", data_files=tuple(shards)),),
        shuffle_buffer=30,
        report_every=1000,
        cache_dir=cache,
    )
    source = RecordingSource(shards, seed=0, epochs=1)
    stream = stream_texts(config, seed=0, shard_source=lambda spec: source)
    taken = [next(stream) for _ in range(25)]
    assert source.samples == Counter()  # below report_every: nothing reported yet
    stream.close()
    assert sum(source.samples.values()) == 25  # rows still in the buffer were not trained on
    assert Counter(shards[int(t[1])] for t in taken) == source.samples
    assert not source.held and not source.finished
    first = Path(source.epoch_order(0)[0]).name  # 30 + 25 rows read: still inside the first shard
    assert [e for e in source.events if e[0] == "release"] == [("release", first, False)]


def test_an_unreadable_shard_is_skipped_and_returned_unfinished(tmp_path, cache, caplog):
    good = make_dataset(tmp_path, "g", [20, 20], ".parquet")
    bad = tmp_path / "g" / "g-99.parquet"
    bad.write_bytes(b"this is not parquet" * 10)
    source = RecordingSource([*good, str(bad)], seed=0, epochs=1)
    config = StreamConfig(datasets=(DatasetSpec(name="g", data_files=("unused",)),), shuffle_buffer=1, cache_dir=cache)
    with caplog.at_level(logging.WARNING, logger="toolkit.data"):
        got = list(stream_texts(config, seed=0, shard_source=lambda spec: source))
    assert sorted(got) == sorted(_rows("g0", 20) + _rows("g1", 20))
    assert ("release", "g-99.parquet", False) in source.events and "g-99.parquet failed" in caplog.text


def test_consecutive_unreadable_shards_stop_the_stream(tmp_path, cache):
    bad = []
    for i in range(3):
        (tmp_path / f"bad{i}.parquet").write_bytes(b"nope")
        bad.append(str(tmp_path / f"bad{i}.parquet"))
    config = StreamConfig(
        datasets=(DatasetSpec(name="b", data_files=tuple(bad)),), cache_dir=cache, max_shard_failures=3
    )
    with pytest.raises(DataSourceError, match="3 shards in a row failed"):
        list(stream_texts(config, seed=0))


def test_a_dataset_of_empty_shards_fails_instead_of_spinning(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(data, "_MAX_EMPTY_SHARDS", 5)
    empty = write_shard(tmp_path / "empty.txt", [])
    config = StreamConfig(datasets=(DatasetSpec(name="e", data_files=(empty,)),), cache_dir=cache)
    source = LocalShardOrder([empty], seed=0)  # cycles forever
    with pytest.raises(DataSourceError, match="5 shards in a row had no rows"):
        next(stream_texts(config, seed=0, shard_source=lambda spec: source))
    assert source.finished[empty] == 5 and not source.held


def test_a_missing_text_column_is_a_config_error_naming_the_columns(tmp_path, cache):
    shard = write_shard(tmp_path / "x.parquet", _rows("x", 5), column="content")
    with pytest.raises(DataConfigError, match=r"no column 'text' \(columns: \['content', 'n'\]\)") as err:
        list(read_shard(shard, cache_dir=cache))
    assert "text_column" in err.value.hint


# --- offline ---------------------------------------------------------------------------------------
def test_remote_shards_are_refused_up_front_when_offline(cache):
    with pytest.raises(DataSourceError, match="remote but HF_DATASETS_OFFLINE") as err:
        next(read_shard("hf://datasets/org/wiki/train-00000.parquet", cache_dir=cache))
    assert "Unset HF_DATASETS_OFFLINE" in err.value.hint


@pytest.mark.integration
@pytest.mark.slow  # a fresh interpreter imports torch and datasets: ~5 s alone, much more on a busy machine
def test_offline_mode_in_a_fresh_process(tmp_path):
    """The notebook situation: the variable is set before ``datasets`` is first imported."""
    shard = write_shard(tmp_path / "s.parquet", _rows("s", 20))
    script = textwrap.dedent(f"""
        import socket
        def refuse(self, *a):
            raise SystemExit("network access attempted: %r" % (a,))
        socket.socket.connect = refuse
        import datasets
        from toolkit.data import DatasetSpec, LocalShardOrder, StreamConfig, stream_texts
        assert datasets.config.HF_HUB_OFFLINE is True
        config = StreamConfig(datasets=(DatasetSpec(name="s", data_files=({shard!r},)),), shuffle_buffer=4,
                              cache_dir={str(tmp_path / "cache")!r})
        rows = list(stream_texts(config, seed=0, shard_source=lambda spec: LocalShardOrder(spec.shards(), 0, epochs=1)))
        assert sorted(rows) == [f"s row {{i:05d}}" for i in range(20)], rows
        print("ok")
    """)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"), "PYTHONPATH": str(REPO)}
    env.pop("HF_HUB_OFFLINE", None)  # HF_DATASETS_OFFLINE alone must be enough for datasets
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_late_offline_mode_is_warned_about(monkeypatch, caplog):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # as if imported before the variable was set
    with caplog.at_level(logging.WARNING, logger="toolkit.data"):
        data.check_offline_env()
    assert "imported before it was" in caplog.text


# --- configuration ---------------------------------------------------------------------------------
def test_stream_config_from_the_relay_dataset_section(tmp_path, cache):
    make_dataset(tmp_path, "w", [40], ".parquet")
    make_dataset(tmp_path, "o", [40], ".txt")
    section = {
        "kind": "stream",
        "shuffle_buffer": 8,
        "cache_dir": cache,
        "sources": [
            {"name": "wikipedia", "data_files": str(tmp_path / "w" / "*.parquet"), "probability": 2},
            {"name": "oscar", "data_files": [str(tmp_path / "o" / "*.txt")], "probability": 6.7},
        ],
    }
    config = StreamConfig.from_dict(section)
    assert config.shuffle_buffer == 8 and [d.name for d in config.datasets] == ["wikipedia", "oscar"]
    assert config.probabilities == pytest.approx([2 / 8.7, 6.7 / 8.7])
    batches = batches_for_run(section, batch_size=4, seq_len=16, seed="peer")
    assert next(batches).shape == (4, 17)
    batches.close()
    hub = DatasetSpec.from_dict({"repo": "org/oscar-bn", "revision": "v1", "data_files": ["train/00.txt.gz"]})
    assert hub.shards() == ["hf://datasets/org/oscar-bn@v1/train/00.txt.gz"]  # no glob: no network


@pytest.mark.parametrize(
    "section,match",
    [
        ({"kind": "stream", "sources": []}, "no datasets"),
        ({"kind": "stream", "sources": [{"name": "a"}]}, "lists no data_files"),
        ({"kind": "stream", "sources": [{"data_files": ["a.txt"], "probabilty": 1}]}, "unknown keys"),
        ({"kind": "stream", "sources": [{"data_files": ["a.txt"], "probability": 0}]}, "probability must be > 0"),
        ({"kind": "stream", "sources": [{"data_files": ["a.txt"], "format": "csv"}]}, "unknown format"),
        ({"kind": "stream", "shuffle_buffer": 0, "sources": [{"data_files": ["a.txt"]}]}, "must be >= 1"),
        ({"kind": "mystery"}, "unknown dataset kind"),
    ],
)
def test_bad_dataset_sections_are_config_errors(section, match):
    with pytest.raises(DataConfigError, match=match):
        batches_for_run(section, batch_size=2, seq_len=8, seed=0)


def test_a_glob_that_matches_nothing_is_a_config_error(tmp_path):
    with pytest.raises(DataConfigError, match="matched no files"):
        DatasetSpec(name="x", data_files=(str(tmp_path / "*.parquet"),)).shards()


def test_the_demo_corpus_keeps_working():
    for section in ({}, {"kind": "demo_corpus"}):
        batch = next(iter(batches_for_run(section, batch_size=3, seq_len=64, seed=7)))
        assert batch.shape == (3, 65) and batch.dtype == torch.long and int(batch.max()) < 256
