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
        pair = self.tied_pair(model) if cut.tied is not None or (cut.first and cut.last) else None
        self.shared = pair if cut.first and cut.last else None
        """A single stage's tied pair, one Parameter in the model (:meth:`retie` after allocating)."""
        if cut.tied is not None and pair is None:
            raise ModelMismatch(
                "stage_mismatch",
                f"stage cut {cut} reads a tied embedding this {self.anatomy.name} does not have",
                "Cut the stages from the run's own model: cut_stages(units_of(spec), layers_per_stage).",
            )
        self.prune(model, cut)
        self.body = model
        self.tied: tuple[int, int] | None = cut.tied
        """Stage 0's flat range of the tied embedding this (last) stage's head reads, or None."""
        self.tied_name: str | None = None
        """The head's weight, here a buffer holding the copy (not a parameter: not in the range)."""
        if pair is not None and self.shared is None:
            # the pruned embedding's Parameter is still the head's weight: swap it for a buffer,
            # so that parameters() is exactly [cut.start, cut.end) and the copy is loaded apart
            self.tied_name = pair[1]
            path, _, leaf = pair[1].rpartition(".")
            head = model.get_submodule(path)
            shape = getattr(head, leaf)
            delattr(head, leaf)
            head.register_buffer(leaf, torch.empty_like(shape), persistent=False)

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

    @classmethod
    def tied_pair(cls, model: nn.Module) -> tuple[str, str] | None:
        """When ``model``'s output head IS its input embedding (one Parameter) and its stages can
        run that: the two parameters' names (embedding, head). None: the stages cannot."""
        return None

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
        if any(name != self.tied_name for name, _ in self.body.named_buffers()):
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

    def retie(self) -> None:
        """A single stage of a tied model: make the head's weight the embedding's Parameter again
        (allocating a module, ``to_empty``, gives each of them its own)."""
        if self.shared is not None:
            embed, head = self.shared
            path, _, leaf = head.rpartition(".")
            setattr(self.body.get_submodule(path), leaf, self.body.get_parameter(embed))

    def tied_weight(self) -> torch.Tensor:
        """The last stage's copy of the tied embedding (what its head multiplies by)."""
        if self.tied_name is None:
            raise ValueError(f"stage {self.index} of {self.num_stages} reads no tied embedding")
        path, _, leaf = self.tied_name.rpartition(".")
        return getattr(self.body.get_submodule(path), leaf)

    @torch.no_grad()
    def load_tied(self, values: torch.Tensor | np.ndarray) -> None:
        """Set the head's copy of the tied embedding from stage 0's flat slice ``tied`` (of the
        same version as this stage's own); its gradient then accumulates in :meth:`tied_grad`."""
        current = self.tied_weight()
        flat = torch.as_tensor(values).reshape(-1)
        if flat.numel() != current.numel():
            raise ValueError(
                f"stage {self.index}'s tied embedding holds {current.numel()} values and got {flat.numel()}: "
                f"pass stage 0's flat slice [{self.tied[0] if self.tied else 0}, {self.tied[1] if self.tied else 0})"
            )
        copy = flat.to(current.device, current.dtype).view_as(current).clone().requires_grad_()
        path, _, leaf = (self.tied_name or "").rpartition(".")
        self.body.get_submodule(path).register_buffer(leaf, copy, persistent=False)

    def tied_grad(self) -> torch.Tensor:
        """The head's gradient for the tied embedding, float32 on the CPU (zeros before any
        backward): stage 0's embedding gradient plus this is the whole model's, as one process sums them."""
        weight = self.tied_weight()
        grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
        return grad.detach().reshape(-1).float().cpu()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self.tied_name is not None:
            self.tied_weight().grad = None

    def flat_grad(self) -> torch.Tensor:
        """The stage's gradient in flat order (zeros for a parameter without one), float32 on the CPU."""
        return torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float().cpu()
                for p in self.parameters()
            ]
        )
