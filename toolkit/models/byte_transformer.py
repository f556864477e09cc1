"""A small byte-level GPT: the demo model (a few million parameters, trains on CPU).

Bytes are tokens (vocabulary 256), so the demo needs no tokenizer download. Pre-norm blocks with
causal self-attention via ``scaled_dot_product_attention`` and, by default, tied input/output
embeddings. ``tie_embeddings = false`` gives the output its own head, registered last: a staged
pipeline (:mod:`toolkit.pipeline`) needs it, since the first and last stages live on different
machines and cannot share one matrix.

It also speaks the causal-LM dialect of ``transformers`` (``model(input_ids=..., labels=...)``
-> ``.loss``, ``.logits``), so a run may give it a trained tokenizer (``vocab_size`` its size)
and ``[objective] name = "causal-lm"``: the objective's dict batches then train it through
:func:`toolkit.models.loss_of`, and the relay's evaluation scores it, as any decoder of
``transformers``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    vocab_size: int = 256
    """Byte-level: every byte value is a token."""
    seq_len: int = 64
    """Context length in bytes."""
    d_model: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_ff: int = 1024
    tie_embeddings: bool = True
    """Share the token embedding with the output projection; False adds ``head`` after ``ln_f``."""


@dataclass(frozen=True)
class CausalLMOutput:
    """What a ``transformers`` causal LM returns, as far as the toolkit reads it."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class Block(nn.Module):
    """``x + attn(ln1(x))``, then ``x + ff(ln2(x))``; ``ff`` is the dense feed-forward
    ``d_model -> d_ff -> d_model`` unless another module (a mixture of experts) is given."""

    def __init__(self, cfg: TransformerConfig, ff: nn.Module | None = None) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.ff = (
            ff
            if ff is not None
            else nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, cfg.d_model))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, t, d/heads]
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.ff(self.ln2(x))


class ByteTransformer(nn.Module):
    """``forward(tokens [b, t]) -> logits [b, t, vocab]``; ``loss(batch [b, t+1])`` is next-token
    CE; ``forward(input_ids=..., labels=...)`` is the ``transformers`` dialect (module docstring).

    ``feed_forward(layer) -> module`` replaces block ``layer``'s dense feed-forward (a subclass's
    hook: :class:`~toolkit.models.dmoe_lm.DMoEByteLM` puts mixtures of experts there)."""

    def __init__(self, *, feed_forward: Callable[[int], nn.Module] | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.cfg = cfg = TransformerConfig(**kwargs)
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg, feed_forward(i) if feed_forward else None) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        # Registered after ln_f, so that the flat parameter vector stays in layer order.
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)
        nn.init.normal_(self.pos, std=0.02)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self,
        tokens: torch.Tensor | None = None,
        *,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor | CausalLMOutput:
        """``tokens -> logits``, or, called as ``transformers`` calls a causal LM, its output:
        ``loss`` (with ``labels``: the mean CE of each next token whose label is not -100, the
        labels shifted here as in ``transformers``) and ``logits``. ``attention_mask`` is
        accepted and not needed: the causal-lm objective pads only a block's end, which no
        earlier position attends to, and its labels there are -100."""
        if input_ids is None:
            if tokens is None:
                raise TypeError("forward() needs tokens or input_ids")
            return self.logits(self.hidden_states(tokens))
        logits = self.logits(self.hidden_states(input_ids))
        loss = (
            None
            if labels is None
            else F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        )
        return CausalLMOutput(loss=loss, logits=logits)

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """The last block's output, [b, t, d_model]."""
        if tokens.shape[1] > self.cfg.seq_len:
            raise ValueError(
                f"{tokens.shape[1]} tokens per row, the model embeds {self.cfg.seq_len} positions: "
                "feed rows of at most seq_len tokens (the run's objective.seq_len <= model seq_len)"
            )
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return x

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The first block's input: token plus position embeddings, [b, t, d_model]."""
        return self.tok(tokens) + self.pos[: tokens.shape[1]]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output projection of the last block's activation: the tied embedding, or ``head``."""
        x = self.ln_f(x)
        return x @ self.tok.weight.T if self.head is None else self.head(x)

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        return next_byte_loss(self(batch[:, :-1]), batch)


def next_byte_loss(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` [b, t, vocab] against the next bytes ``batch[:, 1:]``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
