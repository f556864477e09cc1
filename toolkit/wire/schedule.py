"""The learning-rate schedule, one function both sides compute.

Sync mode: the relay's master steps with it (``relay_server.rounds.master``), and the status
reports it. Local SGD: ``[optimizer]`` is the peers' inner optimizer, so every peer computes it for
each inner step from the outer round it started on (``toolkit.optimizer.local_sgd``). Peers and
the relay must agree on every step's rate to the last bit, hence one implementation here, in the
layer both import, with plain arguments rather than either side's config type.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_at(step: int, *, lr: float, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """Learning rate of update ``step`` (0-based): a linear warmup over ``warmup_steps``, then
    constant, or a linear or cosine decay to 0 at ``total_steps`` (constant when ``total_steps``
    does not exceed the warmup: a run without an end has nothing to decay towards)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"learning-rate schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return lr
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    if schedule == "linear":
        return lr * (1.0 - progress)
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))
