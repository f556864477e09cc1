"""A model's parameters as the run's flat float32 vector, and back.

The run's layout is the model's ``parameters()`` order end to end (``relay_server.rounds.master.
layout_of``), so these two functions are the whole conversion: the relay builds its master from
:func:`flatten`, its evaluator loads versions with :func:`load_flat`, and tests and benchmarks
compare runs with one process through the same pair.
"""

from __future__ import annotations

import numpy as np
import torch


def flatten(model: torch.nn.Module) -> np.ndarray:
    """A fresh float32 copy of every parameter, in ``parameters()`` order."""
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()]).numpy()


def load_flat(model: torch.nn.Module, flat: np.ndarray | torch.Tensor) -> None:
    """Copy ``flat`` (the run's layout order) into the model's parameters, cast to each one's
    dtype; ValueError when the sizes differ (a version of another model), before anything changes."""
    flat = torch.as_tensor(flat)
    expected = sum(p.numel() for p in model.parameters())
    if flat.numel() != expected:
        raise ValueError(f"the vector holds {flat.numel()} parameters, the model has {expected}")
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[offset : offset + p.numel()].view_as(p).to(p.dtype))
            offset += p.numel()
