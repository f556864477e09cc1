"""The run's ``[dataset]`` section, typed: which datasets, which shards, how they are mixed.

Read by peers (to stream) and by the relay (to build its shard-lease pool from the same shard
lists), so both sides resolve ``data_files`` with the same code: globs expand sorted, a Hub repo
becomes an ``hf://datasets/...`` prefix.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from toolkit.errors import DataConfigError

DEFAULT_SHUFFLE_BUFFER = 10_000
"""The paper's S (Appendix I.4)."""


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
    label_column: str | None = None
    """Rows become ``(text, label)`` (set from ``[objective] label_column`` for classification)."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], index: int = 0) -> "DatasetSpec":
        files = data.get("data_files")
        if isinstance(files, str):
            files = [files]
        if not files:
            raise DataConfigError(
                "no_shards",
                f"dataset #{index} lists no data_files",
                'Give each [[dataset.sources]] entry data_files = ["path/or/glob", ...].',
            )
        known = {"name", "data_files", "probability", "format", "text_column", "repo", "revision"}
        unknown = set(data) - known
        if unknown:
            raise DataConfigError(
                "bad_dataset", f"dataset #{index}: unknown keys {sorted(unknown)}", f"Allowed keys: {sorted(known)}."
            )
        spec = cls(
            name=str(data.get("name") or f"dataset{index}"),
            data_files=tuple(files),
            probability=float(data.get("probability", 1.0)),
            format=data.get("format"),
            text_column=str(data.get("text_column", "text")),
            repo=data.get("repo"),
            revision=data.get("revision"),
        )
        if spec.probability <= 0:
            raise DataConfigError("bad_dataset", f"dataset {spec.name!r}: probability must be > 0")
        if spec.format is not None and spec.format not in ("parquet", "json", "text"):
            raise DataConfigError(
                "bad_dataset",
                f"dataset {spec.name!r}: unknown format {spec.format!r}",
                "Use parquet, json or text (or omit it to infer from extensions).",
            )
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
    leases: bool = True
    """Peers that joined a relay ask it for shards (its lease pool: least-processed first, a
    departed peer's shard goes back) instead of walking every shard in their own order. Only
    consulted by :func:`toolkit.data.shard_sources_for_run`; ``leases = false`` in ``[dataset]``
    restores the paper's per-peer order."""

    def __post_init__(self) -> None:
        if not self.datasets:
            raise DataConfigError(
                "no_datasets", "the stream has no datasets", "Add at least one [[dataset.sources]] entry."
            )
        if self.shuffle_buffer < 1 or self.report_every < 1 or self.max_shard_failures < 1:
            raise DataConfigError("bad_dataset", "shuffle_buffer, report_every and max_shard_failures must be >= 1")
        names = [d.name for d in self.datasets]
        if len(set(names)) != len(names):  # the lease pool and the shuffle seeds key off the name
            raise DataConfigError(
                "bad_dataset",
                f"dataset names must be unique, got {names}",
                "Give each [[dataset.sources]] entry its own name = ...",
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StreamConfig":
        sources = data.get("sources") or []
        keys = ("shuffle_buffer", "report_every", "max_shard_failures", "cache_dir", "leases")
        extra = {k: data[k] for k in keys if k in data}
        if "leases" in extra and not isinstance(extra["leases"], bool):
            raise DataConfigError("bad_dataset", f"dataset.leases must be true or false, got {extra['leases']!r}")
        return cls(datasets=tuple(DatasetSpec.from_dict(s, i) for i, s in enumerate(sources)), **extra)

    @property
    def probabilities(self) -> list[float]:
        total = sum(d.probability for d in self.datasets)
        return [d.probability / total for d in self.datasets]
