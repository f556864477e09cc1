"""The training loops people already use, around :class:`~toolkit.optimizer.CollaborativeOptimizer`.

The optimizer is a ``torch.optim.Optimizer`` (:mod:`toolkit.optim_base`), so each loop takes it as
it is; what the loops do not give it is each micro-batch's loss and size (they call ``step()``
bare), nor a gradient it can trust to be a sum over those samples (they divide the loss by the
accumulation count or not, and scale it under fp16). This package notes each loss before its
backward, which fixes both (:mod:`toolkit.optim_base`):

- :func:`.hooks.watch_loss` -- hooks on the model noting the ``loss`` of its outputs (HF
  ``ModelOutput`` or a dict) and the batch size on every gradient-enabled forward; the basis of
  the others, and all an Accelerate loop needs (it finds Accelerate's GradScaler itself).
- :class:`.hf.CollaborativeCallback` -- a ``transformers.TrainerCallback``: pass the optimizer as
  ``Trainer(optimizers=(opt, None), callbacks=[CollaborativeCallback(opt)])``, and the run's data
  as ``train_dataset=run_dataset(opt)``; it stops the Trainer when the run finishes.
- :class:`.lightning.CollaborativeLightningCallback` -- a Lightning ``Callback`` for a module whose
  ``configure_optimizers`` returns the optimizer (its loss is noted in ``on_before_backward``).

Accelerate: ``accelerator.prepare(model, opt)`` wraps the optimizer in ``AcceleratedOptimizer``,
whose ``step()`` calls ours whenever gradients are synchronised (every micro-batch unless
``accelerator.accumulate`` holds them). The wrapper has no ``finished``: iterate
``opt.batches()`` (made from the optimizer itself), or read :func:`collaborative` ``(wrapped).finished``.

Nothing here imports ``transformers``, ``accelerate`` or ``lightning`` until the submodule that
needs it is imported: ``toolkit`` imports without them.
"""

from toolkit.integrations.hooks import collaborative, watch_loss

__all__ = ["collaborative", "watch_loss"]
