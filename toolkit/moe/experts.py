"""An expert as every process of a run knows it: its block, how it is built, trained and saved.

Both sides import this module: the relay (for the shapes it checks checkpoints against) and a host
(to build, train and checkpoint the experts it leases); neither imports the other's process code.

An expert host and an in-process reference must start an expert from the same weights without
exchanging them: :func:`expert_seed` derives a seed from ``(uid, base_seed)`` (crc32, stable
across processes and Python versions, unlike ``hash``), and :class:`FFNExpert` initialises from
its own ``torch.Generator``, leaving the global RNG alone. Experts are built from the run's
``[moe] expert`` among the toolkit's own architectures: nothing the network sends is imported or
executed.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from toolkit.errors import CollabError
from toolkit.wire import payloads

UPGRADE = "Upgrade collabtrain on this machine to the relay's version."


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
                bound = lin.in_features**-0.5  # nn.Linear's default range, from our generator
                lin.weight.uniform_(-bound, bound, generator=gen)
                lin.bias.uniform_(-bound, bound, generator=gen)

    @classmethod
    def for_uid(cls, uid: str, d: int, hidden: int, base_seed: int = 0) -> FFNExpert:
        """The expert ``uid`` as every process of a run initialises it."""
        return cls(d, hidden, seed=expert_seed(uid, base_seed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.norm(self.up(x))))


def build_expert(expert: Mapping[str, Any], uid: str, seed: int = 0) -> nn.Module:
    """Expert ``uid`` of a run whose ``[moe] expert`` is ``expert`` and ``[moe] seed`` is ``seed``."""
    if expert.get("kind") != "ffn":
        raise CollabError(
            "unknown_expert_kind", f"this toolkit cannot build expert kind {expert.get('kind')!r}", UPGRADE
        )
    return FFNExpert.for_uid(uid, int(expert["d"]), int(expert["hidden"]), int(seed))


def expert_shapes(expert: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of every expert of the run (they share one architecture)."""
    return {name: tuple(p.shape) for name, p in build_expert(expert, "shape.0").named_parameters()}


def make_optimizer(optimizer: Mapping[str, Any], module: nn.Module) -> torch.optim.Optimizer | None:
    """The run's expert optimizer (``[moe] optimizer``), one per expert; ``None`` for ``none``
    (frozen experts: a backward call returns d loss / d x and changes nothing)."""
    name = optimizer["name"]
    if name == "none":
        return None
    if name == "sgd":
        return torch.optim.SGD(module.parameters(), lr=optimizer["lr"], momentum=optimizer.get("momentum", 0.0))
    if name == "adam":
        return torch.optim.Adam(
            module.parameters(), lr=optimizer["lr"], betas=tuple(optimizer.get("betas", (0.9, 0.999)))
        )
    raise CollabError("unknown_optimizer", f"this toolkit has no expert optimizer {name!r}", UPGRADE)


def checkpoint_state(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[tuple[str, np.ndarray]]:
    """The tensors of an expert's checkpoint: ``p.<param>``, ``opt.<param>.<state>``."""
    names = {id(p): name for name, p in module.named_parameters()}
    params = {name: p.detach().cpu().numpy().astype(np.float32) for name, p in module.named_parameters()}
    state = {}
    if optimizer is not None:
        for param, values in optimizer.state.items():
            for key, value in values.items():
                state[f"{names[id(param)]}.{key}"] = torch.as_tensor(value, dtype=torch.float32).cpu().numpy()
    return payloads.checkpoint_tensors(params, state)


def checkpoint_of(module: nn.Module, optimizer: torch.optim.Optimizer | None, updates: int) -> bytes:
    return payloads.encode(dict(checkpoint_state(module, optimizer)), {"updates": str(updates)})


def restore(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, body: bytes, shapes: Mapping[str, tuple[int, ...]]
) -> int:
    """Load a checkpoint the relay kept into ``module`` and ``optimizer``; returns its updates."""
    updates, tensors = payloads.read_checkpoint(body, shapes)
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(torch.from_numpy(tensors[f"p.{name}"]))
    for key, array in tensors.items():
        if key.startswith("opt.") and optimizer is not None:
            name, state_key = key[4:].rsplit(".", 1)
            value = torch.from_numpy(array.copy())
            optimizer.state[params[name]][state_key] = (
                value.reshape(()) if state_key == "step" else value.to(params[name].device)
            )
    return updates
