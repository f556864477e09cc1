"""The paper's expert block and a deterministic way to initialise it from its uid.

An expert host and an in-process reference must start an expert from the same weights without
exchanging them: :func:`expert_seed` derives a seed from ``(uid, base_seed)`` (crc32, stable
across processes and Python versions, unlike ``hash``), and :class:`FFNExpert` initialises from
its own ``torch.Generator``, leaving the global RNG alone.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn


def expert_seed(uid: str, base_seed: int = 0) -> int:
    """A 31-bit seed for expert ``uid`` of a run whose experts start from ``base_seed``."""
    return zlib.crc32(f"{base_seed}:{uid}".encode()) & 0x7FFFFFFF


class FFNExpert(nn.Module):
    """``x + Linear(ReLU(LayerNorm(Linear(x))))``: Learning@home's feed-forward expert (s4.1),
    ``d -> hidden -> d`` with a residual, so an expert starts close to the identity map."""

    def __init__(self, d: int, hidden: int, *, seed: int = 0) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.down = nn.Linear(hidden, d)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for lin in (self.up, self.down):
                bound = lin.in_features ** -0.5   # nn.Linear's default range, from our generator
                lin.weight.uniform_(-bound, bound, generator=gen)
                lin.bias.uniform_(-bound, bound, generator=gen)

    @classmethod
    def for_uid(cls, uid: str, d: int, hidden: int, base_seed: int = 0) -> FFNExpert:
        """The expert ``uid`` as every process of a run initialises it."""
        return cls(d, hidden, seed=expert_seed(uid, base_seed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.norm(self.up(x))))
