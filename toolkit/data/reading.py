"""Shards -> rows: open one shard file with ``datasets`` streaming, and keep each shard's books.

A shard is read with ``datasets.load_dataset(<format>, data_files=[shard], streaming=True)``:
the same code path for a local path and a Hub file (``hf://datasets/org/name/file.parquet``),
row group by row group / line by line, so a peer trains on its first rows while the rest are
still unread.

The bookkeeping (:class:`_ShardStream`) is what makes shard leases honest: every row carries its
shard through the shuffle buffer, ``report`` counts rows that *reached training* (not rows
merely read), and a shard is released only once its last row left the buffer.

``datasets`` reads ``HF_DATASETS_OFFLINE`` once, when it is first imported: set it before
anything imports ``datasets``. This module imports ``datasets`` lazily and warns when the
variable and the library disagree; in offline mode remote shards are refused up front.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from toolkit.data.dataset_config import DatasetSpec, StreamConfig
from toolkit.data.shards import ShardSource
from toolkit.errors import DataConfigError, DataSourceError

log = logging.getLogger(__name__)

_FORMATS = {
    ".parquet": "parquet",
    ".jsonl": "json",
    ".json": "json",
    ".ndjson": "json",
    ".txt": "text",
    ".text": "text",
}
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_TRUE = {"1", "ON", "YES", "TRUE"}
_MAX_EMPTY_SHARDS = 100


def infer_format(shard: str) -> str:
    """ "parquet", "json" or "text" from a file name, ignoring a compression suffix."""
    name = shard.lower().split("?")[0]
    for suffix in _COMPRESSION:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    fmt = _FORMATS.get(os.path.splitext(name)[1])
    if fmt is None:
        raise DataConfigError(
            "bad_format",
            f"cannot tell the format of shard {shard!r}",
            "Name shards *.parquet, *.jsonl or *.txt (optionally .gz), or set format = ...",
        )
    return fmt


def _datasets_module() -> Any:
    """``datasets``, imported on first use (it is slow to import and reads its env vars then)."""
    import datasets

    return datasets


def check_offline_env() -> None:
    """Warn if HF_DATASETS_OFFLINE is set but ``datasets`` was imported before it was."""
    wanted = os.environ.get("HF_DATASETS_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "")).upper() in _TRUE
    if wanted and not _datasets_module().config.HF_HUB_OFFLINE:
        log.warning(
            "HF_DATASETS_OFFLINE is set but `datasets` was imported before it was, so it is not "
            "offline. Set the variable before anything imports datasets (restart the runtime)."
        )


def _is_remote(shard: str) -> bool:
    return "://" in shard and not shard.startswith("file://")


def read_shard(
    shard: str,
    *,
    format: str | None = None,
    text_column: str = "text",
    cache_dir: str | None = None,
    batch_rows: int = 256,
    label_column: str | None = None,
) -> Iterator[Any]:
    """The texts of one shard, streamed (nothing is downloaded ahead of need); ``(text, label)``
    rows when ``label_column`` is set."""
    datasets = _datasets_module()
    if datasets.config.HF_HUB_OFFLINE and _is_remote(shard):
        raise DataSourceError(
            "offline",
            f"shard {shard!r} is remote but HF_DATASETS_OFFLINE is set",
            "Unset HF_DATASETS_OFFLINE / HF_HUB_OFFLINE, or point data_files at local copies.",
        )
    fmt = format or infer_format(shard)
    ds = datasets.load_dataset(fmt, data_files=[shard], split="train", streaming=True, cache_dir=cache_dir)
    for batch in ds.iter(batch_size=batch_rows):
        for column in (text_column, label_column):
            if column is not None and column not in batch:
                raise DataConfigError(
                    "bad_column",
                    f"shard {shard!r} has no column {column!r} (columns: {sorted(batch)})",
                    "Set text_column (label_column) to the column that holds it.",
                )
        yield from zip(batch[text_column], batch[label_column]) if label_column else batch[text_column]


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
                for text in read_shard(
                    shard,
                    format=self.spec.format,
                    text_column=self.spec.text_column,
                    cache_dir=self.config.cache_dir,
                    batch_rows=self.config.read_batch_rows,
                    label_column=self.spec.label_column,
                ):
                    lease.read += 1
                    yield lease, text
                lease.complete, failures = True, 0
            except (DataConfigError, DataSourceError):
                raise
            except Exception as exc:  # unreadable/corrupt/missing file, network error: skip the shard
                failures += 1
                log.warning(
                    "dataset %r: shard %s failed after %d rows (%s: %s); skipping it",
                    self.spec.name,
                    shard,
                    lease.read,
                    type(exc).__name__,
                    exc,
                )
                if failures >= self.config.max_shard_failures:
                    raise DataSourceError(
                        "shards_unreadable",
                        f"dataset {self.spec.name!r}: {failures} shards in a row failed, last {shard!r}: {exc}",
                    ) from exc
            lease.reading_done = True
            self._maybe_release(lease)
            empty = 0 if lease.read else empty + 1
            if empty >= _MAX_EMPTY_SHARDS:  # e.g. every shard empty: never spin forever yielding nothing
                raise DataSourceError(
                    "no_rows",
                    f"dataset {self.spec.name!r}: {empty} shards in a row had no rows",
                    "Check that data_files point at the dataset's data, not at empty files.",
                )
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
