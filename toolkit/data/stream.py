"""Putting the operations together: a peer's mixed, shuffled, tokenized, packed stream."""

from __future__ import annotations

import dataclasses
import random
import zlib
from collections.abc import Callable, Generator, Iterator, Mapping
from typing import Any

import torch

from toolkit.data.dataset_config import DatasetSpec, StreamConfig
from toolkit.data.objectives import ObjectiveConfig, objective_batches
from toolkit.data.reading import _ShardStream, check_offline_env
from toolkit.data.shards import LocalShardOrder, ShardSource
from toolkit.data.stream_ops import Tokenizer, byte_tokenize, mix, pack, shuffle_buffer
from toolkit.errors import DataConfigError

ShardSourceFactory = Callable[[DatasetSpec], ShardSource]
"""Gives each dataset of the mix its :class:`ShardSource` (see :mod:`toolkit.data.shards`)."""


def stream_texts(
    config: StreamConfig, *, seed: int | str, shard_source: ShardSourceFactory | None = None
) -> Generator[str, None, None]:
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


def stream_batches(
    config: StreamConfig,
    *,
    batch_size: int,
    seq_len: int,
    seed: int | str,
    tokenize: Tokenizer = byte_tokenize,
    shard_source: ShardSourceFactory | None = None,
) -> Generator[torch.Tensor, None, None]:
    """Endless ``[batch_size, seq_len + 1]`` LongTensor batches: :func:`stream_texts`, tokenized
    lazily (one document at a time, only as the packer needs it), then :func:`pack`\\ ed."""
    texts = stream_texts(config, seed=seed, shard_source=shard_source)
    try:
        yield from pack(map(tokenize, texts), batch_size, seq_len)
    finally:
        texts.close()


def batches_for_run(
    dataset: Mapping[str, Any],
    *,
    batch_size: int,
    seq_len: int,
    seed: int | str,
    tokenize: Tokenizer = byte_tokenize,
    shard_source: ShardSourceFactory | None = None,
    objective: ObjectiveConfig | None = None,
    tokenizer: Any = None,
) -> Iterator[Any]:
    """Batches for a run's ``[dataset]`` section (``RunInfo.dataset``).

    ``kind = "demo_corpus"`` (or no section) keeps the shipped demo text of
    :mod:`toolkit.corpus`; ``kind = "stream"`` streams shards as described in :mod:`toolkit.data`.
    With an ``objective`` (and the run's ``tokenizer``, a ``tokenizers.Tokenizer``) the texts are
    tokenized, packed and collated into dict batches (:mod:`toolkit.data.objectives`; the
    objective's ``seq_len`` wins); without, LongTensor batches of ``tokenize``'s ids.
    """
    kind = dataset.get("kind", "demo_corpus") or "demo_corpus"
    if kind not in ("demo_corpus", "stream"):
        raise DataConfigError("bad_dataset", f"unknown dataset kind {kind!r}", 'Use kind = "demo_corpus" or "stream".')
    if objective is not None:
        if tokenizer is None:
            raise DataConfigError(
                "no_tokenizer",
                f"objective {objective.name!r} needs the run's tokenizer",
                "Give the run a [tokenizer] file (relay-server tokenizer train writes one).",
            )
        return _objective_stream(dataset, kind, objective, tokenizer, batch_size, seed, shard_source)
    if kind == "demo_corpus":
        from toolkit.corpus import demo_batches

        return demo_batches(batch_size, seq_len, seed if isinstance(seed, int) else zlib.crc32(str(seed).encode()))
    return stream_batches(
        StreamConfig.from_dict(dataset),
        batch_size=batch_size,
        seq_len=seq_len,
        seed=seed,
        tokenize=tokenize,
        shard_source=shard_source,
    )


def _objective_stream(
    dataset: Mapping[str, Any],
    kind: str,
    objective: ObjectiveConfig,
    tokenizer: Any,
    batch_size: int,
    seed: int | str,
    shard_source: ShardSourceFactory | None,
) -> Generator[dict[str, torch.Tensor], None, None]:
    if kind == "demo_corpus":
        if objective.name == "classification":
            raise DataConfigError(
                "no_labels",
                "the demo corpus has no labels to classify",
                'Stream a labelled dataset ([dataset] kind = "stream") or use masked-lm/causal-lm.',
            )
        from toolkit.corpus import demo_texts

        texts: Iterator[Any] = demo_texts(seed)
    else:
        config = StreamConfig.from_dict(dataset)
        specs = tuple(
            dataclasses.replace(
                spec,
                text_column=objective.column or spec.text_column,
                label_column=objective.label_column if objective.name == "classification" else None,
            )
            for spec in config.datasets
        )
        texts = stream_texts(dataclasses.replace(config, datasets=specs), seed=seed, shard_source=shard_source)
    try:
        yield from objective_batches(texts, tokenizer, objective, batch_size=batch_size, seed=seed)
    finally:
        close = getattr(texts, "close", None)
        if close is not None:
            close()
