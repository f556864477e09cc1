"""The training loops people already use, around :class:`~toolkit.optimizer.CollaborativeOptimizer`.

The optimizer is a ``torch.optim.Optimizer`` (:mod:`toolkit.optim_base`), so each loop takes it as
it is; what the loops do not give it is each micro-batch's loss and size (they call ``step()``
bare), and the relay's chart would read 0. This package notes them before the step:

- :func:`.hooks.watch_loss` -- a forward hook on the model noting the ``loss`` of its outputs (HF
  ``ModelOutput`` or a dict) and the batch size; the basis of the others, and all a plain
  Accelerate loop needs.
- :class:`.hf.CollaborativeCallback` -- a ``transformers.TrainerCallback``: pass the optimizer as
  ``Trainer(optimizers=(opt, None), callbacks=[CollaborativeCallback(opt)])``; it stops the
  Trainer when the run finishes.
- :class:`.lightning.CollaborativeLightningCallback` -- a Lightning ``Callback`` for a module whose
  ``configure_optimizers`` returns the optimizer (its loss is noted in ``on_before_backward``).

Accelerate: ``accelerator.prepare(model, opt)`` wraps the optimizer in ``AcceleratedOptimizer``,
whose ``step()`` calls ours whenever gradients are synchronised (every micro-batch unless
``accelerator.accumulate`` holds them); no flag is needed. Its ``step()`` forwards no loss and the
wrapper has no ``note_loss``: use :func:`.hooks.watch_loss` or ``collaborative(opt).note_loss``.
Under gradient accumulation note every micro-batch: ``step()`` sums their sizes.

Nothing here imports ``transformers``, ``accelerate`` or ``lightning`` until the submodule that
needs it is imported: ``toolkit`` imports without them.
"""

from toolkit.integrations.hooks import collaborative, watch_loss

__all__ = ["collaborative", "watch_loss"]
