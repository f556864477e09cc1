"""``toolkit.join``: the one call a volunteer's notebook makes.

It finds the accelerator, picks the precision (or takes the one the run pins), builds the run's
model (or uses yours), joins the relay, streams the run's data, trains until the run finishes,
the cell is interrupted, or a limit you set is hit, and always leaves cleanly. The loop inside is
the plain one in :mod:`toolkit.optimizer`'s docstring, with the precision policy around it.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from toolkit import environment
from toolkit.client import RelayClient
from toolkit.data import batches_for_run
from toolkit.models import build_model
from toolkit.optimizer import CollaborativeOptimizer
from toolkit.precision import choose_precision

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
    device: str
    precision: str


def join(relay_url: str, *, model: torch.nn.Module | None = None, data: Iterable[torch.Tensor] | None = None,
         batch_size: int = 8, peer_name: str | None = None, seed: int | None = None, max_steps: int | None = None,
         max_seconds: float | None = None, delayed_updates: bool = False, verbose: bool = False) -> JoinResult:
    """Contribute to the run at ``relay_url`` until it finishes (or ``max_steps`` global steps /
    ``max_seconds`` pass, or the cell is interrupted).

    ``model`` must expose ``loss(batch) -> scalar`` (the run's model is built if omitted);
    ``data`` yields batches for it (the run's dataset if omitted: its streamed shards, or the
    demo text the toolkit ships).
    """
    started = time.monotonic()
    client = RelayClient(relay_url)
    run = client.get_run()
    info = environment.detect()
    policy = choose_precision(info, run.precision)  # PrecisionUnsupported before we join
    device = environment.device(info)
    if model is None:
        torch.manual_seed(0)  # the relay's parameters replace these at once; only the shapes matter
        model = build_model(run.model.factory, dict(run.model.kwargs))
    model.to(device)
    opt = CollaborativeOptimizer(model, client=client, batch_size_per_step=batch_size,
                                 peer_name=peer_name or socket.gethostname()[:64], delayed_updates=delayed_updates,
                                 device_info={**info.to_json(), "precision": policy.to_json()},
                                 precision=policy.name, verbose=verbose)
    seq_len = int(run.model.kwargs.get("seq_len", 64))
    batches: Iterator[torch.Tensor] = iter(data) if data is not None else batches_for_run(
        run.dataset, batch_size=batch_size, seq_len=seq_len, seed=seed if seed is not None else opt.peer_id)
    first_step, local_steps, loss_value = opt.version, 0, None
    try:
        for batch in batches:
            batch = batch.to(device, non_blocking=True)
            opt.zero_grad()
            with policy.autocast():
                loss = model.loss(batch)
            policy.scale_loss(loss).backward()
            finite = policy.unscale_and_check(model.parameters())
            loss_value = loss.item()
            environment.optimizer_step(opt, info, batch_size=batch.shape[0], loss=loss_value, skip=not finite)
            local_steps += 1
            if opt.finished or (max_steps is not None and opt.version - first_step >= max_steps):
                break
            if max_seconds is not None and time.monotonic() - started > max_seconds:
                break
    except KeyboardInterrupt:
        log.info("interrupted: leaving the collaboration")
    finally:
        opt.close()
        close = getattr(batches, "close", None)
        if close is not None:
            close()  # a streaming source reports and releases the shards it holds
    return JoinResult(peer_id=opt.peer_id, final_step=opt.version, contributed_samples=opt.contributed_samples,
                      local_steps=local_steps, last_loss=loss_value, seconds=time.monotonic() - started,
                      finished=opt.finished, device=info.label, precision=policy.name)
