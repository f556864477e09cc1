"""Helpers for executing volunteer notebooks headlessly, shared by tests/test_notebooks.py (the
shipped templates) and tests/test_install_path.py (a notebook ``relay-server notebook`` wrote)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager

MAX_STEPS = 2
FAKE_TOKEN = "hf_ciTokenThatMustNeverBeLogged0123"
PLATFORM_VARS = (
    "COLAB_RELEASE_TAG",
    "COLAB_GPU",
    "COLAB_TPU_ADDR",
    "KAGGLE_KERNEL_RUN_TYPE",
    "KAGGLE_URL_BASE",
    "TPU_ACCELERATOR_TYPE",
    "TPU_NAME",
    "HF_TOKEN",
    "WANDB_API_KEY",
)


def code_cells(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [cell for cell in nb.cells if cell.cell_type == "code"]


def kernel_spec_manager(directory: Path, python: str, name: str = "collab-ci") -> KernelSpecManager:
    """A kernelspec named ``name`` that runs ``python``, so a notebook runs in that environment
    whatever kernels the machine has installed elsewhere."""
    (directory / name).mkdir(parents=True)
    (directory / name / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "collabtrain CI",
                "language": "python",
            }
        )
    )
    return KernelSpecManager(kernel_dirs=[str(directory)])


def kernel_env(relay_url: str | None, home: Path) -> dict[str, str]:
    """What CI sets for a notebook's kernel: the relay (None: the one written into the notebook),
    a step limit, no package index, and no token or W&B key of this machine's."""
    env = {k: v for k, v in os.environ.items() if k not in PLATFORM_VARS and k != "COLLAB_RELAY_URL"}
    if relay_url is not None:
        env["COLLAB_RELAY_URL"] = relay_url
    env.update(
        COLLAB_MAX_STEPS=str(MAX_STEPS),
        PIP_NO_INDEX="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        HF_TOKEN=FAKE_TOKEN,
        HF_HOME=str(home / "hf"),
        WANDB_MODE="disabled",
        OMP_NUM_THREADS="1",
    )
    return env


def outputs_text(cell: nbformat.NotebookNode) -> str:
    parts = []
    for out in cell.outputs:
        parts.append(out.get("text", ""))
        parts += [str(v) for v in out.get("data", {}).values()]
        parts += out.get("traceback", [])
    return "\n".join(parts)
