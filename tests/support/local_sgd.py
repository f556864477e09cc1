"""A ``run.mode = "local_sgd"`` run and its peers, for the tests of the mode (``tests/test_local_sgd.py``)
and of what observers see of it (``tests/test_local_sgd_status.py``): the MLP of conftest on
deterministic batches, peers in this process.
"""

from __future__ import annotations

import numpy as np
import torch

from toolkit.client import RelayClient
from toolkit.models import build_model
from toolkit.optimizer import CollaborativeOptimizer

BATCH = 8
SGD1 = {"name": "sgd", "lr": 1.0, "weight_decay": 0.0, "momentum": 0.0, "clip_grad_norm": 0.0}
PATIENT = {"deadline_floor_s": 60.0, "deadline_initial_s": 120.0}  # a loaded machine: no deadline closes


def batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, BATCH, 8, generator=g)
    return [torch.cat([b, torch.tanh(b.sum(1, keepdim=True))], dim=1) for b in x]


def join(url: str, name: str = "peer") -> tuple[torch.nn.Module, CollaborativeOptimizer]:
    """A peer in this process: the run's model and its optimizer (joined; reports every 50 ms; its
    rounds run in its own worker thread)."""
    client = RelayClient(url)
    model = build_model(client.get_run().model)
    return model, CollaborativeOptimizer(
        model, client=client, batch_size_per_step=BATCH, report_interval_s=0.05, peer_name=name
    )


def inner_step(model: torch.nn.Module, opt: CollaborativeOptimizer, batch: torch.Tensor) -> None:
    """One micro-batch through the peer's ``step()`` (an inner step, and whatever round is due)."""
    opt.zero_grad()
    loss = model.loss(batch)
    loss.backward()
    opt.step(loss=loss.item())


def train_until(
    model: torch.nn.Module, opt: CollaborativeOptimizer, data: list[torch.Tensor], until_step: int
) -> None:
    """Train on ``data`` (cycled) until the peer holds version ``until_step``."""
    i = 0
    while opt.version < until_step:
        inner_step(model, opt, data[i % len(data)])
        i += 1


def train(url: str, data: list[torch.Tensor], until_step: int) -> CollaborativeOptimizer:
    """One peer in this process training on ``data`` (cycled) until the relay reaches ``until_step``."""
    model, opt = join(url)
    train_until(model, opt, data, until_step)
    opt.close()
    return opt


def local_run(inner: dict, **local_sgd) -> dict:
    return {
        "run": {"mode": "local_sgd", "target_batch": BATCH, "max_staleness": 0, "compression": "none"},
        "optimizer": inner,
        "local_sgd": local_sgd,
        "rounds": PATIENT,
    }


def relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
