"""Streaming training data: shards -> rows -> shuffle buffer -> mix -> tokens -> packed batches.

DeDLOC section 3.3 / Appendix I.4, with one change of seam (DESIGN.md s8):

* **Shards are files** (Parquet, JSON lines, text; optionally compressed), read one at a time
  with ``datasets.load_dataset(<format>, data_files=[shard], streaming=True)``: the same code path
  for a local path and a Hub file (``hf://datasets/org/name/file.parquet``), row group by row
  group / line by line, so a peer trains on its first rows while the rest are still unread.
* **Which shard next** comes from a :class:`ShardSource`. The default, :class:`LocalShardOrder`,
  is the paper's: every peer walks all shards in its own random order, epoch after epoch. The
  relay's shard-lease service will implement the same Protocol, so peers rarely duplicate work
  and a departed peer's shard returns to the pool; the stream reports, per shard, how many rows
  reached training and releases each shard when done.
* A **shuffle buffer** of S rows (paper: S = 10,000) per dataset, fed by the chained shards, so it
  mixes across shard boundaries.
* **Mixing** several datasets by probability (sahajBERT: 0.23 Wikipedia / 0.77 OSCAR).
* **Tokenization** on the fly by a user callable ``text -> list[int]``, then **packing** into
  ``[batch, seq_len + 1]`` LongTensor batches (inputs and shifted targets of a causal LM).

Why our own buffer and sampler rather than ``IterableDataset.shuffle`` / ``interleave_datasets``:
an ``IterableDataset`` fixes its shard list when it is built (``data_files``), and ``shuffle``
permutes that fixed list, which a lease pool that changes every minute cannot be; wrapping a lease
loop in ``IterableDataset.from_generator`` deep-copies its arguments (a relay client with a lock
cannot be copied) and adds per-row layers. Each row must also carry its shard through the buffer,
so that "rows done" counts rows that reached training rather than rows merely read. Both pieces
are the textbook algorithms in a dozen lines each and are tested here.

``datasets`` reads ``HF_DATASETS_OFFLINE`` once, when it is first imported: set it before
anything imports ``datasets``. This module imports ``datasets`` lazily and warns when the
variable and the library disagree; in offline mode remote shards are refused up front.
"""

from __future__ import annotations

import bisect
import glob
import itertools
import logging
import os
import random
import zlib
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from toolkit.errors import DataConfigError, DataSourceError

log = logging.getLogger(__name__)

T = TypeVar("T")
Tokenizer = Callable[[str], Sequence[int]]

DEFAULT_SHUFFLE_BUFFER = 10_000
"""The paper's S (Appendix I.4)."""
BYTE_EOS = 0xFF
"""Ends each document for the byte-level LM: the byte 0xFF never occurs inside UTF-8 text."""
_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".ndjson": "json", ".txt": "text",
            ".text": "text"}
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_TRUE = {"1", "ON", "YES", "TRUE"}
_MAX_EMPTY_SHARDS = 100






# --- the seam for shard leases --------------------------------------------------------------
@runtime_checkable
class ShardSource(Protocol):
    """Where a data stream gets its shards (one shard = one data file).

    A stream calls, for each shard: ``next_shard()`` once, ``report`` zero or more times as rows
    of it reach training, then ``release`` exactly once. Several shards may be held at once (the
    shuffle buffer still holds rows of earlier shards). Implementations: :class:`LocalShardOrder`
    (no coordination) and, later, the relay's lease client (``report`` doubles as the lease's
    keep-alive; a lease whose peer stops heartbeating expires on the relay).
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


# --- configuration --------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class DatasetSpec:
    """One dataset of the mix."""

    name: str
    """Names the dataset in logs and in the relay's lease pool."""
    data_files: tuple[str, ...]
    """Shards: local paths or globs, or ``hf://datasets/...`` URLs; relative to ``repo`` if set."""
    probability: float = 1.0
    """Mixing weight; weights are normalized over the datasets (sahajBERT: 0.23 / 0.77)."""
    format: str | None = None
    """"parquet", "json" or "text"; None = from each file's extension (".jsonl.gz" -> json)."""
    text_column: str = "text"
    """The column holding the text (the ``text`` format always calls it "text")."""
    repo: str | None = None
    """A Hub dataset repo "org/name": ``data_files`` are paths inside it."""
    revision: str | None = None
    """A branch, tag or commit of ``repo``; pin one so every peer reads the same files."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], index: int = 0) -> "DatasetSpec":
        files = data.get("data_files")
        if isinstance(files, str):
            files = [files]
        if not files:
            raise DataConfigError("no_shards", f"dataset #{index} lists no data_files",
                                  'Give each [[dataset.sources]] entry data_files = ["path/or/glob", ...].')
        known = {"name", "data_files", "probability", "format", "text_column", "repo", "revision"}
        unknown = set(data) - known
        if unknown:
            raise DataConfigError("bad_dataset", f"dataset #{index}: unknown keys {sorted(unknown)}",
                                  f"Allowed keys: {sorted(known)}.")
        spec = cls(name=str(data.get("name") or f"dataset{index}"), data_files=tuple(files),
                   probability=float(data.get("probability", 1.0)), format=data.get("format"),
                   text_column=str(data.get("text_column", "text")), repo=data.get("repo"),
                   revision=data.get("revision"))
        if spec.probability <= 0:
            raise DataConfigError("bad_dataset", f"dataset {spec.name!r}: probability must be > 0")
        if spec.format is not None and spec.format not in ("parquet", "json", "text"):
            raise DataConfigError("bad_dataset", f"dataset {spec.name!r}: unknown format {spec.format!r}",
                                  "Use parquet, json or text (or omit it to infer from extensions).")
        return spec

    def shards(self) -> list[str]:
        """The shard list: ``repo`` prefix applied, globs expanded (sorted, so peers agree)."""
        prefix = f"hf://datasets/{self.repo}{'@' + self.revision if self.revision else ''}/" if self.repo else ""
        out: list[str] = []
        for pattern in self.data_files:
            path = prefix + pattern
            if not any(c in pattern for c in "*?["):
                out.append(path)
            elif "://" in path:  # Hub globs list the repo (a network call; notebooks only)
                import fsspec

                fs, _, _ = fsspec.core.get_fs_token_paths(path)
                out += sorted(fs.unstrip_protocol(p) for p in fs.glob(path))
            else:
                out += sorted(glob.glob(os.path.expanduser(path)))
        if not out:
            raise DataConfigError("no_shards", f"dataset {self.name!r}: {list(self.data_files)} matched no files")
        return out


@dataclass(frozen=True, kw_only=True)
class StreamConfig:
    """A run's streamed data; ``from_dict`` reads the relay's ``[dataset]`` section (kind = "stream")."""

    datasets: tuple[DatasetSpec, ...]
    shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER
    """Rows per dataset in the shuffle buffer; 1 turns shuffling off."""
    report_every: int = 1000
    """Rows of a shard between two ``ShardSource.report`` calls (also reported on release)."""
    max_shard_failures: int = 3
    """Consecutive unreadable shards before the stream gives up (a broken one is skipped)."""
    cache_dir: str | None = None
    """``datasets``' cache directory (streaming writes only small lock files there)."""
    read_batch_rows: int = 256
    """Rows fetched from ``datasets`` per call: batching is ~5x cheaper per row than row by row."""

    def __post_init__(self) -> None:
        if not self.datasets:
            raise DataConfigError("no_datasets", "the stream has no datasets",
                                  "Add at least one [[dataset.sources]] entry.")
        if self.shuffle_buffer < 1 or self.report_every < 1 or self.max_shard_failures < 1:
            raise DataConfigError("bad_dataset", "shuffle_buffer, report_every and max_shard_failures must be >= 1")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StreamConfig":
        sources = data.get("sources") or []
        extra = {k: data[k] for k in ("shuffle_buffer", "report_every", "max_shard_failures", "cache_dir") if k in data}
        return cls(datasets=tuple(DatasetSpec.from_dict(s, i) for i, s in enumerate(sources)), **extra)

    @property
    def probabilities(self) -> list[float]:
        total = sum(d.probability for d in self.datasets)
        return [d.probability / total for d in self.datasets]


# --- reading shards -------------------------------------------------------------------------
def infer_format(shard: str) -> str:
    """"parquet", "json" or "text" from a file name, ignoring a compression suffix."""
    name = shard.lower().split("?")[0]
    for suffix in _COMPRESSION:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    fmt = _FORMATS.get(os.path.splitext(name)[1])
    if fmt is None:
        raise DataConfigError("bad_format", f"cannot tell the format of shard {shard!r}",
                              "Name shards *.parquet, *.jsonl or *.txt (optionally .gz), or set format = ...")
    return fmt


def _datasets_module() -> Any:
    """``datasets``, imported on first use (it is slow to import and reads its env vars then)."""
    import datasets

    return datasets


def check_offline_env() -> None:
    """Warn if HF_DATASETS_OFFLINE is set but ``datasets`` was imported before it was."""
    wanted = os.environ.get("HF_DATASETS_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "")).upper() in _TRUE
    if wanted and not _datasets_module().config.HF_HUB_OFFLINE:
        log.warning("HF_DATASETS_OFFLINE is set but `datasets` was imported before it was, so it is not "
                    "offline. Set the variable before anything imports datasets (restart the runtime).")


def _is_remote(shard: str) -> bool:
    return "://" in shard and not shard.startswith("file://")


def read_shard(shard: str, *, format: str | None = None, text_column: str = "text",
               cache_dir: str | None = None, batch_rows: int = 256) -> Iterator[str]:
    """The texts of one shard, streamed (nothing is downloaded ahead of need)."""
    datasets = _datasets_module()
    if datasets.config.HF_HUB_OFFLINE and _is_remote(shard):
        raise DataSourceError("offline", f"shard {shard!r} is remote but HF_DATASETS_OFFLINE is set",
                              "Unset HF_DATASETS_OFFLINE / HF_HUB_OFFLINE, or point data_files at local copies.")
    fmt = format or infer_format(shard)
    ds = datasets.load_dataset(fmt, data_files=[shard], split="train", streaming=True, cache_dir=cache_dir)
    for batch in ds.iter(batch_size=batch_rows):
        if text_column not in batch:
            raise DataConfigError("bad_column", f"shard {shard!r} has no column {text_column!r} "
                                  f"(columns: {sorted(batch)})", "Set text_column to the column that holds the text.")
        yield from batch[text_column]


@dataclass(eq=False)
class _Lease:
    """One shard held by a stream; rows carry it through the shuffle buffer."""

    shard: str
    read: int = 0
    consumed: int = 0
    unreported: int = 0
    reading_done: bool = False
    complete: bool = False  # read to its end without error


@dataclass(eq=False)
class _ShardStream:
    """The rows of one dataset, shard after shard from a :class:`ShardSource`, with bookkeeping."""

    spec: DatasetSpec
    source: ShardSource
    config: StreamConfig
    held: list[_Lease] = field(default_factory=list)

    def rows(self) -> Iterator[tuple[_Lease, str]]:
        failures = empty = 0
        while (shard := self.source.next_shard()) is not None:
            lease = _Lease(shard)
            self.held.append(lease)
            try:
                for text in read_shard(shard, format=self.spec.format, text_column=self.spec.text_column,
                                       cache_dir=self.config.cache_dir, batch_rows=self.config.read_batch_rows):
                    lease.read += 1
                    yield lease, text
                lease.complete, failures = True, 0
            except (DataConfigError, DataSourceError):
                raise
            except Exception as exc:  # unreadable/corrupt/missing file, network error: skip the shard
                failures += 1
                log.warning("dataset %r: shard %s failed after %d rows (%s: %s); skipping it",
                            self.spec.name, shard, lease.read, type(exc).__name__, exc)
                if failures >= self.config.max_shard_failures:
                    raise DataSourceError("shards_unreadable", f"dataset {self.spec.name!r}: {failures} shards in a "
                                          f"row failed, last {shard!r}: {exc}") from exc
            lease.reading_done = True
            self._maybe_release(lease)
            empty = 0 if lease.read else empty + 1
            if empty >= _MAX_EMPTY_SHARDS:  # e.g. every shard empty: never spin forever yielding nothing
                raise DataSourceError("no_rows", f"dataset {self.spec.name!r}: {empty} shards in a row had no rows",
                                      "Check that data_files point at the dataset's data, not at empty files.")
        log.info("dataset %r: no more shards", self.spec.name)

    def consumed(self, lease: _Lease) -> None:
        lease.consumed += 1
        lease.unreported += 1
        if lease.unreported >= self.config.report_every:
            self._flush(lease)
        self._maybe_release(lease)

    def _flush(self, lease: _Lease) -> None:
        if lease.unreported:
            self.source.report(lease.shard, lease.unreported)
            lease.unreported = 0

    def _maybe_release(self, lease: _Lease) -> None:
        if lease.reading_done and lease.consumed == lease.read:
            self._flush(lease)
            self.held.remove(lease)
            self.source.release(lease.shard, finished=lease.complete)

    def close(self) -> None:
        """Report what was trained on and hand back every shard still held (stream closed early)."""
        for lease in list(self.held):
            self._flush(lease)
            self.held.remove(lease)
            self.source.release(lease.shard, finished=False)


# --- the stream's stages ----------------------------------------------------------------------
def shuffle_buffer(items: Iterable[T], size: int, rng: random.Random) -> Iterator[T]:
    """The paper's buffer: hold the first ``size`` items; then for each new one, yield a randomly
    chosen held item and put the new one in its place; at the end, drain in random order.

    Item k of the output was at most ``k + size - 1`` items into the input; at most ``size``
    items are ever held.
    """
    if size <= 1:
        yield from items
        return
    buf: list[T] = []
    for item in items:
        if len(buf) < size:
            buf.append(item)
            continue
        i = rng.randrange(size)
        out, buf[i] = buf[i], item
        yield out
    rng.shuffle(buf)
    yield from buf


def mix(streams: Sequence[Iterator[T]], probabilities: Sequence[float], rng: random.Random) -> Iterator[T]:
    """Each item from stream i with probability p_i; ends when the chosen stream ends (like
    ``interleave_datasets``' "first_exhausted": continuing would skew the proportions)."""
    cumulative = list(itertools.accumulate(probabilities))
    total, last = cumulative[-1], len(streams) - 1
    while True:
        i = min(bisect.bisect_right(cumulative, rng.random() * total), last)
        try:
            yield next(streams[i])
        except StopIteration:
            return


def byte_tokenize(text: str) -> list[int]:
    """The demo model's tokenizer: UTF-8 bytes, then :data:`BYTE_EOS` to end the document."""
    tokens = list(text.encode("utf-8"))
    tokens.append(BYTE_EOS)
    return tokens


def pack(token_lists: Iterable[Sequence[int]], batch_size: int, seq_len: int) -> Iterator[torch.Tensor]:
    """Concatenate documents and cut ``[batch_size, seq_len + 1]`` LongTensor batches.

    Rows are disjoint windows of the token stream (a document may continue into the next row or
    batch; nothing is padded). A last partial batch is dropped when the stream ends.
    """
    need = batch_size * (seq_len + 1)
    buf: list[int] = []
    for tokens in token_lists:
        buf.extend(tokens)
        if len(buf) < need:
            continue
        start = 0
        while len(buf) - start >= need:
            yield torch.tensor(buf[start:start + need], dtype=torch.long).view(batch_size, seq_len + 1)
            start += need
        del buf[:start]


# --- putting it together --------------------------------------------------------------------
def stream_texts(config: StreamConfig, *, seed: int | str,
                 shard_source: Callable[[DatasetSpec], ShardSource] | None = None) -> Generator[str, None, None]:
    """The mixed, shuffled text stream of a peer (before tokenization).

    ``seed`` makes this peer's shard order, shuffle and mixing its own; give each peer a
    different one (its peer id works). ``shard_source(spec)`` supplies each dataset's shards
    (default: :class:`LocalShardOrder` over ``spec.shards()``). Closing the generator reports
    and releases every shard it still holds.
    """
    check_offline_env()
    if shard_source is None:
        def shard_source(spec: DatasetSpec) -> ShardSource:
            return LocalShardOrder(spec.shards(), seed=f"{seed}/{spec.name}")
    streams = [_ShardStream(spec, shard_source(spec), config) for spec in config.datasets]

    def shuffled(stream: _ShardStream) -> Generator[str, None, None]:
        rng = random.Random(f"{seed}/shuffle/{stream.spec.name}")
        for lease, text in shuffle_buffer(stream.rows(), config.shuffle_buffer, rng):
            stream.consumed(lease)
            yield text

    iterators = [shuffled(s) for s in streams]
    try:
        if len(iterators) == 1:
            yield from iterators[0]
        else:
            yield from mix(iterators, config.probabilities, random.Random(f"{seed}/mix"))
    finally:
        for it in iterators:
            it.close()
        for stream in streams:
            stream.close()


def stream_batches(config: StreamConfig, *, batch_size: int, seq_len: int, seed: int | str,
                   tokenize: Tokenizer = byte_tokenize,
                   shard_source: Callable[[DatasetSpec], ShardSource] | None = None
                   ) -> Generator[torch.Tensor, None, None]:
    """Endless ``[batch_size, seq_len + 1]`` LongTensor batches: :func:`stream_texts`, tokenized
    lazily (one document at a time, only as the packer needs it), then :func:`pack`\\ ed."""
    texts = stream_texts(config, seed=seed, shard_source=shard_source)
    try:
        yield from pack(map(tokenize, texts), batch_size, seq_len)
    finally:
        texts.close()


def batches_for_run(dataset: Mapping[str, Any], *, batch_size: int, seq_len: int, seed: int | str,
                    tokenize: Tokenizer = byte_tokenize,
                    shard_source: Callable[[DatasetSpec], ShardSource] | None = None) -> Iterator[torch.Tensor]:
    """Batches for a run's ``[dataset]`` section (``RunInfo.dataset``).

    ``kind = "demo_corpus"`` (or no section) keeps the shipped demo text of
    :mod:`toolkit.corpus`; ``kind = "stream"`` streams shards as described in this module.
    """
    kind = dataset.get("kind", "demo_corpus") or "demo_corpus"
    if kind == "demo_corpus":
        from toolkit.corpus import demo_batches

        return demo_batches(batch_size, seq_len, seed if isinstance(seed, int) else zlib.crc32(str(seed).encode()))
    if kind == "stream":
        return stream_batches(StreamConfig.from_dict(dataset), batch_size=batch_size, seq_len=seq_len, seed=seed,
                              tokenize=tokenize, shard_source=shard_source)
    raise DataConfigError("bad_dataset", f"unknown dataset kind {kind!r}", 'Use kind = "demo_corpus" or "stream".')
