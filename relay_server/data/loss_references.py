"""Where a loss stands: the references the demo prints and the dashboard draws under the curve.

A newcomer sees "7.62 -> 7.26" and cannot tell whether that is learning; with the chance level
beside it (ln 2000 = 7.60) they can. The relay computes the references from what it already
knows -- the configuration and the tokenizer it serves -- so every observer shows the same ones:

* ``chance``: the cross-entropy of a uniform guess over the targets: ln of the tokenizer's
  vocabulary (or the model's ``vocab_size``) for language-model objectives, ln ``num_labels``
  for classification, ln 256 for the byte-level stream;
* ``unigram``: on the shipped demo text only, the entropy of its targets' frequencies (bytes,
  or the run's tokens): what a model that predicts each target without looking at its context
  reaches. Below it, the model uses context.

A run whose loss is no cross-entropy over a known set of targets (the MLP regression, a module
model) has none.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import Any

from toolkit.wire.protocol import LossReference

LANGUAGE_MODELS = ("masked-lm", "causal-lm")
BYTE_MODEL = "toolkit.models:ByteTransformer"


def loss_references(config: Any, tokenizer_json: bytes | None = None) -> list[LossReference]:
    """The run's references, chance level first; ``tokenizer_json`` is the file the relay serves."""
    objective = config.objective.get("name", "") if config.objective else ""
    tokenizer = _tokenizer(tokenizer_json) if tokenizer_json and objective in LANGUAGE_MODELS else None
    classes = _classes(config, objective, tokenizer)
    if classes is None:
        return []
    what = "labels" if objective == "classification" else "tokens" if objective else "bytes"
    found = [LossReference(name="chance", value=math.log(classes), label=f"chance: ln {classes} ({what})")]
    if (config.dataset.get("kind") or "demo_corpus") == "demo_corpus" and objective != "classification":
        targets = _demo_tokens(tokenizer) if objective else _demo_bytes()
        if targets is not None:
            found.append(
                LossReference(
                    name="unigram", value=unigram_entropy(targets), label=f"unigram entropy of the demo text ({what})"
                )
            )
    return found


def unigram_entropy(targets: Iterable[int]) -> float:
    """-sum p log p (nats) over the targets' frequencies."""
    counts = Counter(targets)
    total = sum(counts.values())
    return -sum(n / total * math.log(n / total) for n in counts.values())


def _classes(config: Any, objective: str, tokenizer: Any) -> int | None:
    model = config.model
    if objective in LANGUAGE_MODELS:
        size = tokenizer.get_vocab_size() if tokenizer is not None else model.config.get("vocab_size")
    elif objective == "classification":
        size = model.config.get("num_labels") or len(model.config.get("id2label") or {}) or 2  # transformers' default
    elif model.kind == "toolkit" and model.factory == BYTE_MODEL:
        size = 256  # the byte-level stream's targets, whatever the model's output width
    else:
        return None
    return size if isinstance(size, int) and size > 1 else None


def _tokenizer(data: bytes) -> Any:
    from toolkit.data.objectives import load_tokenizer

    return load_tokenizer(data)


def _demo_bytes() -> list[int]:
    from toolkit.corpus import demo_corpus

    return demo_corpus().tolist()


def _demo_tokens(tokenizer: Any) -> list[int] | None:
    """The demo paragraphs' token ids as peers encode them (no special tokens: never targets)."""
    if tokenizer is None:
        return None
    from toolkit.corpus import demo_paragraphs

    return [
        i
        for encoding in tokenizer.encode_batch(list(demo_paragraphs()), add_special_tokens=False)
        for i in encoding.ids
    ]
