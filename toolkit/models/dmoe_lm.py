"""A language model whose Transformer layers' feed-forward blocks are decentralized mixtures of
experts: Learning@home's language-model experiment (s4.3) on the toolkit's own decoder.

:class:`DMoEByteLM` is the :class:`~toolkit.models.byte_transformer.ByteTransformer` (pre-norm
causal attention, tied embeddings, the ``transformers`` causal-LM dialect, so a run's tokenizer
and ``[objective] name = "causal-lm"`` train it) with block ``l``'s dense feed-forward replaced by
a :class:`~toolkit.moe.layer.RemoteMixtureOfExperts` over the grid ``f"{uid_prefix}{l}"``:
token-level routing, every token of every row choosing its own top-``k`` experts. The experts are
the paper's FFN block (``toolkit.moe.experts``, ``[moe] expert.kind = "ffn"``) and live on
expert hosts; only the dense parts -- embeddings, attention, norms, gates (and ``head`` when
untied) -- are this module's parameters, the run's flat vector trained in DeDLOC rounds.

Why the toolkit's decoder and not a ``transformers`` GPT-2: the relay builds a run's model from
data and volunteers install nothing beyond the toolkit, so the mixture must replace a submodule
whose call signature the toolkit owns; a GPT-2's MLP is called with transformers-internal
arguments that change between its releases, and ``transformers`` is an optional extra.

Block ``l`` computes ``x + moe_l(ln2(x))`` where a dense block has ``x + ff(ln2(x))``; the FFN
expert keeps its own residual (it starts near the identity), and a token whose chosen experts all
failed gets zero from the mixture, so it keeps ``x`` (the same rule as :class:`DMoEMLP`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from toolkit.models.byte_transformer import ByteTransformer, CausalLMOutput
from toolkit.models.dmoe import ExpertModel, expert_layers
from toolkit.moe.calls import ExpertCaller
from toolkit.moe.layer import RemoteMixtureOfExperts


class DMoEByteLM(ExpertModel, ByteTransformer):
    """``forward(tokens [b, t]) -> logits [b, t, vocab_size]``; ``loss(batch [b, t+1])`` and
    ``forward(input_ids=..., labels=...).loss`` are the next-token CE plus ``balancing_coef``
    times the mixtures' mean balancing loss.

    The mixture arguments are :class:`~toolkit.models.DMoEMLP`'s, named alike so that one
    ``[moe]`` section describes either model: ``hidden`` (the model width, which is the experts'
    ``d``), ``expert_hidden``, ``layers``, ``grid``, ``k``, ``k_min``, ``uid_prefix``,
    ``expert_seed``, the timeouts and ``beam_size``; ``heads``, ``seq_len`` (positions
    embedded), ``vocab_size`` and ``tie_embeddings`` are the decoder's.
    """

    def __init__(
        self,
        *,
        vocab_size: int = 256,
        seq_len: int = 64,
        hidden: int = 64,
        heads: int = 4,
        layers: int = 2,
        grid: Sequence[int] = (4, 4),
        k: int = 4,
        k_min: int = 1,
        expert_hidden: int = 256,
        uid_prefix: str = "ffn",
        timeout_s: float = 30.0,
        backward_timeout_s: float | None = None,
        timeout_after_k_min_s: float | None = None,
        balancing_coef: float = 0.01,
        expert_seed: int = 0,
        beam_size: int | None = None,
        tie_embeddings: bool = True,
        caller: ExpertCaller | None = None,
    ) -> None:
        mixtures = expert_layers(
            layers,
            hidden,
            grid,
            k,
            caller,
            uid_prefix,
            k_min,
            timeout_s,
            backward_timeout_s=backward_timeout_s,
            timeout_after_k_min_s=timeout_after_k_min_s,
            beam_size=beam_size,
        )
        super().__init__(
            feed_forward=mixtures.__getitem__,
            vocab_size=vocab_size,
            seq_len=seq_len,
            d_model=hidden,
            n_layer=layers,
            n_head=heads,
            d_ff=expert_hidden,
            tie_embeddings=tie_embeddings,
        )
        self.hidden, self.expert_hidden, self.expert_seed = hidden, expert_hidden, expert_seed
        self.balancing_coef = balancing_coef

    # read-only here, where ExpertModel declares an attribute: nothing assigns it on this model
    @property
    def moe(self) -> list[RemoteMixtureOfExperts]:  # type: ignore[override]
        """The mixture of each block, in layer order (registered in the blocks, not twice)."""
        return [cast(RemoteMixtureOfExperts, block.ff) for block in self.blocks]  # what feed_forward put there

    def forward(self, tokens: torch.Tensor | None = None, **hf: torch.Tensor | None) -> torch.Tensor | CausalLMOutput:
        out = super().forward(tokens, **hf)
        if isinstance(out, CausalLMOutput) and out.loss is not None:
            return CausalLMOutput(loss=out.loss + self.balancing(), logits=out.logits)
        return out

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        return super().loss(batch) + self.balancing()
