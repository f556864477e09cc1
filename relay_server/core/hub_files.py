"""Files a run takes from the Hugging Face Hub, pinned to a revision: a model's ``config.json``
(``[model] config_repo``), a ``tokenizer.json`` (``[tokenizer] repo``), checkpoints (``[hub]``).

Only the relay downloads them; peers receive the config as data and the tokenizer from the relay
with its sha256, so a volunteer's notebook needs no Hub access and runs no code from it. A run's
inputs must not move under it, so these settings require ``owner/name@revision``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from relay_server.core.typed import ConfigError

if TYPE_CHECKING:  # service_config's sections hold no code this module needs at run time
    from relay_server.core.service_config import HubSection

DEFAULT_ENDPOINT = "https://huggingface.co"


def hub_endpoint(hub: HubSection) -> str:
    """``hub.endpoint``, else ``HF_ENDPOINT`` as the environment says now (huggingface_hub reads
    it once at import time, so we pass it explicitly), else the public Hub."""
    return (hub.endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hub_token(hub: HubSection) -> str | None:
    return os.environ.get(hub.token_env) or None


def parse_repo(value: str, setting: str, *, pinned: bool) -> tuple[str, str | None]:
    """``"owner/name"`` or ``"owner/name@revision"`` -> (repo_id, revision or None)."""
    repo_id, at, revision = value.partition("@")
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts) or (at and not revision) or (pinned and not revision):
        form = "'owner/name@revision'" if pinned else "'owner/name' or 'owner/name@revision'"
        raise ConfigError(
            f"{setting} must be {form}, got {value!r}"
            + (" (pin a commit so every restart reads the same file)" if pinned else "")
        )
    return repo_id, revision or None


def download_hub_file(
    hub: HubSection, value: str, filename: str, setting: str, *, pinned: bool = True, cache_dir: str | None = None
) -> Path:
    """The local path of ``filename`` in the repo ``value`` (pinned to a revision unless
    ``pinned=False``); a ConfigError naming ``setting`` when the repo, revision or file is not there."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    repo_id, revision = parse_repo(value, setting, pinned=pinned)
    try:
        return Path(
            hf_hub_download(
                repo_id,
                filename,
                revision=revision,
                repo_type="model",
                endpoint=hub_endpoint(hub),
                token=hub_token(hub),
                cache_dir=cache_dir,
            )
        )
    except RevisionNotFoundError:
        raise ConfigError(f"{setting}: no revision {revision!r} in {repo_id}") from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{setting}: repository {repo_id} not found (or private: export a token that can "
            f"read it in {hub.token_env}, see hub.token_env)"
        ) from None
    except EntryNotFoundError:
        raise ConfigError(f"{setting}: {repo_id}@{revision or 'main'} has no {filename}") from None
