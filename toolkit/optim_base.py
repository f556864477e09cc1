"""What makes :class:`~toolkit.optimizer.CollaborativeOptimizer` a ``torch.optim.Optimizer`` that
the training loops people already use (HF ``Trainer``, Accelerate, Lightning) can hold.

- ``param_groups[i]["lr"]`` is the relay's learning rate for the next update, copied in whenever a
  collaboration state arrives (:attr:`CollabOptimizerBase.collab_state`). The relay applies the
  run's optimizer and schedule, so a torch LR scheduler attached here is harmless: it may write
  the groups' ``lr`` between syncs, and the relay's value wins at the next one.
- ``state`` stays torch's (empty) per-parameter state, and ``state_dict()`` / ``load_state_dict()``
  are torch's: loops that checkpoint or move the optimizer state round-trip it unchanged.
- :meth:`CollabOptimizerBase.note_loss`: loops that call ``step()`` with no loss (the Trainer,
  Accelerate's wrapper) note each micro-batch's loss and size before it, so the relay charts the
  real loss (:mod:`toolkit.integrations` does it for each loop).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from toolkit.wire.protocol import CollabState


class LossNotes:
    """Losses and sizes of the micro-batches the next step adds (thread-safe: a forward hook may
    run in another thread). Tensors are kept detached and read only when the step takes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._notes: list[tuple[float | torch.Tensor, int | None]] = []

    def add(self, loss: float | torch.Tensor, batch_size: int | None = None) -> None:
        value = loss.detach() if isinstance(loss, torch.Tensor) else float(loss)
        with self._lock:
            self._notes.append((value, batch_size))

    def take(self) -> tuple[float | None, int | None]:
        """(mean loss weighted by size, total size), and forget them; (None, None) if none;
        a total of None when some note had no size."""
        with self._lock:
            notes, self._notes = self._notes, []
        if not notes:
            return None, None
        sizes = [n for _, n in notes]
        total = sum(sizes) if all(n is not None and n > 0 for n in sizes) else None  # type: ignore[misc]
        weights = sizes if total else [1] * len(notes)
        mean = sum(float(v) * w for (v, _), w in zip(notes, weights)) / sum(weights)  # type: ignore[misc]
        return mean, total


class CollabOptimizerBase(torch.optim.Optimizer):
    """A torch optimizer over ``params`` whose groups carry the relay's ``lr``; the step is the
    subclass's."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        super().__init__(list(params), defaults={"lr": 0.0})  # 0 until the relay says (older relays never do)
        self._loss_notes = LossNotes()
        self._collab_state: CollabState | None = None

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

    def restore_lr(self) -> None:
        """Put the relay's lr back into every group (a loop's scheduler may have written its own)."""
        lr = self._collab_state.lr if self._collab_state is not None else None
        if lr is not None:
            for group in self.param_groups:
                group["lr"] = lr

    def note_loss(self, loss: float | torch.Tensor, batch_size: int | None = None) -> None:
        """The loss (and number of samples) of one micro-batch whose gradients the next ``step()``
        adds. Several before one step (gradient accumulation) are averaged, weighted by size, and
        their sizes summed; a ``step(loss=..., batch_size=...)`` overrides them."""
        self._loss_notes.add(loss, batch_size)

    def _take_notes(self) -> tuple[float | None, int | None]:
        return self._loss_notes.take()
