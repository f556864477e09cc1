"""Stages of the toolkit's :class:`~toolkit.models.ByteTransformer` (with ``tie_embeddings = false``).

Batches are LongTensors [b, t+1] of bytes: stage 0 embeds ``batch[:, :-1]``, the last stage
scores the next bytes ``batch[:, 1:]``, each with the model's own ``embed``, blocks, ``logits``
and :func:`~toolkit.models.byte_transformer.next_byte_loss`.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from toolkit.errors import ModelMismatch
from toolkit.models.byte_transformer import ByteTransformer, next_byte_loss
from toolkit.pipeline.cuts import Anatomy
from toolkit.pipeline.stage import Stage


class ByteStage(Stage):
    anatomy = Anatomy(name="ByteTransformer", prefix=("tok", "pos"), blocks="blocks", suffix=("ln_f", "head"))
    body: ByteTransformer  # what matches() accepted (the static methods' casts say the same)

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return isinstance(model, ByteTransformer)

    @staticmethod
    def tie_hint(model: nn.Module) -> str | None:
        tied = cast(ByteTransformer, model).cfg.tie_embeddings
        return "set tie_embeddings = false in [model] kwargs" if tied else None

    @staticmethod
    def num_layers(model: nn.Module) -> int:
        return cast(ByteTransformer, model).cfg.n_layer

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.body.embed(tokens)

    def run_blocks(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return h

    def head_loss(self, h: torch.Tensor, batch: Any) -> torch.Tensor:
        return next_byte_loss(self.body.logits(h), self._checked(batch))

    def tokens(self, batch: Any) -> torch.Tensor:
        return self._checked(batch)[:, :-1]

    @staticmethod
    def _checked(batch: Any) -> torch.Tensor:
        """The batch, refused unless it is bytes [b, t+1] (t >= 1)."""
        if isinstance(batch, torch.Tensor) and batch.dim() == 2 and batch.dtype == torch.long and batch.shape[1] >= 2:
            return batch
        what = type(batch).__name__
        if isinstance(batch, torch.Tensor):
            what = f"a {tuple(batch.shape)} {batch.dtype} tensor"
        raise ModelMismatch(
            "bad_batch",
            f"a ByteTransformer stage takes LongTensor batches [b, t+1] of bytes, got {what}",
            "Feed the run's byte batches (toolkit.data), or tokens as a LongTensor.",
        )
