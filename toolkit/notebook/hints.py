"""Notebook-platform helpers for the one-cell notebooks: secrets, one-line hints, widgets.

Credentials never appear in a notebook (DESIGN.md s11: starter notebooks once shipped a shared
W&B key in plain text). :func:`secret` reads them, in this order, from

1. Colab's secret store (the key icon; ``google.colab.userdata``), only on Colab;
2. Kaggle's secrets (Add-ons -> Secrets; ``kaggle_secrets.UserSecretsClient``), only on Kaggle;
3. an environment variable of the same name (local machines, CI).

:func:`hf_token` adds the token ``hf auth login`` saved and, last, a hidden prompt.

:func:`platform_hints` turns what :func:`toolkit.runtime.environment.detect` found into at most a few
one-line fixes (Kaggle's accelerator, Colab's runtime type, the TPU's preinstalled
torch/torch_xla pair), printed by the cell before it joins.
"""

from __future__ import annotations

import getpass
import logging
import os
import sys
from typing import IO

from toolkit.runtime import environment
from toolkit.runtime.environment import TPU_PAIR_HINT, DeviceInfo

log = logging.getLogger(__name__)

HF_TOKEN = "HF_TOKEN"
_PROMPT = "Hugging Face token (read access is enough; press Enter to skip, open runs need none): "
_TPU_ENV = ("TPU_ACCELERATOR_TYPE", "COLAB_TPU_ADDR", "TPU_NAME")  # set on TPU runtimes/VMs
# Kaggle's other switch, Internet, needs no hint here: without it the cell's pip step already failed, saying so.
_CPU_HINTS = {
    "colab": "Colab: no accelerator; Runtime -> Change runtime type -> T4 GPU contributes far more.",
    "kaggle": "Kaggle: no accelerator; Settings -> Accelerator -> GPU T4 x2 (or TPU) contributes far more.",
    "": "No accelerator found: contributing on CPU (slow, but it counts).",
}


def secret(name: str) -> str | None:
    """The secret ``name`` from this platform's secret store, else from the environment; None if
    it is nowhere. A store that refuses (notebook access not granted) is logged, not raised."""
    platform = environment.notebook_platform()
    value = None
    if platform == "colab":
        value = _colab_secret(name)
    elif platform == "kaggle":
        value = _kaggle_secret(name)
    return value or os.environ.get(name) or None


def hf_token(*, prompt: bool = True) -> str | None:
    """The volunteer's Hugging Face token: :func:`secret` ``("HF_TOKEN")``, the saved
    ``hf auth login``, or a hidden prompt. None when there is none (an empty answer, or
    a kernel that cannot ask); the relay says whether the run needs one."""
    token = secret(HF_TOKEN) or _saved_hub_token()
    if token or not prompt:
        return token
    try:
        answer = getpass.getpass(_PROMPT)
    except (EOFError, OSError, NotImplementedError):  # NotImplementedError: a kernel without stdin (CI)
        log.info("no Hugging Face token found and no way to ask for one; continuing without")
        return None
    return answer.strip() or None


def platform_hints(info: DeviceInfo | None = None) -> list[str]:
    """One line per thing the volunteer may need to fix on this platform (often none)."""
    info = info or environment.detect()
    hints = list(info.hints)  # e.g. a torch_xla that does not match torch
    tpu_runtime = _tpu_runtime()
    if info.kind == "tpu":
        hints.append(
            f"TPU: training with the preinstalled torch {info.torch_version} / torch_xla "
            f"{info.torch_xla_version}; never pip install torch on this runtime."
        )
    elif tpu_runtime and not info.hints:
        minor = ".".join(info.torch_version.split("+")[0].split(".")[:2])
        hints.append("TPU runtime, but torch_xla is not usable: training on CPU. " + TPU_PAIR_HINT.format(minor=minor))
    if info.kind == "cpu" and not tpu_runtime:
        hints.append(_CPU_HINTS.get(info.platform or "", _CPU_HINTS[""]))
    return hints


def show_hints(info: DeviceInfo | None = None, file: IO[str] | None = None) -> list[str]:
    """Print :func:`platform_hints`, one line each; returns them."""
    hints = platform_hints(info)
    for hint in hints:
        print(hint, file=file or sys.stdout)
    return hints


def enable_widgets() -> None:
    """Colab renders ipywidgets 8 only through its custom widget manager; elsewhere a no-op."""
    if environment.notebook_platform() != "colab":
        return
    try:
        from google.colab import output  # type: ignore[import-not-found]

        output.enable_custom_widget_manager()
    except Exception as exc:  # an older Colab image: the panel still updates, maybe without the bar
        log.info("could not enable Colab's widget manager: %s", exc)


def _tpu_runtime() -> bool:
    """A TPU is attached, whatever torch_xla says: the runtimes' variables, or TPU VM device files."""
    return any(os.environ.get(k) for k in _TPU_ENV) or os.path.exists("/dev/accel0")


# --- the stores --------------------------------------------------------------------------------
def _colab_secret(name: str) -> str | None:
    try:
        from google.colab import userdata  # type: ignore[import-not-found]

        return userdata.get(name) or None
    except Exception as exc:  # SecretNotFoundError, NotebookAccessError, or not on Colab after all
        log.info(
            "Colab secret %s not available (%s); add it under the key icon and allow this notebook access",
            name,
            type(exc).__name__,
        )
        return None


def _kaggle_secret(name: str) -> str | None:
    try:
        from kaggle_secrets import UserSecretsClient  # type: ignore[import-not-found]

        return UserSecretsClient().get_secret(name) or None
    except Exception as exc:  # the secret is not attached to this notebook
        log.info("Kaggle secret %s not available (%s); attach it under Add-ons -> Secrets", name, type(exc).__name__)
        return None


def _saved_hub_token() -> str | None:
    """The token ``hf auth login`` stored (huggingface_hub reads its own file)."""
    try:
        from huggingface_hub import get_token
    except ImportError:
        return None
    try:
        return get_token() or None
    except Exception:  # a malformed token file means "none", not a crash before joining
        return None
