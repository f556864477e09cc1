"""The transformers decoders a pipeline can cut, as a table of where their parts live and how
their model forward calls a block (:class:`~toolkit.pipeline.decoder.Family`).

Three call conventions cover them in the installed transformers (5.x):

* GPT-2 (``GPT2LMHeadModel``): learned position embeddings added to the token embedding, an
  embedding dropout, blocks called ``block(h, cache, mask, encoder_states, ...)``, no rotary;
* Llama-style (``Llama``, ``Mistral``, ``Qwen2``, ``Qwen3``): one code path -- ``model.embed_tokens``,
  ``model.layers`` called with ``attention_mask``, ``position_embeddings`` and ``position_ids``,
  ``model.norm``; they differ only in which mask a layer takes (Mistral's sliding window on every
  layer when set, Qwen's per-layer ``layer_types``), which :meth:`Family.attention_kind` reads;
* GPT-NeoX: ``gpt_neox.embed_in``, an embedding dropout, layers called with ``layer_past``,
  ``gpt_neox.final_layer_norm``.

A family whose forward does anything else (scaled embeddings as Gemma's, per-layer rotary bases,
soft-capped logits) is a new row with its own call, or is refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from toolkit.errors import ModelMismatch
from toolkit.pipeline.decoder import DecoderStage, Family


def _gpt2_call(block: nn.Module, h: torch.Tensor, mask: Any, position_ids: torch.Tensor, rotary: Any) -> torch.Tensor:
    return block(h, None, mask, None, encoder_attention_mask=None, use_cache=False, position_ids=position_ids)


def _llama_call(block: nn.Module, h: torch.Tensor, mask: Any, position_ids: torch.Tensor, rotary: Any) -> torch.Tensor:
    return block(
        h, attention_mask=mask, position_embeddings=rotary, position_ids=position_ids, cache=None, use_cache=False
    )


def _neox_call(block: nn.Module, h: torch.Tensor, mask: Any, position_ids: torch.Tensor, rotary: Any) -> torch.Tensor:
    return block(
        h, attention_mask=mask, position_ids=position_ids, layer_past=None, use_cache=False, position_embeddings=rotary
    )


GPT2 = Family(
    name="GPT-2",
    classes=("GPT2LMHeadModel",),
    model_types=("gpt2",),
    trunk="transformer",
    embed="wte",
    positions="wpe",
    dropout="drop",
    blocks="h",
    norm="ln_f",
    call=_gpt2_call,
)
LLAMA = Family(
    name="Llama-style",
    classes=("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
    model_types=("llama", "qwen2", "qwen3"),
    trunk="model",
    embed="embed_tokens",
    blocks="layers",
    norm="norm",
    rotary="rotary_emb",
    call=_llama_call,
)
MISTRAL = Family(
    name="Mistral",
    classes=("MistralForCausalLM",),
    model_types=("mistral",),
    trunk="model",
    embed="embed_tokens",
    blocks="layers",
    norm="norm",
    rotary="rotary_emb",
    call=_llama_call,
    sliding_everywhere=True,
)
GPT_NEOX = Family(
    name="GPT-NeoX",
    classes=("GPTNeoXForCausalLM",),
    model_types=("gpt_neox",),
    trunk="gpt_neox",
    embed="embed_in",
    dropout="emb_dropout",
    blocks="layers",
    norm="final_layer_norm",
    rotary="rotary_emb",
    call=_neox_call,
)


class GPT2Stage(DecoderStage):
    family = GPT2
    anatomy = GPT2.anatomy

    @classmethod
    def check(cls, model: Any) -> None:
        super().check(model)
        if model.config.add_cross_attention or not getattr(model.config, "is_causal", True):
            raise ModelMismatch(
                "not_cuttable",
                "pipeline stages cut GPT-2 as a causal decoder only (this config has "
                "cross-attention or is not causal)",
                "Set add_cross_attention = false in [model] config, or train this model without [pipeline].",
            )


class LlamaStage(DecoderStage):
    family = LLAMA
    anatomy = LLAMA.anatomy


class MistralStage(DecoderStage):
    family = MISTRAL
    anatomy = MISTRAL.anatomy


class GPTNeoXStage(DecoderStage):
    family = GPT_NEOX
    anatomy = GPT_NEOX.anatomy


DECODERS: tuple[type[DecoderStage], ...] = (GPT2Stage, LlamaStage, MistralStage, GPTNeoXStage)
"""Every transformers decoder family a pipeline cuts."""
