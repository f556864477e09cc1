"""The run's ``[tokenizer]`` and ``[objective]`` sections: what peers turn their text into.

``[tokenizer] file`` names a ``tokenizer.json`` (relative to the run's TOML, like
``model.config_file``); the relay reads it once at start, serves it at ``GET /api/tokenizer`` and
publishes its sha256 in ``RunInfo``, so every peer trains on the same vocabulary or refuses to.
``[objective]`` is checked with the toolkit's own :class:`~toolkit.data.objectives.ObjectiveConfig`,
the class peers read it with. A tokenizer pinned to a Hub repo is not supported: ship the file.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay_server.core.hub_files import download_hub_file
from relay_server.core.model_checks import check_model
from relay_server.core.typed import PATH, ConfigError
from toolkit.errors import DataConfigError


@dataclass(kw_only=True)
class TokenizerSection:
    """``[tokenizer]``: the vocabulary every peer tokenizes with, pinned by its sha256."""

    file: str = field(default="", metadata=PATH)
    """A ``tokenizer.json`` (the ``tokenizers`` library's format), relative to the run's TOML
    file; empty = no tokenizer (byte-level runs). ``relay-server tokenizer train`` writes one."""
    sha256: str = ""
    """Pin the file: the relay refuses to start when the file's sha256 differs. Filled in from
    the file when empty."""
    repo: str = ""
    """Instead of ``file``: "owner/name@revision" on the Hub whose tokenizer.json the relay
    downloads (peers still receive it from the relay, with its sha256)."""


def resolve_run_data(config: Any, base: Path, *, read_tokenizer: bool = True) -> bytes | None:
    """Read the tokenizer file (its absolute path replaces ``file``; ``sha256`` is set), check
    the objective against it, and the model against both (:mod:`.model_checks`); the file's
    bytes, or None without a tokenizer. ``read_tokenizer=False``: the model alone (``relay-server
    tokenizer train`` is about to write the tokenizer)."""
    data = _read_tokenizer(config, base) if read_tokenizer else None
    check_model(config, with_tokenizer=read_tokenizer)
    return data


def _read_tokenizer(config: Any, base: Path) -> bytes | None:
    section: TokenizerSection = config.tokenizer
    data = None
    if section.repo:
        if section.file:
            raise ConfigError("set tokenizer.file or tokenizer.repo, not both")
        section.file = str(download_hub_file(config.hub, section.repo, "tokenizer.json", "tokenizer.repo"))
    if section.file:
        where = (base / section.file).resolve()
        try:
            data = where.read_bytes()
        except OSError as exc:
            raise ConfigError(f"tokenizer.file: cannot read {where}: {exc.strerror}") from None
        digest = hashlib.sha256(data).hexdigest()
        if section.sha256 and section.sha256.lower() != digest:
            raise ConfigError(f"tokenizer.sha256 pins {section.sha256}, but {where} has sha256 {digest}")
        section.file, section.sha256 = str(where), digest
    elif section.sha256:
        raise ConfigError("tokenizer.sha256 needs tokenizer.file")
    if not config.objective:
        return data
    from toolkit.data.objectives import ObjectiveConfig, load_tokenizer, objective_batches

    try:
        objective = ObjectiveConfig.from_dict(config.objective)
        if data is None:
            raise ConfigError(
                f'objective {objective.name!r} needs [tokenizer] file = "tokenizer.json" '
                "(relay-server tokenizer train --config run.toml writes one)"
            )
        tokenizer = load_tokenizer(data)
        next(
            objective_batches(
                iter([("a b", 0)] if objective.name == "classification" else ["a b"]),
                tokenizer,
                objective,
                batch_size=1,
                seed=0,
            )
        )  # the special tokens it needs are there
    except DataConfigError as exc:
        raise ConfigError(f"{exc.message}. {exc.hint}".strip()) from None
    return data  # the tokenizer against the model: relay_server.core.model_checks
