"""``[evaluation]``: held-out validation of the published versions, and the fixed prompts whose
answers the dashboard shows ("what the model says now").

The validation source is described like a ``[[dataset.sources]]`` entry (local ``data_files``
with ``format`` / ``text_column``, or a Hub dataset ``repo`` pinned at a ``revision``) and is
never one of the training sources: a validation loss on training shards says nothing about
generalization, so such a configuration is refused at load. Prompts are bounded in number and
length because they run through the model on every evaluated version, on the relay's CPU.

The relay evaluates off the round's path (:mod:`relay_server.observers.evaluation`).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Any

from relay_server.core.typed import ConfigError

Checks = list[tuple[bool, str]]

MAX_PROMPTS = 16
MAX_PROMPT_CHARS = 256
SUPPORTED_OBJECTIVES = ("masked-lm", "causal-lm", "classification")
BYTE_MODEL = "toolkit.models:ByteTransformer"


@dataclass(kw_only=True)
class EvaluationSection:
    """``[evaluation]``: held-out validation loss and live samples, per published version."""

    data_files: list[str] = field(default_factory=list)
    """Validation shards: local paths or globs (relative to the run's TOML file), or paths inside
    ``repo``. Empty = no evaluation. Never a training source's files (refused at load)."""
    format: str = ""
    """"parquet", "json" or "text"; empty = from each file's extension."""
    text_column: str = "text"
    """The column holding the text (classification reads ``[objective] label_column`` too)."""
    repo: str = ""
    """A Hub dataset repo "org/name" holding ``data_files`` (streamed); needs ``revision``."""
    revision: str = ""
    """The commit (or tag) of ``repo``: pinned, so every version is evaluated on the same rows."""
    samples: int = 64
    """Validation sequences (rows for classification), read once and reused for every version."""
    batch_size: int = 8
    """Sequences per forward pass."""
    seq_len: int = 128
    """Byte-level runs (no ``[objective]``): bytes per sequence. Objective runs use its seq_len."""
    seed: int = 0
    """Seed of the masked-LM masking: the same masked positions for every version."""
    every_steps: int = 10
    """Evaluate a version once this many steps passed since the last evaluated one (0 = off); the
    run's last step (``run.total_steps``) is always evaluated."""
    every_s: float = 0.0
    """... or once this many seconds passed since the last evaluation (0 = off)."""
    prompts: list[str] = field(default_factory=list)
    """Fixed prompts answered by every evaluated version: masked-LM prompts contain the
    tokenizer's mask token (fill-mask), causal and byte-level ones are continued greedily,
    classification ones get a label. At most 16, each at most 256 characters."""
    max_new_tokens: int = 12
    """Tokens (bytes) of a greedy continuation."""
    top_k: int = 5
    """fill-mask: tokens shown per prompt."""
    threads: int = 1
    """CPU threads of the evaluator process (it also runs at a lower priority than the relay)."""

    @property
    def enabled(self) -> bool:
        return bool(self.data_files)

    def checks(self) -> Checks:
        """(holds, message) pairs for :meth:`RelayConfig.validate`."""
        too_long = [i for i, p in enumerate(self.prompts) if not p.strip() or len(p) > MAX_PROMPT_CHARS]
        return [
            (not self.prompts or self.enabled, "evaluation.prompts needs evaluation.data_files (a validation source)"),
            (
                len(self.prompts) <= MAX_PROMPTS,
                f"evaluation.prompts has {len(self.prompts)} prompts; at most {MAX_PROMPTS} are allowed",
            ),
            (
                not too_long,
                f"evaluation.prompts[{too_long[0] if too_long else 0}] must be 1 to {MAX_PROMPT_CHARS} "
                "characters: shorten it",
            ),
            (self.format in ("", "parquet", "json", "text"), "evaluation.format must be parquet, json, text or empty"),
            (
                not self.repo or bool(self.revision),
                "evaluation.repo needs evaluation.revision (a commit: pin the "
                "validation rows so every version sees the same ones)",
            ),
            (1 <= self.samples <= 100_000, "evaluation.samples must be in 1..100000"),
            (1 <= self.batch_size <= 1024, "evaluation.batch_size must be in 1..1024"),
            (4 <= self.seq_len <= 65_536, "evaluation.seq_len must be in 4..65536"),
            (
                self.every_steps >= 0 and self.every_s >= 0,
                "evaluation.every_steps and evaluation.every_s must be >= 0",
            ),
            (
                not self.enabled or self.every_steps > 0 or self.every_s > 0,
                "evaluation needs evaluation.every_steps > 0 or evaluation.every_s > 0",
            ),
            (0 <= self.max_new_tokens <= 256, "evaluation.max_new_tokens must be in 0..256"),
            (1 <= self.top_k <= 50, "evaluation.top_k must be in 1..50"),
            (1 <= self.threads <= 256, "evaluation.threads must be in 1..256"),
        ]

    def shards(self) -> list[str]:
        """The validation shards: ``repo`` prefix applied, local globs expanded (sorted)."""
        if self.repo:
            return [f"hf://datasets/{self.repo}@{self.revision}/{f}" for f in self.data_files]
        out: list[str] = []
        for pattern in self.data_files:
            out += sorted(glob.glob(os.path.expanduser(pattern))) if any(c in pattern for c in "*?[") else [pattern]
        return out


def check_evaluation(config: Any, tokenizer_json: bytes | None) -> None:
    """The checks that need other sections: a model and objective the evaluator can score, a
    source that is no training source, masked-LM prompts holding the mask token."""
    section: EvaluationSection = config.evaluation
    if not section.enabled:
        return
    objective = (config.objective or {}).get("name", "")
    if objective not in SUPPORTED_OBJECTIVES and not (
        config.model.kind == "toolkit" and config.model.factory == BYTE_MODEL
    ):
        raise ConfigError(
            f"evaluation needs an [objective] ({', '.join(SUPPORTED_OBJECTIVES)}) or the model "
            f"{BYTE_MODEL}: remove [evaluation] data_files for this run"
        )
    shared = set(section.shards()) & set(_training_shards(config.dataset))
    if shared:
        raise ConfigError(
            f"evaluation.data_files includes the training shard {sorted(shared)[0]}: validate on "
            "held-out files that no [[dataset.sources]] entry lists"
        )
    if objective == "masked-lm" and section.prompts and tokenizer_json is not None:
        from toolkit.data.objectives import Specials, load_tokenizer

        tokenizer = load_tokenizer(tokenizer_json)
        mask_id = Specials.of(tokenizer).mask
        mask = tokenizer.id_to_token(mask_id) if mask_id is not None else "[MASK]"
        for i, prompt in enumerate(section.prompts):
            if mask not in prompt:
                raise ConfigError(
                    f"evaluation.prompts[{i}] has no {mask}: a masked-LM fills in the mask token, "
                    f'write e.g. "The capital of France is {mask}."'
                )


def _training_shards(dataset: dict[str, Any]) -> list[str]:
    """Every training source's shards, resolved as the relay and peers resolve them."""
    from toolkit.data.dataset_config import DatasetSpec
    from toolkit.errors import DataConfigError

    found: list[str] = []
    for i, source in enumerate(dataset.get("sources") or []):
        try:
            spec = DatasetSpec.from_dict(source, i)
        except (DataConfigError, TypeError, ValueError):
            continue  # the dataset's own checks report it
        try:
            found += (
                spec.shards()
                if not spec.repo
                else [
                    f"hf://datasets/{spec.repo}@{spec.revision}/{f}"
                    if spec.revision
                    else f"hf://datasets/{spec.repo}/{f}"
                    for f in spec.data_files
                ]
            )
        except DataConfigError:
            found += list(spec.data_files)
    return found
