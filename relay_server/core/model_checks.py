"""The run's model against its tokenizer and objective, checked when the configuration loads.

Why here and not where the model is built: ``relay-server serve`` creates the data dir and the
admin token before the collaboration builds its model, and a mistake a peer would only meet at
its first batch (positions past the embedding, a token id past the vocabulary, a decoder
classifier with no pad token) wastes every volunteer's time. So each check runs in
``load_config`` (through :func:`~relay_server.core.run_data.resolve_run_data`), before anything
is written, and each refusal is one :class:`ConfigError` line naming the setting and what to set
it to, with close matches for a mistyped name. ``transformers`` is imported only for a run that
trains one of its models.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from relay_server.core.typed import ConfigError
from toolkit.errors import DataConfigError, ModelMismatch

OBJECTIVE_ARCHITECTURE = {
    "masked-lm": "AutoModelForMaskedLM",
    "causal-lm": "AutoModelForCausalLM",
    "classification": "AutoModelForSequenceClassification",
}
"""The ``AutoModel*`` class whose loss each objective's batches (their ``labels``) train."""
VOCAB_SLACK = 128
"""Unused embedding rows allowed past the tokenizer (rounding a vocabulary up to a multiple of
64 or 128 is common); beyond this and 10% of the tokenizer, the model is far larger than it."""
_TOKEN_ID_FIELDS = (
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "sep_token_id",
    "cls_token_id",
    "decoder_start_token_id",
)


def vocabulary_fits(vocab_size: int, tokenizer_size: int) -> bool:
    """Every token id has a row, and at most ``VOCAB_SLACK`` (or 10%) of the rows are unused."""
    return tokenizer_size <= vocab_size <= tokenizer_size + max(VOCAB_SLACK, tokenizer_size // 10)


def check_model(config: Any, *, with_tokenizer: bool = True) -> Any:
    """Refuse a model that cannot train on the run's tokens; returns ``config``.

    ``with_tokenizer=False`` when the tokenizer is not read (``relay-server tokenizer train``
    is about to write it): the checks that need it are skipped."""
    if config.model.kind in ("toolkit", "module"):
        _check_own_model(config.model)
    if config.pipeline.enabled:
        _check_pipeline(config)
    if config.model.kind != "transformers" or not (config.model.architecture and config.model.config):
        return config  # RelayConfig.validate names what a transformers run lacks
    tokenizer = _tokenizer(config) if with_tokenizer else None
    with _quiet_transformers():
        cfg = _transformers_config(config.model)
        _check_objective(config, cfg)
        _check_token_ids(config, cfg, tokenizer)
    return config


def _check_pipeline(config: Any) -> None:
    """A pipeline run's model can be cut into its stages (an architecture the stages know, a tie
    they can hold apart, parameters in layer order) and has a layer for each of them."""
    from toolkit.pipeline.stages import units_of

    try:
        units = units_of(config.model.spec())
    except ModelMismatch as exc:
        raise ConfigError(f"[pipeline] cannot cut [model] into stages: {exc.message}. {exc.hint}") from None
    pipeline = config.pipeline
    stages = pipeline.num_stages()
    if stages is not None and stages > units.num_layers:
        raise ConfigError(
            f"pipeline.stages = {stages}, but the model has {units.num_layers} layers: "
            f"set pipeline.stages to {units.num_layers} or fewer"
        )
    if pipeline.layers_per_stage and sum(pipeline.layers_per_stage) != units.num_layers:
        raise ConfigError(
            f"pipeline.layers_per_stage = {list(pipeline.layers_per_stage)} adds up to "
            f"{sum(pipeline.layers_per_stage)}, but the model has {units.num_layers} layers"
        )
    if stages is None and pipeline.worker_memory_mb > 0:  # "auto": the count the relay will cut, or why none fits
        _check_auto_stages(config, units)


def _check_auto_stages(config: Any, units: Any) -> None:
    """``stages = "auto"`` resolves as the relay will (:func:`toolkit.pipeline.worker_memory.auto_stage_count`
    on the model measured on the meta device), so a worker memory that no cut fits is one line here."""
    from toolkit.pipeline.stages import meta_model
    from toolkit.pipeline.worker_memory import auto_stage_count, memory_model, sequence_length

    spec = config.model.spec()
    tokens = sequence_length(meta_model(spec))
    try:
        auto_stage_count(
            memory_model(spec, units, config.pipeline.microbatch_size, tokens), config.pipeline.worker_memory_mb << 20
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _check_own_model(model: Any) -> None:
    """The factory exists and takes ``kwargs``: built on the meta device (no memory), as the
    relay will build it for real once the data dir exists."""
    import torch

    from toolkit.models import build_own_model

    try:
        with torch.device("meta"):
            build_own_model(model.spec())
    except ModelMismatch as exc:
        raise ConfigError(f"model.factory: {exc.message}: {exc.hint[0].lower()}{exc.hint[1:].rstrip('.')}") from None
    except TypeError as exc:
        if "argument" not in str(exc):  # not the call's signature: the real build reports it
            return
        raise ConfigError(f"model.kwargs: {model.factory} refuses them ({exc}): fix [model] kwargs") from None
    except Exception:  # noqa: BLE001 - a factory computing on its tensors at init cannot build on meta;
        pass  # the real build reports it


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers warns on stderr about defaults the checks (or the export) replace, e.g.
    GPT-2's eos_token_id 50256 in a 64-token vocabulary: the refusal must stay one line."""
    try:  # importing it (re)configures its loggers, so first import, then quiet
        from transformers.utils import logging as hf_logging
    except ImportError:  # transformers_config says how to install it
        yield
        return
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _transformers_config(model: Any) -> Any:
    """The run's ``AutoConfig``, after building the architecture on the meta device (no memory)."""
    import torch

    from toolkit.models.hf import architectures, transformers_config

    try:
        auto, cfg = transformers_config(model.architecture, model.config)
    except ModelMismatch as exc:  # its hint speaks to a volunteer; the organizer gets the setting to change
        field, hint = {
            "unknown_architecture": ("model.architecture", "set it to an AutoModel class of the relay's transformers"),
            "unknown_model_type": ("model.config.model_type", "set one the relay's transformers ships, or upgrade it"),
            "transformers_missing": ("model.kind", exc.hint),
        }.get(exc.code, ("model.config", exc.hint))
        raise ConfigError(f"{field}: {exc.message}: {hint[0].lower()}{hint[1:].rstrip('.')}") from None
    mapping = getattr(auto, "_model_mapping", None)
    if mapping is not None and type(cfg) not in mapping:
        import transformers

        fits = [a for a in architectures() if type(cfg) in getattr(getattr(transformers, a), "_model_mapping", {})]
        raise ConfigError(
            f"model.architecture: {model.architecture} has no {cfg.model_type} model: use one of "
            f"{', '.join(fits) or 'no AutoModel class'} or another model_type"
        )
    try:
        with torch.device("meta"):
            auto.from_config(cfg)
    except Exception as exc:  # transformers raises ValueError, AttributeError, AssertionError...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ConfigError(
            f"model.config: {model.architecture} cannot build this {cfg.model_type} model: {first}. "
            "Fix that field of [model] config"
        ) from None
    return cfg


def _check_objective(config: Any, cfg: Any) -> None:
    objective = config.objective.get("name")
    if objective not in OBJECTIVE_ARCHITECTURE:
        return  # no objective (or a bad name: resolve_run_data's ObjectiveConfig says so)
    wanted = OBJECTIVE_ARCHITECTURE[objective]
    if config.model.architecture != wanted:
        raise ConfigError(
            f"model.architecture: objective {objective!r} trains {wanted}'s loss, not "
            f'{config.model.architecture}\'s: set model.architecture = "{wanted}" '
            f"(or objective.name to match the model)"
        )
    seq_len = config.objective.get("seq_len", 128)
    positions = getattr(cfg, "max_position_embeddings", None)
    if isinstance(seq_len, int) and isinstance(positions, int) and seq_len > positions:
        name = getattr(cfg, "attribute_map", {}).get("max_position_embeddings", "max_position_embeddings")
        raise ConfigError(
            f"objective.seq_len = {seq_len} exceeds model.config.{name} = {positions} (the positions "
            f"the model embeds): lower objective.seq_len to {positions} or raise {name}"
        )
    if objective == "classification":
        _check_labels(config, cfg)


def _check_labels(config: Any, cfg: Any) -> None:
    """Labels must fit ``num_labels``; a decoder classifier needs ``pad_token_id`` to find each
    row's last token (transformers refuses a batch of two without it, on every peer)."""
    labels = config.model.config.get("id2label") or config.model.config.get("label2id")
    if "num_labels" in config.model.config and labels and len(labels) != cfg.num_labels:
        raise ConfigError(
            f"model.config.num_labels = {cfg.num_labels} but model.config names {len(labels)} labels "
            f"(id2label/label2id): set num_labels = {len(labels)} or drop one of them"
        )
    for label, shard in _label_extremes(config):
        if not 0 <= label < cfg.num_labels:
            fix = f"set model.config.num_labels = {label + 1}" if label >= 0 else "labels must be 0..num_labels-1"
            raise ConfigError(
                f"model.config.num_labels = {cfg.num_labels}, but the dataset shard {shard} holds label {label}: {fix}"
            )


def _label_extremes(config: Any) -> Iterator[tuple[int, str]]:
    """The smallest and largest class label of each local parquet shard, from the column
    statistics in the files' footers (no row is read); nothing where that is not knowable
    (Hub shards, json and text shards, files without statistics)."""
    if config.dataset.get("kind") != "stream":
        return
    try:
        import pyarrow.parquet as pq

        from toolkit.data import StreamConfig

        stream = StreamConfig.from_dict(config.dataset)
    except (ImportError, DataConfigError):
        return  # peers' own checks name a bad [dataset]
    column = str(config.objective.get("label_column") or "label")
    for spec in stream.datasets:
        for shard in spec.shards():
            if "://" in shard or (spec.format or ("parquet" if shard.endswith(".parquet") else "")) != "parquet":
                continue
            try:
                meta = pq.ParquetFile(shard).metadata
            except OSError:
                continue
            names = [meta.schema.column(i).name for i in range(meta.num_columns)]
            if column not in names:
                continue
            for group in range(meta.num_row_groups):
                stats = meta.row_group(group).column(names.index(column)).statistics
                if stats is not None and stats.has_min_max and isinstance(stats.max, int):
                    yield stats.min, shard
                    yield stats.max, shard


def _tokenizer(config: Any) -> Any:
    if not config.tokenizer.file:
        return None
    from pathlib import Path

    from toolkit.data.objectives import load_tokenizer

    return load_tokenizer(Path(config.tokenizer.file).read_bytes())  # resolve_run_data read and checked it


def _check_token_ids(config: Any, cfg: Any, tokenizer: Any) -> None:
    vocab = cfg.vocab_size if isinstance(getattr(cfg, "vocab_size", None), int) else None
    explicit = config.model.config
    for name in _TOKEN_ID_FIELDS:
        value = explicit.get(name)
        if vocab is not None and isinstance(value, int) and not 0 <= value < vocab:
            raise ConfigError(
                f"model.config.{name} = {value} is not a token of the model's {vocab}-token "
                f"vocabulary: set it to the tokenizer's id for that token, or remove it"
            )
    decoder_classifier = config.objective.get("name") == "classification" and _is_decoder(cfg)
    specials = None
    if tokenizer is not None:
        from toolkit.data.objectives import Specials

        specials = Specials.of(tokenizer)
    if decoder_classifier and cfg.pad_token_id is None:
        hint = (
            f" = {specials.pad} (the tokenizer's [PAD])"
            if specials and specials.pad is not None
            else " to the tokenizer's [PAD] id"
        )
        raise ConfigError(
            "model.config.pad_token_id: a decoder classifier (model_type "
            f"{cfg.model_type}) finds each row's last token by it; set model.config.pad_token_id{hint}"
        )
    if specials is None:
        return
    size = specials.vocab_size
    if vocab is not None and size > vocab:
        raise ConfigError(
            f"model.config.vocab_size = {vocab} but the tokenizer has {size} tokens (ids past the "
            f"embedding): set model.config.vocab_size = {size}"
        )
    if vocab is not None and not vocabulary_fits(vocab, size):
        source = "" if "vocab_size" in explicit else f" ({cfg.model_type}'s default)"
        raise ConfigError(
            f"model.config.vocab_size = {vocab}{source} but the tokenizer has {size} tokens: "
            f"{vocab - size} embedding rows would never train; set model.config.vocab_size = {size}"
        )
    pad = cfg.pad_token_id if decoder_classifier else explicit.get("pad_token_id")
    if isinstance(pad, int) and specials.pad is not None and pad != specials.pad:
        raise ConfigError(
            f"model.config.pad_token_id = {pad} but the tokenizer pads with id {specials.pad}: "
            f"set model.config.pad_token_id = {specials.pad}"
        )


def _is_decoder(cfg: Any) -> bool:
    """A decoder-only model type: it has a causal LM and no masked LM (GPT-2, Llama...), so its
    sequence classifier reads the last non-pad token."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    return (
        cfg.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and cfg.model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    )
