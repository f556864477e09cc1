"""Noting each micro-batch's loss for loops that call ``step()`` without it.

:func:`watch_loss` hooks the model's forward: whenever gradients are enabled, an output carrying a
loss that will be backpropagated (an HF ``ModelOutput``, a dict, or a module returning the loss
tensor itself with ``scalar_output=True``) is noted on the optimizer with the batch size read from
the first tensor argument. Training or ``eval()`` mode does not matter (``from_pretrained``
returns a model in eval mode, and a loop may train it so): a forward under ``torch.no_grad()`` is
an evaluation and is not noted. Noting the loss before its backward is what makes the gradient
exact whatever the loop divides it by (:mod:`toolkit.optim_base`).

It also drops a ``num_items_in_batch`` argument (the HF Trainer's, under gradient accumulation):
models that honour it return a loss divided by the whole accumulated batch's token count rather
than their micro-batch's mean, and the relay charts the mean. The gradient does not depend on it.

:func:`collaborative` finds our optimizer inside the loops' wrappers, :func:`loss_scaler_of` the
wrappers' GradScaler.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from toolkit.errors import MESSAGES, RunFinished
from toolkit.optimizer import CollaborativeOptimizer


def _chain(optimizer: Any) -> list[Any]:
    """``optimizer`` and the optimizers it wraps, outermost first."""
    chain = [optimizer]
    while not isinstance(optimizer, CollaborativeOptimizer) and len(chain) < 10:
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None:
            break
        optimizer = inner
        chain.append(optimizer)
    return chain


def collaborative(optimizer: Any) -> CollaborativeOptimizer:
    """The :class:`CollaborativeOptimizer` inside ``optimizer``: itself, or the one a loop's
    wrapper holds (Accelerate's ``AcceleratedOptimizer.optimizer``, Lightning's
    ``LightningOptimizer._optimizer``), however deep."""
    inner = _chain(optimizer)[-1]
    if not isinstance(inner, CollaborativeOptimizer):
        raise TypeError(f"{type(optimizer).__name__} holds no CollaborativeOptimizer")
    return inner


def refuse_a_finished_run(optimizer: Any) -> None:
    """Raise :class:`~toolkit.errors.RunFinished`, the one line :func:`toolkit.join` ends with, when
    the run had already finished: its batches are empty, which the loops do not take as an end
    (the HF Trainer's Accelerate dataloader raises "Batch does not contain any data", Lightning
    starts epoch after empty epoch, an Accelerate loop trains nothing without a word)."""
    opt = collaborative(optimizer)
    if opt.finished:
        raise RunFinished(
            "run_finished", MESSAGES["run_finished"][0].format(run=opt.run.run_name, step=opt.collab_state.step)
        )


def loss_scaler_of(optimizer: Any) -> Any:
    """The GradScaler a wrapper steps our optimizer through (Accelerate's, and so the HF
    Trainer's, ``AcceleratedOptimizer.scaler``), or None."""
    return next((s for s in (getattr(o, "scaler", None) for o in _chain(optimizer)[:-1]) if s is not None), None)


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
            value = next(
                (v for v in (value.values() if isinstance(value, Mapping) else value) if isinstance(v, torch.Tensor)),
                None,
            )
        if isinstance(value, torch.Tensor) and value.ndim >= 1:
            return int(value.shape[0])
    return None


class _Handles:
    """The two hooks :func:`watch_loss` registers, removed together."""

    def __init__(self, *handles: Any) -> None:
        self._handles = handles

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def watch_loss(model: torch.nn.Module, optimizer: Any, *, scalar_output: bool = False, scaler: Any = None) -> Any:
    """Note the loss and batch size of every gradient-enabled forward of ``model`` on
    ``optimizer`` (ours, or a wrapper around it). ``scaler``: the loop's GradScaler, if it is not
    the wrapper's (Accelerate's is found). Returns a handle: ``.remove()`` it when training ends.
    Raises :class:`~toolkit.errors.RunFinished` if the run has already finished (nothing to train)."""
    refuse_a_finished_run(optimizer)
    opt = collaborative(optimizer)
    found = scaler if scaler is not None else loss_scaler_of(optimizer)
    if found is not None:
        opt.scaler = found

    def drop_item_count(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if "num_items_in_batch" not in kwargs:
            return None
        return args, {k: v for k, v in kwargs.items() if k != "num_items_in_batch"}

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        loss = loss_of_output(output, scalar_output)
        if loss is not None and torch.is_grad_enabled() and loss.requires_grad:
            opt.note_loss(loss, batch_size_of_call(args, kwargs))

    return _Handles(
        model.register_forward_pre_hook(drop_item_count, with_kwargs=True),
        model.register_forward_hook(hook, with_kwargs=True),
    )
