"""The stream's pure operations: shuffle buffer, mixing, tokenization, packing.

Why our own buffer and sampler rather than ``IterableDataset.shuffle`` / ``interleave_datasets``:
an ``IterableDataset`` fixes its shard list when it is built (``data_files``), and ``shuffle``
permutes that fixed list, which a lease pool that changes every minute cannot be; wrapping a lease
loop in ``IterableDataset.from_generator`` deep-copies its arguments (a relay client with a lock
cannot be copied) and adds per-row layers. Each row must also carry its shard through the buffer,
so that "rows done" counts rows that reached training rather than rows merely read. Both pieces
are the textbook algorithms in a dozen lines each and are tested here.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")
Tokenizer = Callable[[str], Sequence[int]]

BYTE_EOS = 0xFF
"""Ends each document for the byte-level LM: the byte 0xFF never occurs inside UTF-8 text."""


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
            yield torch.tensor(buf[start : start + need], dtype=torch.long).view(batch_size, seq_len + 1)
            start += need
        del buf[:start]
