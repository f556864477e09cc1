"""What makes :class:`~toolkit.optimizer.CollaborativeOptimizer` a ``torch.optim.Optimizer`` that
the training loops people already use (HF ``Trainer``, Accelerate, Lightning) can hold, and how it
learns what each micro-batch contributed.

- ``param_groups[i]["lr"]`` is the relay's learning rate for the next update (in local SGD, the
  inner optimizer's, which this peer's steps apply), copied in whenever a collaboration state arrives (:attr:`CollabOptimizerBase.collab_state`). The relay applies the
  run's optimizer and schedule, so a torch LR scheduler attached here is harmless: it may write
  the groups' ``lr`` between syncs, and the relay's value wins at the next one.
- ``state`` stays torch's (empty) per-parameter state, and ``state_dict()`` / ``load_state_dict()``
  are torch's: loops that checkpoint or move the optimizer state round-trip it unchanged.
- :meth:`CollabOptimizerBase.note_loss`: loops that call ``step()`` with no loss (the Trainer,
  Accelerate's wrapper, Lightning) note each micro-batch's loss and size before its backward.

Why noting *before* the backward matters: the collaboration sums gradients (each peer uploads the
sum over its samples; the relay divides by the total), but what a loop backpropagates differs by
framework and model: the Trainer divides each micro-batch's loss by the accumulation count or not
(``model_accepts_loss_kwargs``), Accelerate and Lightning divide, a GradScaler multiplies by its
scale. A noted loss tensor that is about to be backpropagated gets a hook that *sets* the gradient
entering it to ``scale * samples / unit`` (``scale``: the loss scale the loop removes before
``step()``; ``unit``: the optimizer's ``batch_size_per_step``), whatever the loop divided or
multiplied in between. ``.grad`` is then the sum over exactly the noted samples, over ``unit``,
for every loop. Notes whose gradients are thrown away without a ``step()`` (a GradScaler that
skipped it) are dropped at the next ``zero_grad()``, so they never count twice.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from toolkit.wire.protocol import CollabState

Mode = Literal["sum", "mean"]


@dataclass
class _Note:
    """One micro-batch: its mean loss (as charted), its size, and what its backward did."""

    value: float | torch.Tensor
    samples: int | None
    hooked: bool = False  # a hook sets the gradient entering its loss tensor
    backpropagated: bool = False  # that hook ran: the micro-batch's gradient is in ``.grad``
    unexplained: float = 1.0  # gradient entering the loss / the most the loop's scale explains


class LossNotes:
    """Losses and sizes of the micro-batches the next step adds (thread-safe: a forward hook may
    run in another thread). Tensors are kept detached and read only when the step takes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._notes: list[_Note] = []

    def add(
        self,
        loss: float | torch.Tensor,
        batch_size: int | None,
        *,
        divided_by: float = 1.0,
        loss_scale: float = 1.0,
        unit: float = 1.0,
    ) -> None:
        """Note one micro-batch; hook its loss tensor if it is about to be backpropagated (module
        docstring). ``loss`` is its mean loss divided by ``divided_by``."""
        if isinstance(loss, torch.Tensor):
            note = _Note(loss.detach() * divided_by, batch_size)
            if loss.requires_grad and torch.is_grad_enabled() and batch_size:
                target = loss_scale * batch_size * divided_by / unit
                explained = loss_scale * divided_by

                def set_gradient(grad: torch.Tensor) -> torch.Tensor:
                    note.backpropagated = True
                    note.unexplained = float(grad.detach().abs().max()) / explained
                    return torch.full_like(grad, target)

                loss.register_hook(set_gradient)
                note.hooked = True
        else:
            note = _Note(float(loss) * divided_by, batch_size)
        with self._lock:
            self._notes.append(note)

    def take(self) -> tuple[float | None, int | None, Mode]:
        """(mean loss weighted by size, total size, mode), and forget them; (None, None, "mean")
        if none; a total of None when some note had no size. ``mode`` is "sum" when a note's
        backward ran through its hook (``.grad`` is the sum over the samples, over ``unit``),
        "mean" when none did (``.grad`` is the mean gradient over the total, as a plain loop's).
        In "sum" mode a noted forward whose loss was never backpropagated is left out."""
        with self._lock:
            notes, self._notes = self._notes, []
        if not notes:
            return None, None, "mean"
        summed = any(n.backpropagated for n in notes)
        if summed:  # a noted forward that was never backpropagated (an evaluation) added no gradient
            notes = [n for n in notes if n.backpropagated]
        worst = max(n.unexplained for n in notes)
        if worst > 1.001:
            raise ValueError(
                f"the loss reached backward multiplied by {worst:g}, more than the loss scale this "
                "optimizer knows: give it the loop's GradScaler (CollaborativeOptimizer(..., "
                "scaler=scaler) or opt.scaler = scaler)"
            )
        sizes = [n.samples for n in notes]
        total = sum(sizes) if all(n is not None and n > 0 for n in sizes) else None  # type: ignore[misc]
        weights = sizes if total else [1] * len(notes)
        mean = sum(float(n.value) * w for n, w in zip(notes, weights)) / sum(weights)  # type: ignore[misc]
        return mean, total, "sum" if summed else "mean"

    def drop_backpropagated(self) -> None:
        """Forget the micro-batches whose gradients a ``zero_grad()`` is discarding unused (a
        GradScaler skipped their step); a note whose backward has not run yet stays."""
        with self._lock:
            self._notes = [n for n in self._notes if not n.backpropagated]


class CollabOptimizerBase(torch.optim.Optimizer):
    """A torch optimizer over ``params`` whose groups carry the relay's ``lr``; the step is the
    subclass's. ``grad_unit`` is the sample count a hooked micro-batch's gradient is scaled
    against (module docstring); ``scaler`` the loop's loss scaler, if any (``get_scale()``)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], *, grad_unit: float = 1.0, scaler: Any = None) -> None:
        super().__init__(list(params), defaults={"lr": 0.0})  # 0 until the relay says (older relays never do)
        self._loss_notes = LossNotes()
        self._collab_state: CollabState | None = None
        # The lr this peer's own steps apply, carried by the groups instead of the relay's: local
        # SGD's inner optimizer runs here, the relay's (outer) lr is not what the loop's steps use.
        self.local_lr: float | None = None
        self.grad_unit = float(grad_unit)
        self.scaler = scaler

    @property
    def collab_state(self) -> CollabState:
        """The collaboration's progress as last received. Not ``state``: that is torch's
        per-parameter state, which Trainer, Accelerate and Lightning checkpoint via state_dict()."""
        assert self._collab_state is not None, "no collaboration state yet"
        return self._collab_state

    @collab_state.setter
    def collab_state(self, state: CollabState) -> None:
        self._collab_state = state
        self.restore_lr()

    def use_local_lr(self, lr: float) -> None:
        """The lr this peer's own steps apply from now on (local SGD's inner rate), shown in every group."""
        self.local_lr = lr
        self.restore_lr()

    def restore_lr(self) -> None:
        """Put the relay's lr (or ``local_lr``) back into every group (a loop's scheduler may have
        written its own)."""
        lr = self._collab_state.lr if self._collab_state is not None else None
        lr = self.local_lr if self.local_lr is not None else lr
        if lr is not None:
            for group in self.param_groups:
                group["lr"] = lr

    def loss_scale(self) -> float:
        """The factor the loop's loss scaler multiplies the loss by now (1 without one)."""
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    def note_loss(self, loss: float | torch.Tensor, batch_size: int | None = None, *, divided_by: float = 1.0) -> None:
        """The loss (and number of samples) of one micro-batch whose gradients the next ``step()``
        adds. Several before one step (gradient accumulation) are averaged, weighted by size, and
        their sizes summed; a ``step(loss=...)`` overrides the charted value.

        Noted before its backward, a loss tensor makes the gradient exact whatever the loop divides
        it by (module docstring). ``divided_by``: the noted tensor is the micro-batch's mean loss
        divided by this (Lightning notes ``mean * loss_scale / accumulate_grad_batches``)."""
        self._loss_notes.add(
            loss, batch_size, divided_by=divided_by, loss_scale=self.loss_scale(), unit=self.grad_unit
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's, and the notes of micro-batches whose gradients it discards go with them."""
        super().zero_grad(set_to_none)
        self._loss_notes.drop_backpropagated()

    def _take_notes(self) -> tuple[float | None, int | None, Mode]:
        return self._loss_notes.take()
