"""A Lightning ``Callback`` for a LightningModule whose ``configure_optimizers`` returns a
:class:`~toolkit.optimizer.CollaborativeOptimizer`.

    trainer = lightning.pytorch.Trainer(max_steps=..., callbacks=[CollaborativeLightningCallback()])

Lightning backpropagates each micro-batch's loss divided by ``accumulate_grad_batches`` and, under
fp16, multiplied by its GradScaler's scale; ``on_before_backward`` receives exactly that tensor.
The callback notes it with both factors (:meth:`~toolkit.optim_base.CollabOptimizerBase.note_loss`
``divided_by``), so the relay charts the micro-batch's mean loss and the gradient is the sum over
its samples, and gives the optimizer the precision plugin's scaler. Notes of a step the scaler
skipped go at Lightning's next ``zero_grad()``. The batch size comes from
``on_train_batch_start``; before each batch the relay's lr goes back into ``param_groups`` (over
what a configured scheduler wrote); the Trainer stops once the run has finished, and one started on
a run that had already finished raises :class:`~toolkit.errors.RunFinished` (join()'s one line).
(``on_train_batch_end`` would come after the step, one micro-batch too late to note.)
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

from toolkit.integrations.hooks import batch_size_of_call, collaborative, refuse_a_finished_run


class CollaborativeLightningCallback(pl.Callback):
    """Notes each micro-batch's loss and size on the trainer's collaborative optimizer."""

    def __init__(self) -> None:
        self._batch_size: int | None = None

    @staticmethod
    def _optimizer(trainer: Any) -> Any:
        return collaborative(trainer.optimizers[0]) if trainer.optimizers else None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        opt = self._optimizer(trainer)
        if opt is not None:
            refuse_a_finished_run(opt)  # its batches are empty: Lightning would start epoch after epoch

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._batch_size = batch_size_of_call((batch,), {})
        opt = self._optimizer(trainer)
        if opt is not None:
            opt.restore_lr()  # a scheduler the module configured stepped after the last batch

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        opt = self._optimizer(trainer)
        if opt is None:
            return
        opt.scaler = getattr(trainer.precision_plugin, "scaler", None)
        divided_by = trainer.accumulate_grad_batches / opt.loss_scale()  # loss = mean * scale / accumulation
        opt.note_loss(loss, self._batch_size, divided_by=divided_by)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        opt = self._optimizer(trainer)
        if opt is not None and opt.finished:
            trainer.should_stop = True
