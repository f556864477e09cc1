"""Noting each micro-batch's loss for loops that call ``step()`` without it.

:func:`watch_loss` hooks the model's forward: in training mode, with gradients enabled, an output
carrying a ``loss`` (an HF ``ModelOutput``, a dict, or a module returning the loss tensor itself
with ``scalar_output=True``) is noted on the optimizer with the batch size read from the first
tensor argument. :func:`collaborative` finds our optimizer inside the loops' wrappers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from toolkit.optimizer import CollaborativeOptimizer


def collaborative(optimizer: Any) -> CollaborativeOptimizer:
    """The :class:`CollaborativeOptimizer` inside ``optimizer``: itself, or the one a loop's
    wrapper holds (Accelerate's ``AcceleratedOptimizer.optimizer``, Lightning's
    ``LightningOptimizer._optimizer``), however deep."""
    seen = 0
    while not isinstance(optimizer, CollaborativeOptimizer):
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None or seen > 8:
            raise TypeError(f"{type(optimizer).__name__} holds no CollaborativeOptimizer")
        optimizer, seen = inner, seen + 1
    return optimizer


def loss_of_output(output: Any, scalar_output: bool = False) -> torch.Tensor | None:
    """The loss an output carries, or None."""
    if scalar_output and isinstance(output, torch.Tensor) and output.ndim == 0:
        return output
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.ndim == 0 else None


def batch_size_of_call(args: tuple, kwargs: Mapping[str, Any]) -> int | None:
    """The leading dimension of the first tensor among the call's arguments (or a dict's values)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, (Mapping, list, tuple)):
            value = next((v for v in (value.values() if isinstance(value, Mapping) else value)
                          if isinstance(v, torch.Tensor)), None)
        if isinstance(value, torch.Tensor) and value.ndim >= 1:
            return int(value.shape[0])
    return None


def watch_loss(model: torch.nn.Module, optimizer: Any, *, scalar_output: bool = False) -> Any:
    """Note the loss and batch size of every training forward of ``model`` on ``optimizer`` (ours,
    or a wrapper around it). Returns the hook's handle: ``.remove()`` it when training ends."""
    opt = collaborative(optimizer)

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # evaluation, or a no-grad forward inside the loop
        loss = loss_of_output(output, scalar_output)
        if loss is not None:
            opt.note_loss(loss, batch_size_of_call(args, kwargs))

    return model.register_forward_hook(hook, with_kwargs=True)
