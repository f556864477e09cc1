"""Putting the stages together: a peer's mixed, shuffled, tokenized, packed stream."""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Generator, Iterator, Mapping
from typing import Any

import torch

from toolkit.data.config import DatasetSpec, StreamConfig
from toolkit.data.reading import _ShardStream, check_offline_env
from toolkit.data.shards import LocalShardOrder, ShardSource
from toolkit.data.stages import Tokenizer, byte_tokenize, mix, pack, shuffle_buffer
from toolkit.errors import DataConfigError

ShardSourceFactory = Callable[[DatasetSpec], ShardSource]
"""Gives each dataset of the mix its :class:`ShardSource` (see :mod:`toolkit.data.shards`)."""


def stream_texts(config: StreamConfig, *, seed: int | str,
                 shard_source: ShardSourceFactory | None = None) -> Generator[str, None, None]:
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
                   shard_source: ShardSourceFactory | None = None) -> Generator[torch.Tensor, None, None]:
    """Endless ``[batch_size, seq_len + 1]`` LongTensor batches: :func:`stream_texts`, tokenized
    lazily (one document at a time, only as the packer needs it), then :func:`pack`\\ ed."""
    texts = stream_texts(config, seed=seed, shard_source=shard_source)
    try:
        yield from pack(map(tokenize, texts), batch_size, seq_len)
    finally:
        texts.close()


def batches_for_run(dataset: Mapping[str, Any], *, batch_size: int, seq_len: int, seed: int | str,
                    tokenize: Tokenizer = byte_tokenize,
                    shard_source: ShardSourceFactory | None = None) -> Iterator[torch.Tensor]:
    """Batches for a run's ``[dataset]`` section (``RunInfo.dataset``).

    ``kind = "demo_corpus"`` (or no section) keeps the shipped demo text of
    :mod:`toolkit.corpus`; ``kind = "stream"`` streams shards as described in :mod:`toolkit.data`.
    """
    kind = dataset.get("kind", "demo_corpus") or "demo_corpus"
    if kind == "demo_corpus":
        from toolkit.corpus import demo_batches

        return demo_batches(batch_size, seq_len, seed if isinstance(seed, int) else zlib.crc32(str(seed).encode()))
    if kind == "stream":
        return stream_batches(StreamConfig.from_dict(dataset), batch_size=batch_size, seq_len=seq_len, seed=seed,
                              tokenize=tokenize, shard_source=shard_source)
    raise DataConfigError("bad_dataset", f"unknown dataset kind {kind!r}", 'Use kind = "demo_corpus" or "stream".')
