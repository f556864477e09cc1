"""A Lightning ``Callback`` for a LightningModule whose ``configure_optimizers`` returns a
:class:`~toolkit.optimizer.CollaborativeOptimizer`.

    trainer = lightning.pytorch.Trainer(max_steps=..., callbacks=[CollaborativeLightningCallback()])

Lightning calls ``step(closure=...)``; the closure runs ``training_step`` and ``backward``, so the
loss already reaches the step. The callback adds the batch size (``on_train_batch_start``) and
notes every micro-batch's loss before its backward (``on_before_backward``: with
``accumulate_grad_batches`` each one, not only the last), and stops the Trainer when the run
finishes. (``on_train_batch_end`` would come after the step, one micro-batch too late.) Before each
batch it puts the relay's lr back into ``param_groups``, over what a configured scheduler wrote.
"""

from __future__ import annotations

from typing import Any

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - the standalone package
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    except ImportError as exc:
        raise ImportError(f"toolkit.integrations.lightning needs lightning: pip install lightning ({exc})") from exc

from toolkit.integrations.hooks import batch_size_of_call, collaborative


class CollaborativeLightningCallback(pl.Callback):
    """Notes each micro-batch's loss and size on the trainer's collaborative optimizer."""

    def __init__(self) -> None:
        self._batch_size: int | None = None

    @staticmethod
    def _optimizer(trainer: Any) -> Any:
        return collaborative(trainer.optimizers[0]) if trainer.optimizers else None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._batch_size = batch_size_of_call((batch,), {})
        opt = self._optimizer(trainer)
        if opt is not None:
            opt.restore_lr()  # a scheduler the module configured stepped after the last batch

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        opt = self._optimizer(trainer)
        if opt is not None:
            opt.note_loss(loss, self._batch_size)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        opt = self._optimizer(trainer)
        if opt is not None and opt.finished:
            trainer.should_stop = True
