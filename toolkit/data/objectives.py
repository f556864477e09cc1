"""The run's ``[objective]``: texts -> the run's tokens -> packed blocks -> dict batches.

* **Tokenizer**: the run's ``tokenizer.json`` (the fast ``tokenizers`` library, no
  ``transformers`` import), fetched from the relay and checked against ``RunInfo.tokenizer_sha256``.
* **Packing**: documents are tokenized without special tokens and concatenated, each ended by a
  separator ([SEP], or the end-of-text token of a causal tokenizer), then cut into blocks of
  ``seq_len``: nothing is padded but the stream's last block (attention mask 0 there).
  Masked-LM blocks are ``[CLS] ... [SEP]``.
* **Collators** (dict batches ``input_ids``, ``attention_mask``, ``labels``):
  ``masked-lm`` masks ``mlm_probability`` of the tokens (whole words with ``whole_word_masking``)
  and replaces 80% of them with [MASK], 10% with a random token, keeps 10%; labels are -100
  everywhere else, and special tokens are never masked; the generator is seeded per peer.
  ``mlm_count = "fixed"`` (the default, as BERT's and ALBERT's own data pipelines) predicts
  exactly ``round(mlm_probability * (seq_len - 2))`` tokens in every full block; "bernoulli"
  draws each token independently (transformers' collator). Why fixed: a transformers MLM loss is
  a mean over the batch's predicted tokens, while the relay weights each micro-batch by its
  samples; with the same count in every row the two agree, so the collaboration computes exactly
  the gradient one process would on the global batch. Bernoulli counts (and whole words) vary by
  row, and the average is then the per-row mean instead, a slightly different weighting.
  ``causal-lm``: labels = input_ids (the model shifts them), -100 on padding.
  ``classification``: one (text, label) row per sequence, truncated/padded to ``seq_len``.
"""

from __future__ import annotations

import hashlib
import itertools
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from toolkit.errors import DataConfigError

OBJECTIVES = ("masked-lm", "causal-lm", "classification")
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
"""What :func:`relay_server.data.tokenizer_train` gives every tokenizer it trains."""
IGNORE_INDEX = -100
_ALIASES = {
    "pad": ("[PAD]", "<pad>"),
    "cls": ("[CLS]", "<s>", "<cls>"),
    "sep": ("[SEP]", "</s>", "<sep>"),
    "mask": ("[MASK]", "<mask>"),
    "eos": ("</s>", "<|endoftext|>", "[SEP]", "<eos>"),
}
_ENCODE_BATCH = 64  # documents per encode_batch call


@dataclass(frozen=True, kw_only=True)
class ObjectiveConfig:
    """The ``[objective]`` section, typed (the relay validates it with this class too)."""

    name: str
    """"masked-lm", "causal-lm" or "classification"."""
    seq_len: int = 128
    """Tokens per sequence, special tokens included."""
    mlm_probability: float = 0.15
    """masked-lm: the fraction of (non-special) tokens that are predicted."""
    whole_word_masking: bool = False
    """masked-lm: mask every token of a chosen word (word boundaries from the pre-tokenizer)."""
    mlm_count: str = "fixed"
    """masked-lm: "fixed" (the same number of predictions in every full block) or "bernoulli"."""
    column: str = ""
    """The text column; empty = each dataset's ``text_column``."""
    label_column: str = "label"
    """classification: the column holding the integer class."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ObjectiveConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise DataConfigError(
                "bad_objective", f"objective: unknown keys {sorted(unknown)}", f"Allowed: {sorted(known)}."
            )
        try:
            config = cls(**data)
        except TypeError as exc:
            raise DataConfigError("bad_objective", f"objective: {exc}", "Set objective.name.") from None
        if config.name not in OBJECTIVES:
            raise DataConfigError("bad_objective", f"objective.name {config.name!r} is not one of {OBJECTIVES}")
        if not isinstance(config.seq_len, int) or config.seq_len < 4:
            raise DataConfigError(
                "bad_objective", f"objective.seq_len must be an integer >= 4, got {config.seq_len!r}"
            )
        if not isinstance(config.mlm_probability, (int, float)) or not 0 < config.mlm_probability < 1:
            raise DataConfigError("bad_objective", "objective.mlm_probability must be in (0, 1)")
        if config.mlm_count not in ("fixed", "bernoulli"):
            raise DataConfigError(
                "bad_objective", f"objective.mlm_count must be fixed or bernoulli, got {config.mlm_count!r}"
            )
        if not isinstance(config.whole_word_masking, bool):
            raise DataConfigError("bad_objective", "objective.whole_word_masking must be true or false")
        return config


def tokenizer_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_tokenizer(data: bytes | str) -> Any:
    """A ``tokenizers.Tokenizer`` from the text of a ``tokenizer.json``."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise DataConfigError(
            "tokenizers_missing",
            f"this run tokenizes its text and importing tokenizers failed ({exc})",
            'pip install "collabtrain[hf]"',
        ) from None
    text = data.decode("utf-8") if isinstance(data, bytes) else data
    try:
        return Tokenizer.from_str(text)
    except Exception as exc:  # the library raises plain Exception subclasses for a bad file
        raise DataConfigError(
            "bad_tokenizer",
            f"the run's tokenizer.json cannot be loaded: {exc}",
            "Ask the organizer to retrain it (relay-server tokenizer train).",
        ) from None


@dataclass(frozen=True)
class Specials:
    """The special token ids an objective needs, found by name in the tokenizer's vocabulary."""

    pad: int | None
    cls: int | None
    sep: int | None
    mask: int | None
    eos: int | None
    all: frozenset[int]
    vocab_size: int

    @classmethod
    def of(cls, tokenizer: Any) -> "Specials":
        def find(kind: str) -> int | None:
            return next((i for t in _ALIASES[kind] if (i := tokenizer.token_to_id(t)) is not None), None)

        added = {tokenizer.token_to_id(t.content) for t in tokenizer.get_added_tokens_decoder().values() if t.special}
        ids = {k: find(k) for k in _ALIASES}
        return cls(
            **ids,
            all=frozenset(i for i in {*added, *ids.values()} if i is not None),
            vocab_size=tokenizer.get_vocab_size(),
        )


def _need(value: int | None, what: str, objective: str) -> int:
    if value is None:
        raise DataConfigError(
            "bad_tokenizer",
            f"objective {objective!r} needs a {what} token and the run's tokenizer has none",
            f"Retrain it with the special tokens {list(SPECIAL_TOKENS)}.",
        )
    return value


def encode_documents(tokenizer: Any, texts: Iterable[str]) -> Iterator[tuple[list[int], list[bool]]]:
    """Each text's token ids (no special tokens) and which of them start a word."""
    texts = iter(texts)
    while chunk := list(itertools.islice(texts, _ENCODE_BATCH)):
        for enc in tokenizer.encode_batch(chunk, add_special_tokens=False):
            words = enc.word_ids
            yield enc.ids, [i == 0 or w is None or w != words[i - 1] for i, w in enumerate(words)]


def pack_blocks(
    docs: Iterable[tuple[list[int], list[bool]]], length: int, separator: int
) -> Iterator[tuple[list[int], list[bool]]]:
    """Concatenate documents, each followed by ``separator``, and cut blocks of ``length``
    tokens; the stream's last, shorter block is yielded too (the collator pads it)."""
    ids: list[int] = []
    starts: list[bool] = []
    for doc_ids, doc_starts in docs:
        ids += doc_ids
        ids.append(separator)
        starts += doc_starts
        starts.append(True)
        while len(ids) >= length:
            yield ids[:length], starts[:length]
            del ids[:length], starts[:length]
    if ids:
        yield ids, starts


def _stack(blocks: list[tuple[list[int], list[bool]]], seq_len: int, pad: int) -> tuple[torch.Tensor, ...]:
    input_ids = torch.full((len(blocks), seq_len), pad, dtype=torch.long)
    attention = torch.zeros((len(blocks), seq_len), dtype=torch.long)
    starts = torch.zeros((len(blocks), seq_len), dtype=torch.bool)
    for row, (ids, word_starts) in enumerate(blocks):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention[row, : len(ids)] = 1
        starts[row, : len(ids)] = torch.tensor(word_starts, dtype=torch.bool)
    return input_ids, attention, starts


def mask_tokens(
    input_ids: torch.Tensor,
    special: torch.Tensor,
    *,
    probability: float,
    mask_id: int,
    random_ids: torch.Tensor,
    generator: torch.Generator,
    word_starts: torch.Tensor | None = None,
    count: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: (masked inputs, labels). ``special`` marks positions never masked;
    ``word_starts`` (whole-word masking) marks the first token of each word; ``count`` predicts
    exactly that many tokens per row (fewer where a row has fewer maskable tokens) instead of
    drawing each with ``probability``."""
    draw = torch.rand(input_ids.shape, generator=generator)
    if word_starts is not None:  # every token takes its word's draw
        pos = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        first = torch.where(word_starts, pos, torch.zeros_like(pos)).cummax(dim=1).values
        draw = draw.gather(1, first)
    if count is not None and word_starts is None:
        ranked = draw.masked_fill(special, 2.0).argsort(dim=1)[:, :count]  # the `count` lowest draws
        masked = torch.zeros_like(special).scatter_(1, ranked, True) & ~special
    else:
        masked = (draw < probability) & ~special
    labels = torch.where(masked, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    how = torch.rand(input_ids.shape, generator=generator)
    inputs = input_ids.clone()
    inputs[masked & (how < 0.8)] = mask_id
    swap = masked & (how >= 0.8) & (how < 0.9)
    inputs[swap] = random_ids[torch.randint(len(random_ids), (int(swap.sum()),), generator=generator)]
    return inputs, labels


def mlm_count(objective: ObjectiveConfig) -> int | None:
    """Predictions per full masked-LM block under ``mlm_count = "fixed"`` (None: Bernoulli)."""
    if objective.mlm_count != "fixed" or objective.whole_word_masking:
        return None
    return max(1, round(objective.mlm_probability * (objective.seq_len - 2)))


def objective_batches(
    texts: Iterable[Any], tokenizer: Any, objective: ObjectiveConfig, *, batch_size: int, seed: int | str
) -> Iterator[dict[str, torch.Tensor]]:
    """Dict batches for ``objective`` from a text stream (``(text, label)`` rows for classification)."""
    specials = Specials.of(tokenizer)
    seq_len, name = objective.seq_len, objective.name
    generator = torch.Generator().manual_seed(seed if isinstance(seed, int) else zlib.crc32(str(seed).encode()))
    if name == "classification":
        yield from _classification(texts, tokenizer, specials, seq_len, batch_size)
        return
    blocks: Iterator[tuple[list[int], list[bool]]]
    if name == "masked-lm":
        cls_id, sep = _need(specials.cls, "[CLS]", name), _need(specials.sep, "[SEP]", name)
        mask_id, pad = _need(specials.mask, "[MASK]", name), _need(specials.pad, "[PAD]", name)
        blocks = (
            (([cls_id, *ids, sep]), [True, *starts, True])
            for ids, starts in pack_blocks(encode_documents(tokenizer, texts), seq_len - 2, sep)
        )
        random_ids = torch.tensor(sorted(set(range(specials.vocab_size)) - specials.all), dtype=torch.long)
    else:
        sep = _need(specials.eos, "end-of-text", name)
        pad = specials.pad if specials.pad is not None else sep
        blocks = pack_blocks(encode_documents(tokenizer, texts), seq_len, sep)
    special_ids = torch.tensor(sorted(specials.all), dtype=torch.long)
    while chunk := list(itertools.islice(blocks, batch_size)):
        input_ids, attention, starts = _stack(chunk, seq_len, pad)
        if name == "causal-lm":
            labels = input_ids.masked_fill(attention == 0, IGNORE_INDEX)
        else:
            special = torch.isin(input_ids, special_ids) | (attention == 0)
            input_ids, labels = mask_tokens(
                input_ids,
                special,
                probability=objective.mlm_probability,
                mask_id=mask_id,
                random_ids=random_ids,
                generator=generator,
                word_starts=starts if objective.whole_word_masking else None,
                count=mlm_count(objective),
            )
        yield {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def _classification(
    rows: Iterable[Any], tokenizer: Any, specials: Specials, seq_len: int, batch_size: int
) -> Iterator[dict[str, torch.Tensor]]:
    cls_id, sep = _need(specials.cls, "[CLS]", "classification"), _need(specials.sep, "[SEP]", "classification")
    pad = _need(specials.pad, "[PAD]", "classification")
    rows = iter(rows)
    while chunk := list(itertools.islice(rows, batch_size)):
        if not all(isinstance(r, tuple) and len(r) == 2 for r in chunk):
            raise DataConfigError(
                "no_labels",
                "objective classification needs (text, label) rows",
                "Set objective.label_column to the dataset's label column.",
            )
        encodings = tokenizer.encode_batch([text for text, _ in chunk], add_special_tokens=False)
        ids = [[cls_id, *enc.ids[: seq_len - 2], sep] for enc in encodings]
        input_ids, attention, _ = _stack([(row, [True] * len(row)) for row in ids], seq_len, pad)
        yield {
            "input_ids": input_ids,
            "attention_mask": attention,
            "labels": torch.tensor([int(label) for _, label in chunk], dtype=torch.long),
        }
