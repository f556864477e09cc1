"""Stages of a transformers causal decoder: embeddings, a run of its blocks, final norm and head.

Every decoder ``AutoModelForCausalLM`` builds runs the same way: a *trunk* module holds the token
embedding (GPT-2 also a learned position embedding, GPT-NeoX and GPT-2 an embedding dropout), a
``ModuleList`` of blocks, the final norm and, for rotary models, the module computing the rotary
``(cos, sin)`` from the position ids; the ``lm_head`` sits beside the trunk, and the model's own
``loss_function`` scores the logits. What differs between families is only where those modules
live and how a block is called: :class:`Family` records that (the table is
:mod:`toolkit.pipeline.families`), and :class:`DecoderStage` runs a stage's part exactly as the
installed transformers' (5.x) model forward runs it:

* stage 0 embeds the tokens (adding position embeddings and applying the embedding dropout
  where the family does);
* every stage takes the default position ids ``0..t-1`` (no cache), computes the rotary
  embeddings from them with the model's own rotary module and builds the causal mask of each of
  its blocks' attention kind (full, or sliding-window for Mistral and Qwen's sliding layers) with
  transformers' own ``create_causal_mask`` / ``create_sliding_window_causal_mask`` from its own
  input: both read only its shape, dtype and device, so each stage builds what the whole model
  builds once;
* the last stage applies the final norm, ``lm_head`` and ``loss_function`` with the batch's labels.

Padding: the attention mask does not travel across boundaries. The causal-lm objective pads only
the end of a row (ones, then zeros) and labels those positions -100; with causal attention no
real position attends to a later one, so the real positions' outputs do not depend on the mask,
and the padded ones carry no loss: the staged loss and gradients equal the whole model's. Any
other mask is refused rather than silently ignored.

Rotary modules keep ``inv_freq`` as a (non-persistent) buffer, which a stage built on the meta
device has no values for: :meth:`DecoderStage.restore_buffers` builds the module again on the
stage's device from the model's config, as the model's constructor did.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from toolkit.errors import ModelMismatch
from toolkit.pipeline.cuts import Anatomy
from toolkit.pipeline.stage import Stage

IGNORE_INDEX = -100
"""The label transformers' losses skip."""

BATCH_KEYS = frozenset({"input_ids", "attention_mask", "labels"})
"""What a causal-LM batch of the run's objective holds; anything else would change the forward."""

Call = Callable[[nn.Module, torch.Tensor, Any, torch.Tensor, Any], torch.Tensor]
"""How a family's forward calls one block: ``(block, hidden, mask, position_ids, rotary)``."""


@dataclass(frozen=True)
class Family:
    """Where one family of decoders keeps its parts (attribute names under ``trunk``) and how its
    model forward calls a block."""

    name: str
    """The family as messages name it."""
    classes: tuple[str, ...]
    """The transformers ``*ForCausalLM`` classes of this family (matched by name)."""
    model_types: tuple[str, ...]
    """Their ``model_type``s, for the refusal that lists what can be cut."""
    trunk: str
    embed: str
    blocks: str
    norm: str
    call: Call
    positions: str | None = None
    """A learned position embedding added to the token embedding (GPT-2's ``wpe``)."""
    dropout: str | None = None
    """The embedding dropout applied before block 0."""
    rotary: str | None = None
    """The module computing the rotary ``(cos, sin)`` the blocks take."""
    sliding_everywhere: bool = False
    """Every block attends within ``config.sliding_window`` when it is set (Mistral); otherwise a
    block's kind is ``config.layer_types[i]`` where the config has them (Qwen), else full."""
    head: str = "lm_head"

    @property
    def anatomy(self) -> Anatomy:
        prefix = tuple(f"{self.trunk}.{m}" for m in (self.embed, self.positions) if m)
        return Anatomy(
            name=f"{self.name} decoder",
            prefix=prefix,
            blocks=f"{self.trunk}.{self.blocks}",
            suffix=(f"{self.trunk}.{self.norm}", self.head),
        )

    def attention_kind(self, config: Any, layer: int) -> str:
        """The mask block ``layer`` (its index in the whole model) attends with."""
        if self.sliding_everywhere:
            return "full_attention" if getattr(config, "sliding_window", None) is None else "sliding_attention"
        kinds = getattr(config, "layer_types", None)
        return str(kinds[layer]) if kinds else "full_attention"


class DecoderStage(Stage):
    """A stage of a transformers decoder of :attr:`family`."""

    family: ClassVar[Family]
    # the transformers model (matches() checks the class by name, without importing it): its
    # config, trunk, head and loss_function are used as transformers defines them, untyped here
    body: Any

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return any(
            c.__name__ in cls.family.classes and c.__module__.startswith("transformers.") for c in type(model).__mro__
        )

    @classmethod
    def tie_hint(cls, model: Any) -> str | None:
        trunk = getattr(model, cls.family.trunk)
        head, embed = getattr(model, cls.family.head), getattr(trunk, cls.family.embed)
        tied = bool(getattr(model.config, "tie_word_embeddings", False)) or head.weight is embed.weight
        return "set tie_word_embeddings = false in [model] config" if tied else None

    @classmethod
    def tied_pair(cls, model: Any) -> tuple[str, str] | None:
        f = cls.family
        head, embed = getattr(model, f.head), getattr(getattr(model, f.trunk), f.embed)
        if head.weight is not embed.weight or getattr(head, "bias", None) is not None:
            return None
        return f"{f.trunk}.{f.embed}.weight", f"{f.head}.weight"

    @classmethod
    def check(cls, model: Any) -> None:
        """Refuse a model whose parts are not where :attr:`family` says (another transformers
        version moved them): its stages would silently run something else."""
        f = cls.family
        trunk = getattr(model, f.trunk, None)
        blocks = getattr(trunk, f.blocks, None)
        found = (
            isinstance(blocks, nn.ModuleList)
            and model.get_input_embeddings() is getattr(trunk, f.embed, None)
            and model.get_output_embeddings() is getattr(model, f.head, None)
            and isinstance(getattr(trunk, f.norm, None), nn.Module)
            and all(getattr(trunk, m, None) is not None for m in (f.positions, f.dropout, f.rotary) if m)
        )
        if not found:
            raise ModelMismatch(
                "not_cuttable",
                f"this {type(model).__name__} does not keep its parts where the {f.name} stages look for "
                f"them ({f.anatomy.prefix[0]}, {f.anatomy.blocks}, {', '.join(f.anatomy.suffix)})",
                "Install the transformers version the toolkit supports (5.x), or train without [pipeline].",
            )

    @classmethod
    def num_layers(cls, model: Any) -> int:
        return len(getattr(getattr(model, cls.family.trunk), cls.family.blocks))

    @property
    def trunk(self) -> Any:
        return getattr(self.body, self.family.trunk)

    def restore_buffers(self, device: torch.device | str) -> None:
        """Rebuild the rotary module on ``device`` from the model's config (its ``inv_freq`` is a
        buffer computed at construction); any other buffer is refused."""
        rotary = self.family.rotary
        if rotary is not None:
            with torch.device(device):
                setattr(self.trunk, rotary, type(getattr(self.trunk, rotary))(config=self.body.config))
        prefix = f"{self.family.trunk}.{rotary}." if rotary else None
        others = [
            name
            for name, _ in self.body.named_buffers()
            if name != self.tied_name and (prefix is None or not name.startswith(prefix))
        ]
        if others:
            raise ModelMismatch(
                "not_cuttable",
                f"this {self.anatomy.name} stage has buffers ({others[0]}), which a stage built on the "
                "meta device cannot restore",
                "Train this model without [pipeline].",
            )

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        t, f = self.trunk, self.family
        h = getattr(t, f.embed)(tokens)
        if f.positions:
            h = h + getattr(t, f.positions)(_positions(tokens))
        return getattr(t, f.dropout)(h) if f.dropout else h

    def run_blocks(self, h: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        config, f = self.body.config, self.family
        position_ids = _positions(h)
        build = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        kinds = [f.attention_kind(config, i) for i in range(self.cut.first_layer, self.cut.end_layer)]
        masks = {
            kind: build[kind](
                config=config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=position_ids
            )
            for kind in dict.fromkeys(kinds)
        }
        rotary = getattr(self.trunk, f.rotary)(h, position_ids=position_ids) if f.rotary else None
        for block, kind in zip(self.blocks, kinds, strict=True):
            h = f.call(block, h, masks[kind], position_ids, rotary)
        return h

    def head_loss(self, h: torch.Tensor, batch: Any) -> torch.Tensor:
        labels = self._checked(batch).get("labels")
        if labels is None:
            raise ModelMismatch(
                "no_loss",
                f"the last {self.family.name} stage got a batch without labels",
                "Give the batches labels (the run's causal-lm objective adds them).",
            )
        logits = getattr(self.body, self.family.head)(getattr(self.trunk, self.family.norm)(h))
        return self.body.loss_function(logits=logits, labels=labels, vocab_size=self.body.config.vocab_size)

    def tokens(self, batch: Any) -> torch.Tensor:
        return self._checked(batch)["input_ids"]

    def _checked(self, batch: Any) -> Mapping[str, torch.Tensor]:
        """The batch, refused unless the stages compute exactly what the whole model would."""
        name = self.family.name
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            raise ModelMismatch(
                "bad_batch",
                f"a {name} stage takes dict batches with input_ids, got "
                f"{sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__}",
                "Feed the run's causal-lm objective batches (input_ids, attention_mask, labels).",
            )
        extra = sorted(set(batch) - BATCH_KEYS)
        if extra:
            raise ModelMismatch(
                "bad_batch",
                f"a {name} stage cannot pass {extra} across stage boundaries",
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
                    f"a {name} stage honours an attention_mask only as the causal-lm "
                    "objective pads: ones then zeros at the end of a row, labels -100 there",
                    "Use the run's causal-lm objective batches, or drop the padded rows.",
                )
        return batch


def _positions(x: torch.Tensor) -> torch.Tensor:
    """The model's default ``position_ids`` without a cache: 0..t-1, [1, t]."""
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)
