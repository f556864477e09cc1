"""``toolkit.join``: the one call a volunteer's notebook makes.

It builds the run's model (or uses yours), joins the relay, streams data, trains until the run
finishes, the cell is interrupted, or a limit you set is hit, and always leaves cleanly. The
training loop is the plain one in :mod:`toolkit.optimizer`'s docstring.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from toolkit.client import RelayClient
from toolkit.corpus import demo_batches
from toolkit.models import build_model
from toolkit.optimizer import CollaborativeOptimizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JoinResult:
    peer_id: str
    final_step: int
    contributed_samples: int
    local_steps: int
    last_loss: float | None
    seconds: float
    finished: bool


def join(relay_url: str, *, model: torch.nn.Module | None = None, data: Iterable[torch.Tensor] | None = None,
         batch_size: int = 8, peer_name: str = "peer", seed: int | None = None, max_steps: int | None = None,
         max_seconds: float | None = None, delayed_updates: bool = False, verbose: bool = False) -> JoinResult:
    """Contribute to the run at ``relay_url`` until it finishes (or ``max_steps`` global steps /
    ``max_seconds`` pass, or the cell is interrupted).

    ``model`` must expose ``loss(batch) -> scalar`` (the run's model is built if omitted);
    ``data`` yields batches for it (the run's demo text if omitted).
    """
    started = time.monotonic()
    client = RelayClient(relay_url)
    run = client.get_run()
    if model is None:
        model = build_model(run.model.factory, dict(run.model.kwargs))
    seq_len = int(run.model.kwargs.get("seq_len", 64))
    batches: Iterator[torch.Tensor] = iter(data) if data is not None else demo_batches(
        batch_size, seq_len, seed if seed is not None else int(time.time_ns() % 2**31))
    opt = CollaborativeOptimizer(model, client=client, batch_size_per_step=batch_size, peer_name=peer_name,
                                 delayed_updates=delayed_updates, device_info={"kind": "cpu", "name": "cpu"},
                                 precision=run.precision, verbose=verbose)
    first_step, local_steps, loss_value = opt.version, 0, None
    try:
        for batch in batches:
            loss = model.loss(batch)
            opt.zero_grad()
            loss.backward()
            loss_value = loss.item()
            opt.step(batch_size=batch.shape[0], loss=loss_value)
            local_steps += 1
            if opt.finished or (max_steps is not None and opt.version - first_step >= max_steps):
                break
            if max_seconds is not None and time.monotonic() - started > max_seconds:
                break
    except KeyboardInterrupt:
        log.info("interrupted: leaving the collaboration")
    finally:
        opt.close()
    return JoinResult(peer_id=opt.peer_id, final_step=opt.version, contributed_samples=opt.contributed_samples,
                      local_steps=local_steps, last_loss=loss_value, seconds=time.monotonic() - started,
                      finished=opt.finished)
