"""The ``hf_standin`` fixture: the package's Hugging Face Hub stand-in
(:class:`relay_server.harness.hf_standin.HfStandin`) for one test, with ``huggingface_hub`` pointed
at it.

The library reads ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` at import time into
``huggingface_hub.constants`` and ``HF_HUB_OFFLINE=1`` blocks even localhost, so the fixture
patches both the environment and the constants.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from relay_server.harness.hf_standin import HfStandin


def scope_hf_env(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    """Point huggingface_hub at ``endpoint`` for one test: online, no ambient token, no telemetry."""
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    # hf_hub_download builds file URLs from this template, not from ENDPOINT
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    # the user-agent builder otherwise fetches {ENDPOINT}/api/agent-harnesses once per process
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)


@pytest.fixture
def hf_standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[HfStandin]:
    with HfStandin() as hub:
        scope_hf_env(monkeypatch, hub.url)
        yield hub
