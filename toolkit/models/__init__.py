"""Models a run can name, and the one function that builds them from the run's description.

Peers never import code chosen by the network: :func:`build_model` builds the toolkit's own
models (``kind = "toolkit"``), architectures of the installed ``transformers`` from a config
(``kind = "transformers"``, :mod:`toolkit.models.hf`, no remote code), or an organizer's own
module only when the volunteer installed its package and named it in ``trusted_models``
(``kind = "module"``); the check happens before anything is imported.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import import_module
from typing import TYPE_CHECKING

from toolkit.errors import ModelMismatch
from toolkit.models.byte_transformer import ByteTransformer, TransformerConfig
from toolkit.models.dmoe import DMoEMLP
from toolkit.models.dmoe_lm import DMoEByteLM
from toolkit.models.hf import build_transformers, loss_of
from toolkit.models.mlp import MLP
from toolkit.models.vector import Vector
from toolkit.wire.protocol import ModelSpec

if TYPE_CHECKING:
    import torch

__all__ = [
    "ByteTransformer",
    "DMoEByteLM",
    "DMoEMLP",
    "MLP",
    "TransformerConfig",
    "Vector",
    "build_model",
    "build_own_model",
    "check_trusted",
    "loss_of",
]

_FACTORIES = {
    "ByteTransformer": ByteTransformer,
    "DMoEByteLM": DMoEByteLM,
    "DMoEMLP": DMoEMLP,
    "MLP": MLP,
    "Vector": Vector,
}


def check_trusted(spec: ModelSpec, trusted_models: Iterable[str] = ()) -> None:
    """Refuse a run whose model would make this machine import a package it did not opt into."""
    if spec.kind != "module":
        return
    module, _, name = spec.factory.partition(":")
    package = _package(spec)
    if not module or not name:
        raise ModelMismatch(
            "bad_model_factory",
            f"model factory {spec.factory!r} is not 'package.module:Name'",
            "Ask the organizer to fix [model] factory.",
        )
    if package not in set(trusted_models):
        raise ModelMismatch(
            "untrusted_model",
            f"this run trains the organizer's own model {spec.factory!r}, "
            f"and you have not opted into package {package!r}",
            f"If you trust the organizer: pip install their package, then call "
            f"join(..., trusted_models=[{package!r}]). Nothing was imported.",
        )


def build_model(spec: ModelSpec, trusted_models: Iterable[str] = ()) -> "torch.nn.Module":
    """The run's model, freshly initialised (the relay's parameters replace the values)."""
    if spec.kind == "transformers":
        return build_transformers(spec.architecture, spec.config)
    if spec.kind == "module":
        check_trusted(spec, trusted_models)
        module, _, name = spec.factory.partition(":")
        try:
            factory = getattr(import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise ModelMismatch(
                "model_not_installed",
                f"cannot import {spec.factory} ({exc})",
                f"pip install the organizer's package that provides {module}.",
            ) from None
        return factory(**spec.kwargs)
    module, _, name = spec.factory.partition(":")
    if module != "toolkit.models" or name not in _FACTORIES:
        raise ModelMismatch(
            "unknown_model",
            f"model factory {spec.factory!r} is not part of toolkit.models",
            f"Use one of {', '.join('toolkit.models:' + n for n in _FACTORIES)}, "
            'kind = "transformers" for a transformers architecture, or pass your own model to join().',
        )
    return _FACTORIES[name](**spec.kwargs)


def build_own_model(spec: ModelSpec) -> "torch.nn.Module":
    """The relay's build of the run it was configured with: the organizer's own package is the
    one its configuration names, so it is trusted by definition (volunteers opt in themselves)."""
    return build_model(spec, trusted_models=[_package(spec)])


def _package(spec: ModelSpec) -> str:
    return spec.factory.partition(":")[0].split(".")[0]
