"""One pipeline stage as a module: the model with everything outside its cut removed.

A :class:`Stage` wraps the full model's own object after :meth:`Stage.prune` dropped the blocks,
embeddings and head the stage does not own, so its ``parameters()`` are the kept ones in the
model's own order: exactly the flat range [``cut.start``, ``cut.end``) of the run's vector. It
runs the model's own code for its part (the subclass per architecture says how), so a chain of
stages computes what the whole model computes:

    x = stage.inputs(batch) on stage 0, the previous stage's boundary activation otherwise
    h = stage(x)            the boundary activation [b, t, d] sent to the next stage
    loss = stage.loss(x, batch)   on the last stage: the micro-batch's mean loss

Backward through a boundary is the pipeline's: the next stage's input was
``h.detach().requires_grad_()``, so ``h.backward(x_next.grad)`` continues it; recomputing a
backward from a stored input is running the forward again first, with the same dropout masks
(:mod:`toolkit.pipeline.compute` seeds every forward of a (micro-batch, stage) alike).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from toolkit.errors import ModelMismatch
from toolkit.pipeline.cuts import Anatomy, StageCut


class Stage(nn.Module):
    """Stage ``cut.index`` of ``cut.num_stages``: ``first`` embeds the batch's tokens, ``last``
    owns the loss; every stage runs its blocks."""

    anatomy: ClassVar[Anatomy]

    def __init__(self, model: nn.Module, cut: StageCut) -> None:
        super().__init__()
        self.cut = cut
        self.index, self.num_stages = cut.index, cut.num_stages
        self.first, self.last = cut.first, cut.last
        self.prune(model, cut)
        self.body = model

    @classmethod
    def prune(cls, model: nn.Module, cut: StageCut) -> None:
        """Drop from ``model`` (in place) every block, embedding and head outside ``cut``. Kept
        modules keep their registration order, so the parameters' order is the flat one, and
        their names: the kept blocks go into a ``ModuleDict`` under their own indices, so that
        :meth:`param_names` are the run's layout names of the stage's range."""
        parent, _, leaf = cls.anatomy.blocks.rpartition(".")
        owner = model.get_submodule(parent)
        blocks = list(getattr(owner, leaf))
        setattr(owner, leaf, nn.ModuleDict({str(i): blocks[i] for i in range(cut.first_layer, cut.end_layer)}))
        dropped = (() if cut.first else cls.anatomy.prefix) + (() if cut.last else cls.anatomy.suffix)
        for path in dropped:
            parent, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent), leaf, None)

    # --- what each architecture says --------------------------------------------------------------
    @staticmethod
    def matches(model: nn.Module) -> bool:
        """Whether ``model`` is of this stage's architecture."""
        raise NotImplementedError

    @staticmethod
    def tie_hint(model: nn.Module) -> str | None:
        """What to set when ``model`` ties its input and output embeddings (None: untied)."""
        raise NotImplementedError

    @staticmethod
    def check(model: nn.Module) -> None:
        """Refuse a configuration of this architecture that its stages cannot run (none by default)."""

    @staticmethod
    def num_layers(model: nn.Module) -> int:
        """The number of blocks of the full ``model``."""
        raise NotImplementedError

    def restore_buffers(self, device: torch.device | str) -> None:
        """Give the stage's buffers their values on ``device`` after it was built on the meta
        device (where a buffer has no values); a stage with buffers it cannot restore is refused."""
        if any(True for _ in self.buffers()):
            raise ModelMismatch(
                "not_cuttable",
                f"this {self.anatomy.name} stage has buffers, which a stage built on the meta device cannot restore",
                "Train this model without [pipeline].",
            )

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Stage 0: the first block's input from the tokens."""
        raise NotImplementedError

    def run_blocks(self, h: torch.Tensor) -> torch.Tensor:
        """This stage's blocks, called as the model's own forward calls them."""
        raise NotImplementedError

    def head_loss(self, h: torch.Tensor, batch: Any) -> torch.Tensor:
        """Last stage: the model's own loss from the last block's output."""
        raise NotImplementedError

    def tokens(self, batch: Any) -> torch.Tensor:
        """The model's input tokens from a data batch (refusing what the stages cannot honour)."""
        raise NotImplementedError

    # --- the pipeline's calls ---------------------------------------------------------------------
    def inputs(self, batch: Any) -> torch.Tensor:
        """Stage 0's input: the tokens of a data batch (any other stage's is the boundary before it)."""
        if not self.first:
            raise ValueError(
                f"stage {self.index}'s input is stage {self.index - 1}'s boundary activation, not a "
                "data batch: only stage 0 reads batches"
            )
        return self.tokens(batch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The boundary activation [b, t, d] after this stage's blocks (the tokens in on stage 0)."""
        return self.run_blocks(self.embed(x) if self.first else x)

    def loss(self, x: torch.Tensor, batch: Any) -> torch.Tensor:
        """The micro-batch's mean loss from this (last) stage's input ``x``: what
        ``toolkit.models.loss_of(full_model, batch)`` computes."""
        if not self.last:
            raise ValueError(f"stage {self.index} of {self.num_stages} has no loss: the last stage computes it")
        return self.head_loss(self(x), batch)

    # --- the stage's slice of the flat vector -----------------------------------------------------
    @property
    def blocks(self) -> list[nn.Module]:
        """This stage's blocks, in order."""
        parent, _, leaf = self.anatomy.blocks.rpartition(".")
        return list(getattr(self.body.get_submodule(parent), leaf).values())

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def param_names(self) -> list[str]:
        """The parameters' names in the full model, in flat order: the run's layout names of
        [``cut.start``, ``cut.end``)."""
        return [name for name, _ in self.body.named_parameters()]

    @torch.no_grad()
    def load_flat(self, values: torch.Tensor | np.ndarray) -> None:
        """Set the parameters from the run's flat slice [``cut.start``, ``cut.end``)."""
        flat = torch.as_tensor(values).reshape(-1)
        if flat.numel() != self.cut.numel:
            raise ValueError(
                f"stage {self.index} holds {self.cut.numel} parameters and got {flat.numel()} values: "
                f"pass the run's flat slice [{self.cut.start}, {self.cut.end})"
            )
        offset = 0
        for p in self.parameters():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def flat_grad(self) -> torch.Tensor:
        """The stage's gradient in flat order (zeros for a parameter without one), float32 on the CPU."""
        return torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float().cpu()
                for p in self.parameters()
            ]
        )
