"""Stages of transformers' ``GPT2LMHeadModel`` (``AutoModelForCausalLM``, ``model_type = "gpt2"``,
``tie_word_embeddings = false``).

Each part runs as ``GPT2Model.forward`` of the installed transformers (5.x) runs it: stage 0
adds token and position embeddings and applies the embedding dropout; every stage builds the
causal mask with ``create_causal_mask`` from its own input (it reads only the shape, dtype and
device, so every stage builds the mask the whole model would) and calls its blocks with the same
arguments, without a cache; the last stage applies ``ln_f``, ``lm_head`` and the model's own
``loss_function`` with the batch's labels.

Padding: the attention mask does not travel across boundaries. The causal-lm objective pads only
the end of a row (ones, then zeros) and labels those positions -100; with causal attention no
real position attends to a later one, so the real positions' outputs do not depend on the mask,
and the padded ones carry no loss: the staged loss and gradients equal the whole model's. Any
other mask is refused rather than silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from toolkit.errors import ModelMismatch
from toolkit.pipeline.cuts import Anatomy
from toolkit.pipeline.stage import Stage

IGNORE_INDEX = -100
"""The label transformers' losses skip."""

BATCH_KEYS = frozenset({"input_ids", "attention_mask", "labels"})
"""What a causal-LM batch of the run's objective holds; anything else would change the forward."""


class GPT2Stage(Stage):
    anatomy = Anatomy(
        name="GPT2LMHeadModel",
        prefix=("transformer.wte", "transformer.wpe"),
        blocks="transformer.h",
        suffix=("transformer.ln_f", "lm_head"),
    )
    # transformers' GPT2LMHeadModel (matches() checks the class by name, without importing it):
    # its config, transformer and lm_head are used as transformers defines them, untyped here
    body: Any

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return any(
            c.__name__ == "GPT2LMHeadModel" and c.__module__.startswith("transformers.") for c in type(model).__mro__
        )

    @staticmethod
    def tie_hint(model: Any) -> str | None:
        tied = model.config.tie_word_embeddings or model.lm_head.weight is model.transformer.wte.weight
        return "set tie_word_embeddings = false in [model] config" if tied else None

    @staticmethod
    def check(model: Any) -> None:
        if model.config.add_cross_attention or not getattr(model.config, "is_causal", True):
            raise ModelMismatch(
                "not_cuttable",
                "pipeline stages cut GPT-2 as a causal decoder only (this config has "
                "cross-attention or is not causal)",
                "Set add_cross_attention = false in [model] config, or train this model without [pipeline].",
            )

    @staticmethod
    def num_layers(model: Any) -> int:
        return len(model.transformer.h)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        t = self.body.transformer
        return t.drop(t.wte(tokens) + t.wpe(_positions(tokens)))

    def run_blocks(self, h: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        position_ids = _positions(h)
        mask = create_causal_mask(
            config=self.body.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=position_ids
        )
        for block in self.blocks:
            h = block(h, None, mask, None, encoder_attention_mask=None, use_cache=False, position_ids=position_ids)
        return h

    def head_loss(self, h: torch.Tensor, batch: Any) -> torch.Tensor:
        labels = self._checked(batch).get("labels")
        if labels is None:
            raise ModelMismatch(
                "no_loss",
                "the last GPT-2 stage got a batch without labels",
                "Give the batches labels (the run's causal-lm objective adds them).",
            )
        logits = self.body.lm_head(self.body.transformer.ln_f(h))
        return self.body.loss_function(logits, labels, vocab_size=self.body.config.vocab_size)

    def tokens(self, batch: Any) -> torch.Tensor:
        return self._checked(batch)["input_ids"]

    @staticmethod
    def _checked(batch: Any) -> Mapping[str, torch.Tensor]:
        """The batch, refused unless the stages compute exactly what the whole model would."""
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            raise ModelMismatch(
                "bad_batch",
                f"a GPT-2 stage takes dict batches with input_ids, got "
                f"{sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__}",
                "Feed the run's causal-lm objective batches (input_ids, attention_mask, labels).",
            )
        extra = sorted(set(batch) - BATCH_KEYS)
        if extra:
            raise ModelMismatch(
                "bad_batch",
                f"a GPT-2 stage cannot pass {extra} across stage boundaries",
                "Feed batches with only input_ids, attention_mask and labels.",
            )
        mask = batch.get("attention_mask")
        if mask is not None and not bool((mask == 1).all()):
            right_padded = bool(((mask == 0) | (mask == 1)).all()) and bool((mask[:, 1:] <= mask[:, :-1]).all())
            labels = batch.get("labels")
            unlabelled = labels is None or bool((labels[mask == 0] == IGNORE_INDEX).all())
            if not (right_padded and unlabelled):
                raise ModelMismatch(
                    "bad_batch",
                    "a GPT-2 stage honours an attention_mask only as the causal-lm "
                    "objective pads: ones then zeros at the end of a row, labels -100 there",
                    "Use the run's causal-lm objective batches, or drop the padded rows.",
                )
        return batch


def _positions(x: torch.Tensor) -> torch.Tensor:
    """GPT2Model's default ``position_ids`` without a cache: 0..t-1, [1, t]."""
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)
