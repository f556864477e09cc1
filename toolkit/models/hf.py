"""Hugging Face ``transformers`` architectures built from a config that travels as data.

A run names an ``AutoModel*`` class of the installed ``transformers`` package and a config
(``model_type`` plus the architecture's fields). Peers and the relay build the same module from
it with ``from_config``: no weights are downloaded, and ``trust_remote_code`` is never passed, so
the only code that runs is the ``transformers`` release the volunteer installed. A config naming
custom code (``auto_map``) or a ``model_type`` this release does not know is refused with a
sentence saying what to do.

Training batches for these models are dicts (``input_ids``, ``attention_mask``, ``labels``, ...)
and the loss is the one the architecture computes from its labels (:func:`loss_of`).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import Any

import torch

from toolkit.errors import ModelMismatch

_ARCHITECTURE = re.compile(r"AutoModel(For[A-Za-z]+)?")
_REMOTE_CODE_KEYS = ("auto_map", "trust_remote_code", "custom_pipelines")
_HINT_INSTALL = 'Install the extra on this machine: pip install "collabtrain[hf]".'


def _transformers() -> ModuleType:
    try:
        import transformers
    except ImportError as exc:
        raise ModelMismatch(
            "transformers_missing",
            f"this run trains a transformers model, and importing transformers failed ({exc})",
            _HINT_INSTALL,
        ) from None
    return transformers


def did_you_mean(name: str, options: Iterable[str], n: int = 3) -> str:
    """ " (did you mean X?)" for the ``n`` closest of ``options`` to a mistyped ``name``, else ""."""
    close = difflib.get_close_matches(name, list(options), n=n, cutoff=0.6)
    if not close:
        return ""
    return (
        f" (did you mean {close[0]}?)"
        if len(close) == 1
        else f" (did you mean {', '.join(close[:-1])} or {close[-1]}?)"
    )


def architectures() -> list[str]:
    """The ``AutoModel*`` classes of the installed transformers."""
    return sorted(n for n in dir(_transformers()) if _ARCHITECTURE.fullmatch(n))


def model_types() -> list[str]:
    """The ``model_type`` values the installed transformers knows."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return sorted(CONFIG_MAPPING_NAMES)


def check_transformers_spec(architecture: str, config: Mapping[str, Any]) -> None:
    """Refuse, before anything is built, what could make a peer run code it did not install."""
    if not _ARCHITECTURE.fullmatch(architecture or ""):
        raise ModelMismatch(
            "unknown_architecture",
            f"architecture {architecture!r} is not an AutoModel class",
            'Name one of transformers\' AutoModel classes, e.g. "AutoModelForMaskedLM" or "AutoModelForCausalLM".',
        )
    remote = [k for k in _REMOTE_CODE_KEYS if k in config]
    if remote:
        raise ModelMismatch(
            "remote_code_refused",
            f"the model config asks for code from the network ({remote[0]})",
            "collabtrain never runs remote code: remove auto_map/trust_remote_code and use an "
            "architecture that ships with transformers, or an own module the volunteers opt into "
            "(join(..., trusted_models=[...])).",
        )
    if not isinstance(config.get("model_type"), str):
        raise ModelMismatch(
            "bad_model_config",
            "the model config has no model_type",
            'Add model_type (e.g. "albert", "gpt2", "bert") to [model] config.',
        )


def transformers_config(architecture: str, config: Mapping[str, Any]) -> tuple[Any, Any]:
    """(the ``AutoModel*`` class, its ``AutoConfig``) for a run's spec, after the refusals above."""
    check_transformers_spec(architecture, config)
    transformers = _transformers()
    auto = getattr(transformers, architecture, None)
    if auto is None:
        raise ModelMismatch(
            "unknown_architecture",
            f"transformers {transformers.__version__} has no {architecture}"
            f"{did_you_mean(architecture, architectures(), n=1)}",
            "Upgrade transformers on this machine, or ask the organizer which version the run uses.",
        )
    fields = dict(config)
    model_type = fields.pop("model_type")
    if model_type not in model_types():  # transformers' own error lists all ~800 types: 16 KB
        raise ModelMismatch(
            "unknown_model_type",
            f"transformers {transformers.__version__} does not know "
            f"model_type {model_type!r}{did_you_mean(model_type, model_types())}",
            "Upgrade transformers, or use a model_type this version ships.",
        )
    try:
        return auto, transformers.AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError) as exc:
        raise ModelMismatch(
            "bad_model_config",
            f"the {model_type} config cannot be built: {_first_line(exc)}",
            "Check [model] config's fields against the model_type's configuration class.",
        ) from None


def build_transformers(architecture: str, config: Mapping[str, Any]) -> torch.nn.Module:
    """``transformers.<architecture>.from_config(AutoConfig.for_model(**config))``, locally only."""
    auto, cfg = transformers_config(architecture, config)
    try:
        return auto.from_config(cfg)
    except ValueError as exc:
        raise ModelMismatch(
            "bad_model_config",
            f"{architecture} cannot be built from this config: {_first_line(exc)}",
            "Check [model] architecture against the config's model_type.",
        ) from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def loss_of(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The training loss of one batch: ``model.loss(batch)`` for the toolkit's models, the
    architecture's own loss from ``labels`` for a dict batch (HF models)."""
    if isinstance(batch, Mapping):
        out = model(**batch)
        loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
        if loss is None:
            raise ModelMismatch(
                "no_loss",
                f"{type(model).__name__} returned no loss for a batch with keys {sorted(batch)}",
                "Give the batches labels (the run's [objective] collator adds "
                "them), or pass your own loop's loss to opt.step(loss=...).",
            )
        return loss
    own: Any = model  # one of the toolkit's models: nn.Module itself declares no loss()
    return own.loss(batch)
