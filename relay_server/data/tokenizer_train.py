"""``relay-server tokenizer train``: a ``tokenizer.json`` trained on the run's own text.

The text is what peers will read: the demo corpus's paragraphs for ``kind = "demo_corpus"``, the
streamed shards through the toolkit's own reading path (each shard once, in order) for
``kind = "stream"``. The tokenizer gets the special tokens every objective needs
(:data:`toolkit.data.objectives.SPECIAL_TOKENS`) and a ``[CLS] ... [SEP]`` post-processor.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Generator, Iterable
from typing import Any

from relay_server.core.config import ConfigError, RelayConfig
from toolkit.data.objectives import SPECIAL_TOKENS

MODELS = ("wordpiece", "bpe", "unigram")


def training_texts(config: RelayConfig, *, max_texts: int | None = None) -> Generator[str, None, None]:
    """The run's text, at most ``max_texts`` documents."""
    kind = config.dataset.get("kind") or "demo_corpus"
    if kind == "demo_corpus":
        from toolkit.corpus import demo_paragraphs

        texts: Iterable[Any] = demo_paragraphs()
    elif kind == "stream":
        from toolkit.data import LocalShardOrder, StreamConfig, stream_texts

        stream = StreamConfig.from_dict(config.dataset)
        column = str(config.objective.get("column") or "")
        stream = dataclasses.replace(
            stream,
            shuffle_buffer=1,
            datasets=tuple(
                dataclasses.replace(spec, text_column=column or spec.text_column) for spec in stream.datasets
            ),
        )
        texts = stream_texts(stream, seed=0, shard_source=lambda spec: LocalShardOrder(spec.shards(), 0, epochs=1))
    else:
        raise ConfigError(f"dataset.kind {kind!r}: tokenizer training reads demo_corpus or stream datasets")
    yield from itertools.islice(texts, max_texts)


def train_tokenizer(
    texts: Iterable[str], *, vocab_size: int = 8000, model: str = "wordpiece", lowercase: bool = False
) -> Any:
    """A ``tokenizers.Tokenizer`` with [PAD] [UNK] [CLS] [SEP] [MASK] (ids 0..4)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    if model not in MODELS:
        raise ConfigError(f"--model must be one of {MODELS}, got {model!r}")
    special = list(SPECIAL_TOKENS)
    if model == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer: Any = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False)
    elif model == "bpe":
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.normalizer = normalizers.Lowercase() if lowercase else normalizers.Sequence([])
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=special,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    else:
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.Lowercase() if lowercase else normalizers.Sequence([])
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(
            vocab_size=vocab_size, special_tokens=special, unk_token="[UNK]", show_progress=False
        )
    tok.train_from_iterator(texts, trainer)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return tok


def train_for_run(
    config: RelayConfig,
    out: str,
    *,
    vocab_size: int = 8000,
    model: str = "wordpiece",
    lowercase: bool = False,
    max_texts: int | None = None,
) -> Any:
    """Train on the run's text and write ``out`` (a ``tokenizer.json``); the tokenizer."""
    texts = training_texts(config, max_texts=max_texts)
    try:
        tok = train_tokenizer(texts, vocab_size=vocab_size, model=model, lowercase=lowercase)
    finally:
        texts.close()
    tok.save(out)
    return tok
