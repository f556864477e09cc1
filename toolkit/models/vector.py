"""One flat parameter vector with a quadratic loss: the model benchmarks use to move exactly
``numel`` float32 values per round, and tests use where the gradient must be known in closed form.
"""

from __future__ import annotations

import torch
from torch import nn


class Vector(nn.Module):
    """``loss(batch [b, numel]) = 0.5 * ||weight - mean(batch)||^2``; its gradient is
    ``weight - mean(batch)``."""

    def __init__(self, *, numel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel))

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        return 0.5 * (self.weight - batch.mean(0)).square().sum()
