"""A small regression MLP: exact, fast, deterministic -- the model the equivalence tests train."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """``loss(batch [b, in + 1])``: mean squared error of predicting the last column from the rest."""

    def __init__(self, *, sizes: list[int] | tuple[int, ...] = (16, 32, 1)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self(batch[:, :-1]).squeeze(-1), batch[:, -1])
