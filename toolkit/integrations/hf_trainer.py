"""An HF ``transformers.Trainer`` callback for :class:`~toolkit.optimizer.CollaborativeOptimizer`.

    opt = CollaborativeOptimizer(model, relay_url, batch_size_per_step=args.per_device_train_batch_size)
    trainer = Trainer(model=model, args=args, train_dataset=run_dataset(opt), optimizers=(opt, None),
                      callbacks=[CollaborativeCallback(opt)])

:func:`run_dataset` is the run's data for this peer (``opt.batches()``) as the rows a Trainer
batches again; it ends when the run finishes, and so does the Trainer.

What the callback sets right, so the peer contributes the sum over exactly the samples it reports
and the relay charts their mean loss:

- The Trainer calls ``optimizer.step()`` with no loss; the callback hooks the model's forward
  (:func:`~toolkit.integrations.hooks.watch_loss`), which notes each micro-batch's loss and size
  before its backward. Whether the Trainer divided that loss by ``gradient_accumulation_steps``
  depends on the model (``model_accepts_loss_kwargs``: ALBERT's ``forward`` takes ``**kwargs``, so
  the Trainer does not divide; GPT-2's returns a loss over ``num_items_in_batch`` instead): the
  hook sets the gradient entering the loss itself, so neither matters, and the GradScaler of an
  fp16 Trainer is found in the Trainer's optimizer wrapper.
- A step the GradScaler skipped leaves its micro-batches' notes behind; the callback drops them
  after the optimizer step, so the next step counts only its own.
- ``max_grad_norm > 0`` (the Trainer's default is 1.0) would clip this peer's share before the
  collaboration sums it: the callback turns it off, saying so once. The relay clips the averaged
  gradient (``[optimizer] clip_grad_norm``).
- The relay's schedule decides the learning rate: after each step the callback puts the relay's
  lr back into ``param_groups`` (the Trainer's scheduler wrote its own) and makes the Trainer's
  scheduler report it, so the Trainer's logged ``learning_rate`` is the relay's.
- Training stops once the run has finished; a Trainer started on a run that had already finished
  raises :class:`~toolkit.errors.RunFinished` at once, the one line :func:`toolkit.join` ends with.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f'toolkit.integrations.hf_trainer needs transformers: pip install "collabtrain[hf]" ({exc})'
    ) from exc

from toolkit.integrations.hooks import collaborative, loss_scaler_of, refuse_a_finished_run, watch_loss

log = logging.getLogger(__name__)


class CollaborativeCallback(TrainerCallback):
    """Notes each training micro-batch's loss on the collaborative optimizer, keeps the Trainer
    from clipping per peer, shows the relay's lr, and ends training when the run finishes.
    ``optimizer`` defaults to the Trainer's."""

    def __init__(self, optimizer: Any = None) -> None:
        self.optimizer = optimizer
        self._handle: Any = None

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any
    ) -> None:
        self.optimizer = collaborative(self.optimizer if self.optimizer is not None else optimizer)
        refuse_a_finished_run(self.optimizer)  # before the first (empty) batch is fetched
        if args.max_grad_norm is not None and args.max_grad_norm > 0:
            log.warning(
                "max_grad_norm=%g would clip this peer's gradient before the collaboration sums it: "
                "turned off (the relay clips the averaged gradient, [optimizer] clip_grad_norm)",
                args.max_grad_norm,
            )
            args.max_grad_norm = 0.0
        if self._handle is None and model is not None:
            # The Trainer's optimizer is Accelerate's wrapper, holding the fp16 GradScaler if any.
            self._handle = watch_loss(model, self.optimizer, scaler=loss_scaler_of(optimizer) if optimizer else None)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, lr_scheduler: Any = None, **kwargs: Any) -> None:
        opt = self.optimizer
        if opt is None:
            return
        opt.zero_grad()  # the Trainer zeroes through the model; a skipped step's notes must go too
        if lr_scheduler is not None and hasattr(lr_scheduler, "_last_lr"):
            lr_scheduler._last_lr = [group["lr"] for group in opt.param_groups]  # what the Trainer logs next

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.optimizer is not None:
            self.optimizer.restore_lr()  # the Trainer's scheduler stepped after ours: the relay's lr shows
            if self.optimizer.finished:
                control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class _Rows(torch.utils.data.IterableDataset):
    """Dict batches, one row at a time."""

    def __init__(self, batches: Iterable[Any]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.batches:
            size = len(next(iter(batch.values())))
            for r in range(size):
                yield {key: value[r] for key, value in batch.items()}


def run_dataset(optimizer: Any, data: Iterable[Any] | None = None) -> torch.utils.data.IterableDataset:
    """The run's batches for this peer (:meth:`~toolkit.optimizer.CollaborativeOptimizer.batches`,
    or ``data``'s until the run finishes) as a dataset of rows: the Trainer batches them again, in
    order, so ``per_device_train_batch_size = batch_size_per_step`` trains on the run's batches as
    they are. Pass ``max_steps`` to the Trainer (an iterable dataset has no length); the run's end
    stops it first."""
    return _Rows(collaborative(optimizer).batches(data))
