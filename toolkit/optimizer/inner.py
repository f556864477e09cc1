"""The inner optimizer of ``run.mode = "local_sgd"``: the run's ``[optimizer]``, built on the peer.

In local SGD the inner optimizer's state (Adam's two moments, 8 bytes per parameter in float32)
lives on the volunteer's accelerator for the whole run, beside the model and its gradients: on a
free-tier 16 GB GPU that is what decides the largest model a volunteer can hold. With
``optimizer.state_bits = 8`` the moments are kept blockwise-quantized by ``bitsandbytes``'
``AdamW8bit`` (2 bytes per parameter plus an absmax per 256 values), as the seeds' memory notes
do for the relay's optimizer. Tensors under 4,096 values (biases, norms) keep float32 moments,
bitsandbytes' own default.

Unlike the relay's 8-bit state, a peer's is its own business: the pseudo-gradient it uploads is
``global - local`` whatever optimizer produced ``local``, so a peer without a working
``bitsandbytes`` (not installed, or a build without kernels for its device) trains with float32
moments and says so once in its log, rather than refusing to join. What it costs is memory, not
correctness: 6 bytes per parameter more on that peer.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from toolkit.runtime.eight_bit import MIN_8BIT_SIZE, probe_adamw8bit

log = logging.getLogger("toolkit.optimizer")


def inner_optimizer(params: list[tuple[str, torch.nn.Parameter]], cfg: dict[str, Any]) -> torch.optim.Optimizer:
    """The run's ``[optimizer]`` as the relay would build it (``relay_server.rounds.master``),
    over the peer's own parameters: decay on tensors with two or more dimensions."""
    decay = [p for _, p in params if p.ndim >= 2]
    no_decay = [p for _, p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": float(cfg["weight_decay"])}, {"params": no_decay, "weight_decay": 0.0}]
    lr, name = float(cfg["lr"]), cfg["name"]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=float(cfg.get("momentum", 0.0)))
    betas, eps = (float(cfg["betas"][0]), float(cfg["betas"][1])), float(cfg["eps"])
    if int(cfg.get("state_bits", 32)) == 8:  # the relay allows it for adamw, and adam without decay (the same)
        device = next((p.device for _, p in params), torch.device("cpu"))
        eight_bit = adamw8bit(device)
        if isinstance(eight_bit, str):
            log.warning(
                "optimizer.state_bits = 8: %s; the inner optimizer keeps float32 moments on this peer "
                '(6 bytes per parameter more; pip install -U "bitsandbytes>=0.50" to save them)',
                eight_bit,
            )
        else:
            return eight_bit(groups, lr=lr, betas=betas, eps=eps, weight_decay=0.0, min_8bit_size=MIN_8BIT_SIZE)
    if name == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=betas, eps=eps)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
    raise ValueError(f"inner optimizer {name!r} is not supported: the relay should have refused this run")


@functools.cache
def adamw8bit(device: torch.device) -> type[torch.optim.Optimizer] | str:
    """:func:`probe_adamw8bit`, once per device (the probe costs one tiny step)."""
    return probe_adamw8bit(device)
