"""The run's tokenizer as ``AutoTokenizer.from_pretrained(checkpoint)`` loads it.

A bare ``tokenizer.json`` is not enough: without ``tokenizer_config.json`` transformers picks the
model type's own tokenizer class, which appends its default special tokens (``<unk>``, ``<pad>``)
at ids past the model's vocabulary, and the first padded batch raises ``IndexError``. So an
export names the class that reads ``tokenizer.json`` as is (``PreTrainedTokenizerFast``) and the
run's special tokens by role, each at its own id, as the run's objective used them:

- masked-LM and classification: [PAD] [UNK] [CLS] [SEP] [MASK], bos = [CLS], eos = [SEP]
  (blocks are ``[CLS] ... [SEP]``, what the tokenizer's post-processor adds);
- causal-LM: the end-of-text token is eos (and bos, as GPT-2's), pad is [PAD] or else eos, and
  the post-processor's [CLS]/[SEP] are dropped: documents were packed without them, so a prompt
  must not end in a separator. Padding is on the left, where batched generation needs it.

The model's ``config.json`` gets the same ids (:func:`token_ids`) unless the run's config set
them: generation stops at the run's eos, not at GPT-2's default 50256.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_UNK = ("[UNK]", "<unk>")
_BOS = ("<s>", "[BOS]", "<bos>", "<|startoftext|>")


@dataclass(frozen=True)
class RunTokenizer:
    """The run's tokenizer with its special tokens by role (``"pad_token"`` -> ``"[PAD]"``)."""

    tokenizer: Any
    tokens: dict[str, str]
    causal: bool
    max_length: int | None

    def token_ids(self) -> dict[str, int]:
        """``pad_token_id``, ``bos_token_id``... as the model config names them."""
        return {
            f"{role}_id": self.tokenizer.token_to_id(token)
            for role, token in self.tokens.items()
            if role != "unk_token"
        }


def run_tokenizer(config: Any) -> RunTokenizer | None:
    """The run's tokenizer (None if it names none); ``load_config`` made ``tokenizer.file``
    absolute and checked its sha256."""
    if not config.tokenizer.file:
        return None
    from toolkit.data.objectives import Specials, load_tokenizer

    tok = load_tokenizer(Path(config.tokenizer.file).read_bytes())
    specials = Specials.of(tok)
    objective = config.objective.get("name")
    causal = objective == "causal-lm" or (not objective and config.model.architecture == "AutoModelForCausalLM")

    def find(names: tuple[str, ...]) -> int | None:
        return next((i for name in names if (i := tok.token_to_id(name)) is not None), None)

    bos = find(_BOS)
    roles = {
        "pad": specials.pad,
        "unk": find(_UNK),
        "cls": specials.cls,
        "sep": specials.sep,
        "mask": specials.mask,
        "eos": specials.eos,
        "bos": bos if bos is not None else (specials.eos if causal else specials.cls),
    }
    if causal:
        roles["pad"] = specials.pad if specials.pad is not None else specials.eos  # as the collator pads
        if tok.post_processor is not None and tok.post_processor.num_special_tokens_to_add(False):
            tok.post_processor = None
    tokens = {f"{role}_token": tok.id_to_token(i) for role, i in roles.items() if i is not None}
    seq_len = config.objective.get("seq_len", 128) if objective else None
    return RunTokenizer(tok, tokens, causal, seq_len)


def write_tokenizer(run: RunTokenizer, out_dir: Path) -> list[Path]:
    """``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` in ``out_dir``."""
    files = [out_dir / name for name in TOKENIZER_FILES]
    run.tokenizer.save(str(files[0]))
    settings: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **run.tokens,
        "padding_side": "left" if run.causal else "right",
        "clean_up_tokenization_spaces": False,
    }
    if run.max_length:
        settings["model_max_length"] = run.max_length
    files[1].write_text(json.dumps(settings, indent=1) + "\n")
    files[2].write_text(json.dumps(run.tokens, indent=1) + "\n")
    return files
