"""The demo's training text: byte windows drawn from the corpus the toolkit ships.

Each peer draws windows with its own seed, so peers see different samples without any
coordination; runs configured with real datasets use :mod:`toolkit.data` instead.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from functools import lru_cache
from importlib import resources

import torch


@lru_cache(maxsize=1)
def demo_corpus() -> torch.Tensor:
    """The shipped text as a uint8 tensor of bytes (read once per process; immutable)."""
    raw = resources.files("toolkit").joinpath("assets/demo_corpus.txt").read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def demo_batches(batch_size: int, seq_len: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless batches [batch_size, seq_len + 1] of byte ids (inputs and shifted targets)."""
    data = demo_corpus()
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size, 1), generator=generator)
        yield data[starts + offsets].long()


@lru_cache(maxsize=1)
def demo_paragraphs() -> tuple[str, ...]:
    """The shipped text's paragraphs (blank-line separated): the documents of a tokenized run."""
    text = resources.files("toolkit").joinpath("assets/demo_corpus.txt").read_text(encoding="utf-8")
    return tuple(p.strip() for p in text.split("\n\n") if p.strip())


def demo_texts(seed: int | str, epochs: int | None = None) -> Iterator[str]:
    """The paragraphs, each epoch in an order of its own seeded by ``(seed, epoch)``; endless by default."""
    epoch = 0
    while epochs is None or epoch < epochs:
        order = list(demo_paragraphs())
        random.Random(f"{seed}/{epoch}").shuffle(order)
        yield from order
        epoch += 1
