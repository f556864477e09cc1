"""An HF ``transformers.Trainer`` callback for :class:`~toolkit.optimizer.CollaborativeOptimizer`.

    opt = CollaborativeOptimizer(model, relay_url, batch_size_per_step=args.per_device_train_batch_size)
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None),
                      callbacks=[CollaborativeCallback(opt)])

The Trainer calls ``optimizer.step()`` with no loss; the callback hooks the model's forward
(:func:`~toolkit.integrations.hooks.watch_loss`) so each micro-batch's loss and size reach the
next step, and stops training once the run has finished. The Trainer's default LR scheduler is
harmless: the relay's schedule decides, and the callback puts the relay's lr back into
``param_groups`` after each step (the Trainer's own "learning_rate" log line is its scheduler's;
``lr_scheduler_type="constant"`` makes that one match too). Set ``max_grad_norm=0``: the
relay clips the averaged gradient (``optimizer.clip_grad_norm``), and clipping each micro-batch
here would change what the peer contributes.
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f'toolkit.integrations.hf needs transformers: pip install "collabtrain[hf]" ({exc})') from exc

from toolkit.integrations.hooks import collaborative, watch_loss


class CollaborativeCallback(TrainerCallback):
    """Notes each training micro-batch's loss on the collaborative optimizer; ends training when
    the run finishes. ``optimizer`` defaults to the Trainer's."""

    def __init__(self, optimizer: Any = None) -> None:
        self.optimizer = optimizer
        self._handle: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        self.optimizer = collaborative(self.optimizer if self.optimizer is not None else optimizer)
        if self._handle is None and model is not None:
            self._handle = watch_loss(model, self.optimizer)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.optimizer is not None:
            self.optimizer.restore_lr()  # the Trainer's scheduler stepped after ours: the relay's lr shows
            if self.optimizer.finished:
                control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
