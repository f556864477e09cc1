"""Scoring one version: the validation batches, the metric the objective implies, the prompts.

Everything here runs in the evaluator process (:mod:`.evaluation`), never on the round's path.
The validation batches are built once (:func:`validation_batches`) with the peers' own pipeline
-- the run's tokenizer, packing and masking (:func:`toolkit.data.objectives.objective_batches`)
with a fixed seed -- so every version is scored on the same masked positions and the curve moves
only because the model did. The metric is the mean cross-entropy per target:

* masked-LM: over the masked tokens (plus their accuracy); perplexity = exp(loss);
* causal-LM: over the next tokens (labels shifted by one, padding ignored); perplexity;
* classification: over the rows' labels (plus accuracy);
* the byte-level demo model (no ``[objective]``): over next bytes of packed UTF-8 windows.

The model is the run's whole model (``model.spec()``): a pipeline run's versions are its stages
assembled (:mod:`relay_server.pipeline.whole_model`), and a ``[moe]`` run's dense version calls
the relay's copies of its experts (:mod:`.eval_experts`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from relay_server.core.config import ConfigError, RelayConfig
from toolkit.data.objectives import IGNORE_INDEX, ObjectiveConfig, Specials, load_tokenizer, objective_batches
from toolkit.data.reading import read_shard
from toolkit.data.stream_ops import byte_tokenize, pack
from toolkit.models import build_own_model
from toolkit.models.flat import load_flat
from toolkit.wire.protocol import EvalRecord, EvalSample

Batch = Any  # a dict batch (objective runs) or a [b, t + 1] LongTensor (byte-level runs)


def objective_of(config: RelayConfig) -> ObjectiveConfig | None:
    return ObjectiveConfig.from_dict(config.objective) if config.objective else None


def run_tokenizer(config: RelayConfig) -> Any:
    """The run's ``tokenizers.Tokenizer`` (None for byte-level runs)."""
    return load_tokenizer(open(config.tokenizer.file, "rb").read()) if config.tokenizer.file else None


def validation_rows(config: RelayConfig) -> Iterator[Any]:
    """The validation source's rows, streamed shard after shard (``(text, label)`` for classification)."""
    section, objective = config.evaluation, objective_of(config)
    column = objective.column if objective is not None and objective.column else section.text_column
    label = objective.label_column if objective is not None and objective.name == "classification" else None
    for shard in section.shards():
        yield from read_shard(shard, format=section.format or None, text_column=column, label_column=label)


def validation_batches(config: RelayConfig, tokenizer: Any) -> list[Batch]:
    """``evaluation.samples`` sequences in batches of ``evaluation.batch_size``, read once."""
    section, objective = config.evaluation, objective_of(config)
    rows = validation_rows(config)
    if objective is not None:
        stream: Iterator[Batch] = objective_batches(
            rows, tokenizer, objective, batch_size=section.batch_size, seed=section.seed
        )
    else:  # rows of seq_len + 1 bytes, grouped: pack() alone would drop a last partial batch
        windows = pack(map(byte_tokenize, rows), 1, byte_seq_len(config))
        stream = (torch.cat(group) for group in _groups(windows, section.batch_size))
    out: list[Batch] = []
    count = 0
    for batch in stream:
        rows_in = len(batch["input_ids"]) if isinstance(batch, dict) else len(batch)
        take = min(rows_in, section.samples - count)
        out.append({k: v[:take] for k, v in batch.items()} if isinstance(batch, dict) else batch[:take])
        count += take
        if count >= section.samples:
            break
    if not out:
        raise ConfigError(
            f"evaluation.data_files {section.data_files} gave no validation rows: point it at held-out text"
        )
    return out


def byte_seq_len(config: RelayConfig) -> int:
    """Bytes per byte-level validation window: ``evaluation.seq_len``, within the model's positions."""
    model_len = int(config.model.kwargs.get("seq_len", config.evaluation.seq_len))
    return min(config.evaluation.seq_len, model_len)


def _groups(items: Iterator[torch.Tensor], size: int) -> Iterator[list[torch.Tensor]]:
    group: list[torch.Tensor] = []
    for item in items:
        group.append(item)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def logits_and_targets(model: torch.nn.Module, batch: Batch, objective: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [n, classes], targets [n]) of the scored positions of one batch."""
    if not isinstance(batch, dict):  # byte-level: next byte everywhere
        logits = model(batch[:, :-1])
        return logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"]
    if objective == "classification":
        return logits, labels
    if objective == "causal-lm":
        logits, labels = logits[:, :-1], labels[:, 1:]
    keep = labels != IGNORE_INDEX
    return logits[keep], labels[keep]


@torch.no_grad()
def score(model: torch.nn.Module, batches: list[Batch], objective: str) -> dict[str, Any]:
    """Loss (mean cross-entropy per target), perplexity, accuracy and the number of targets."""
    total, correct, count = 0.0, 0, 0
    for batch in batches:
        logits, targets = logits_and_targets(model, batch, objective)
        total += float(F.cross_entropy(logits.double(), targets, reduction="sum"))
        correct += int((logits.argmax(dim=-1) == targets).sum())
        count += int(targets.numel())
    loss = total / max(count, 1)
    metrics: dict[str, Any] = {"loss": loss, "targets": count}
    if objective != "classification":
        metrics["perplexity"] = math.exp(min(loss, 700.0))
    if objective in ("masked-lm", "classification"):
        metrics["accuracy"] = correct / max(count, 1)
    return metrics


class VersionScorer:
    """The run's model, validation batches and tokenizer, built once; :meth:`evaluate` scores one version."""

    def __init__(self, config: RelayConfig) -> None:
        self.config, self.section = config, config.evaluation
        objective = objective_of(config)
        self.objective = objective.name if objective is not None else ""
        self.tokenizer = run_tokenizer(config)
        self.model = build_own_model(config.model.spec()).eval()
        self.experts = None
        if config.moe.enabled:  # the flat vector is the dense part: the experts are the relay's copies
            from relay_server.observers.eval_experts import RelayExperts

            self.experts = RelayExperts(config)
            # a DMoE model here; nn.Module's __getattr__ types any attribute as a tensor
            self.model.attach_caller(self.experts)  # type: ignore[operator]
        self.batches = validation_batches(config, self.tokenizer)

    def evaluate(self, step: int, flat: torch.Tensor) -> EvalRecord:
        started = time.monotonic()
        load_flat(self.model, flat)
        if self.experts is not None:
            self.experts.refresh()
        metrics = score(self.model, self.batches, self.objective)
        samples = [self.answer(prompt) for prompt in self.section.prompts]
        return EvalRecord(step=step, **metrics, duration_s=time.monotonic() - started, samples=samples)

    @torch.no_grad()
    def answer(self, prompt: str) -> EvalSample:
        """The model's own output for one prompt (see the module docstring of :mod:`.evaluation`)."""
        if not self.objective:
            ids = list(prompt.encode("utf-8"))
            new = self._greedy(ids, lambda x: self.model(x), byte_seq_len(self.config), eos=None)
            return EvalSample(
                prompt=prompt, kind="continuation", output=bytes(t for t in new if t < 256).decode("utf-8", "replace")
            )
        specials = Specials.of(self.tokenizer)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        seq_len = objective_of(self.config).seq_len  # type: ignore[union-attr]  # self.objective set: it has one
        if self.objective == "causal-lm":
            new = self._greedy(ids, lambda x: self.model(input_ids=x).logits, seq_len, eos=specials.eos)
            return EvalSample(prompt=prompt, kind="continuation", output=self.tokenizer.decode(new))
        row = torch.tensor([[specials.cls, *ids[: seq_len - 2], specials.sep]])
        logits = self.model(input_ids=row, attention_mask=torch.ones_like(row)).logits[0]
        if self.objective == "classification":
            probs = logits.softmax(-1)
            best = int(probs.argmax())
            label = (self.config.model.config.get("id2label") or {}).get(str(best), str(best))
            return EvalSample(prompt=prompt, kind="label", output=label, scores=[float(probs[best])])
        where = (row[0] == specials.mask).nonzero()  # type: ignore[attr-defined]  # Tensor == int is typed bool
        if len(where) == 0:  # truncated away: nothing to fill
            return EvalSample(prompt=prompt, kind="fill-mask", output="")
        probs = logits[int(where[0])].softmax(-1)
        top = probs.topk(min(self.section.top_k, probs.numel()))
        tokens = [self.tokenizer.id_to_token(int(i)) or "?" for i in top.indices]
        return EvalSample(
            prompt=prompt,
            kind="fill-mask",
            output=" ".join(tokens),
            tokens=tokens,
            scores=[float(v) for v in top.values],
        )

    def _greedy(self, ids: list[int], forward: Any, window: int, eos: int | None) -> list[int]:
        context, new = list(ids) or [0], []
        for _ in range(self.section.max_new_tokens):
            logits = forward(torch.tensor([context[-window:]]))
            token = int(logits[0, -1].argmax())
            if eos is not None and token == eos:
                break
            new.append(token)
            context.append(token)
        return new
