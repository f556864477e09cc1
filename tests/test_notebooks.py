"""The volunteer notebooks, executed headlessly as a volunteer would run them, plus the helpers
their cell uses (secret stores, platform hints).

A notebook runs unchanged in a fresh kernel of this venv's Python (a kernelspec written into
tmp_path) against a real relay of its own (the demo run with a tiny model): CI only sets the
environment variables the cell documents (relay URL, a step limit). These are the shipped
templates, with no toolkit sha256 filled in, so the cell installs nothing and uses the toolkit
this venv has installed; tests/test_install_path.py runs a notebook that ``relay-server
notebook`` wrote, installing from the relay into a fresh venv. On this machine the platform
branches (Colab/Kaggle secrets, TPU) take their no-platform fallback.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import types
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

from tests.support.notebooks import (
    FAKE_TOKEN,
    MAX_STEPS,
    PLATFORM_VARS,
    code_cells,
    kernel_env,
    kernel_spec_manager,
    outputs_text,
)
from tests.support.processes import REPO
from tests.support.relays import TINY_LM, running_relay, status
from toolkit.notebook import hints as notebook
from toolkit.runtime.environment import DeviceInfo

pytestmark = pytest.mark.xdist_group("notebooks")  # one worker builds its kernel specs once (--dist loadgroup)

NOTEBOOKS = ("local", "colab", "kaggle", "tpu")


def load(name: str) -> nbformat.NotebookNode:
    return nbformat.read(REPO / "notebooks" / f"{name}.ipynb", as_version=4)


# --- the notebooks as files ------------------------------------------------------------------
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_one_code_cell_with_its_explanations_and_no_credentials(name: str) -> None:
    nb = load(name)
    nbformat.validate(nb)
    assert len(code_cells(nb)) == 1
    prose = "\n".join(cell.source for cell in nb.cells if cell.cell_type == "markdown")
    for heading in ("What the cell does", "What leaves this machine", "How to stop"):
        assert heading in prose
    raw = (REPO / "notebooks" / f"{name}.ipynb").read_text()
    assert not re.search(r"hf_[A-Za-z0-9]{20,}|\b[0-9a-f]{40}\b", raw), "a credential-like string in the notebook"
    assert all(not cell.get("outputs") for cell in code_cells(nb)), "commit notebooks without outputs"


def test_the_four_cells_differ_only_in_the_default_relay_url() -> None:
    cells = {name: code_cells(load(name))[0].source for name in NOTEBOOKS}
    url_line = re.compile(r'^RELAY_URL = os\.environ\.get\("COLLAB_RELAY_URL", "[^"]+"\)', re.M)
    normalized = {url_line.sub("RELAY_URL = <default>", source) for source in cells.values()}
    assert len(normalized) == 1, "the notebooks' cells drifted apart"
    source = cells["colab"]
    assert "toolkit.join(RELAY_URL, token=token, max_steps=MAX_STEPS)" in source
    assert "print(result.summary())" in source  # a sentence, not a dataclass repr
    assert '"-c", constraints.name' in source and '"torch_xla"' in source  # TPU-safe install
    # The relay is checked before pip runs; a machine without torch gets the CPU build.
    assert source.index("check_relay(RELAY_URL)") < source.index('pip_install("the toolkit"')
    assert 'CPU_TORCH = "https://download.pytorch.org/whl/cpu"' in source and '"--index-url", CPU_TORCH' in source
    # Only the relay's wheel, pinned by sha256; the templates pin nothing, so they install nothing.
    assert (
        "collabtrain[{TOOLKIT_EXTRAS}] @ {RELAY_URL.rstrip('/')}/toolkit/{TOOLKIT_WHEEL}#sha256={TOOLKIT_SHA256}"
        in source
    )
    assert 'TOOLKIT_WHEEL = ""' in source and 'TOOLKIT_SHA256 = ""' in source and 'TOOLKIT_EXTRAS = "hf"' in source
    assert "COLLAB_TOOLKIT" not in source


# --- the notebooks, executed -----------------------------------------------------------------
@dataclass
class Execution:
    notebook: nbformat.NotebookNode
    error: BaseException | None
    status: dict[str, Any]
    """The relay's /api/status after the notebook finished."""


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def kernel_specs(tmp_path_factory: pytest.TempPathFactory) -> KernelSpecManager:
    """This venv's interpreter as the ``collab-ci`` kernel."""
    return kernel_spec_manager(tmp_path_factory.mktemp("kernels"), sys.executable)


def execute(
    name: str, home: Path, kernel_specs: KernelSpecManager, overrides: dict[str, dict[str, Any]] | None = None
) -> Execution:
    """``name`` run in a fresh kernel against a relay of its own (the tiny demo run, ``overrides``
    merged in): the peer is alone, so its numbers are exact."""
    records, relay_logger = Records(), logging.getLogger("relay_server")
    with ExitStack() as stack:
        stack.callback(relay_logger.setLevel, relay_logger.level)
        stack.callback(relay_logger.removeHandler, records)
        relay_logger.addHandler(records)
        relay_logger.setLevel(logging.DEBUG)  # every line the relay could write, not just warnings
        relay = stack.enter_context(running_relay(home, overrides))
        km = AsyncKernelManager(kernel_name="collab-ci", kernel_spec_manager=kernel_specs)
        client = NotebookClient(load(name), km=km, timeout=240, resources={"metadata": {"path": str(home)}})

        async def run() -> BaseException | None:
            try:
                await client.async_execute(env=kernel_env(relay.url, home))
                return None
            except Exception as exc:  # reported by the test, with the cell's output
                return exc
            finally:  # nbclient leaves a kernel it was given running
                if client.km.has_kernel:
                    await client.km.shutdown_kernel(now=True)

        error = asyncio.run(run())
        execution = Execution(notebook=client.nb, error=error, status=status(relay.url))
    assert records.lines and not any(FAKE_TOKEN in line for line in records.lines), "the HF token was logged"
    return execution


# The four cells are one cell but for the default relay URL (the test above), which the
# environment overrides here: the default suite executes one of them, -m slow all four.
@pytest.mark.parametrize(
    "name", [name if name == "colab" else pytest.param(name, marks=pytest.mark.slow) for name in NOTEBOOKS]
)
@pytest.mark.integration
def test_notebook_runs_headless_and_contributes(name: str, tmp_path: Path, kernel_specs: KernelSpecManager) -> None:
    run = execute(name, tmp_path, kernel_specs)
    cell = code_cells(run.notebook)[0]
    text = outputs_text(cell)
    assert run.error is None, f"{run.error}\n{text}"
    result = re.search(
        r"^Contributed ([\d,]+) samples over (\d+) steps \(first contribution ([\d.]+) s after "
        r"joining\); left at step (\d+) after \d+ s\.$",
        text,
        re.M,
    )
    assert result, f"no summary in the output:\n{text}"
    contributed = int(result.group(1).replace(",", ""))
    assert contributed == MAX_STEPS * TINY_LM["run"]["target_batch"]  # alone: every sample of its steps
    assert int(result.group(2)) == int(result.group(4)) == MAX_STEPS
    # The relay's books agree with the notebook, sample for sample.
    assert [e["samples"] for e in run.status["leaderboard"]] == [contributed]
    assert run.status["step"] == MAX_STEPS
    assert f"{result.group(3)} s after join" in text  # the panel shows the summary's number
    # The widget panel closed into a static copy of its final state, in place: a few outputs, no flood.
    assert "your contribution" in text and f"{contributed:,} samples" in text and "s after join" in text
    assert len(cell.outputs) <= 4, [o.output_type for o in cell.outputs]
    assert all(hint in text for hint in notebook.platform_hints())  # here: the no-platform branch
    assert FAKE_TOKEN not in text


@pytest.mark.integration
def test_the_same_cell_joins_a_local_sgd_run(tmp_path: Path, kernel_specs: KernelSpecManager) -> None:
    """Nothing new to type in the low-bandwidth mode: the cell's ``join()`` runs the inner loop and
    the outer rounds by itself, and the relay's books agree with what the notebook says it gave."""
    inner_steps = 3
    run = execute(
        "colab",
        tmp_path,
        kernel_specs,
        {
            "run": {**TINY_LM["run"], "mode": "local_sgd"},
            "local_sgd": {"inner_steps": inner_steps, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False},
        },
    )
    text = outputs_text(code_cells(run.notebook)[0])
    assert run.error is None, f"{run.error}\n{text}"
    result = re.search(r"^Contributed ([\d,]+) samples over (\d+) steps", text, re.M)
    assert result, f"no summary in the output:\n{text}"
    contributed = int(result.group(1).replace(",", ""))
    assert int(result.group(2)) == MAX_STEPS == run.status["step"]
    rounds = run.status["recent_rounds"]
    assert [r["contributors"] for r in rounds] == [1] * MAX_STEPS
    # each outer round holds exactly one inner loop of this peer: inner_steps micro-batches
    assert len({r["samples"] for r in rounds}) == 1 and rounds[0]["samples"] % inner_steps == 0, rounds
    assert [e["samples"] for e in run.status["leaderboard"]] == [contributed] == [sum(r["samples"] for r in rounds)]


# --- the helpers the cell uses ---------------------------------------------------------------
@pytest.fixture
def no_platform(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    for var in PLATFORM_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(notebook, "_saved_hub_token", lambda: None)  # not this machine's own login
    return monkeypatch


def fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: Any) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, module)


def test_hf_token_comes_from_the_platform_store_first(no_platform: pytest.MonkeyPatch) -> None:
    no_platform.setenv("HF_TOKEN", "from-env")
    no_platform.setenv("COLAB_RELEASE_TAG", "release")
    fake_module(no_platform, "google.colab", userdata=types.SimpleNamespace(get=lambda name: f"colab-{name}"))
    assert notebook.hf_token() == "colab-HF_TOKEN"

    no_platform.delenv("COLAB_RELEASE_TAG")
    no_platform.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")

    class Secrets:
        def get_secret(self, name: str) -> str:
            return f"kaggle-{name}"

    fake_module(no_platform, "kaggle_secrets", UserSecretsClient=Secrets)
    assert notebook.hf_token() == "kaggle-HF_TOKEN"


def test_a_saved_huggingface_cli_login_is_used_before_asking(no_platform: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    no_platform.undo()  # the real _saved_hub_token, reading through huggingface_hub
    for var in PLATFORM_VARS:
        no_platform.delenv(var, raising=False)
    no_platform.setattr(huggingface_hub, "get_token", lambda: "saved-login")
    no_platform.setattr(notebook.getpass, "getpass", lambda prompt: pytest.fail("asked despite a saved login"))
    assert notebook.hf_token() == "saved-login"


def test_a_refusing_store_falls_back_to_the_environment_then_the_prompt(no_platform: pytest.MonkeyPatch) -> None:
    def refuse(name: str) -> str:
        raise RuntimeError("NotebookAccessError")

    no_platform.setenv("COLAB_RELEASE_TAG", "release")
    fake_module(no_platform, "google.colab", userdata=types.SimpleNamespace(get=refuse))
    no_platform.setenv("HF_TOKEN", "from-env")
    assert notebook.hf_token() == "from-env"

    no_platform.delenv("HF_TOKEN")
    asked: list[str] = []
    no_platform.setattr(notebook.getpass, "getpass", lambda prompt: asked.append(prompt) or "  typed  ")
    assert notebook.hf_token() == "typed" and "Enter to skip" in asked[0]
    no_platform.setattr(notebook.getpass, "getpass", lambda prompt: "")
    assert notebook.hf_token() is None  # Enter: no token (open runs)
    assert notebook.hf_token(prompt=False) is None


def test_a_kernel_without_stdin_gets_no_token_instead_of_an_error(no_platform: pytest.MonkeyPatch) -> None:
    def no_stdin(prompt: str) -> str:
        raise NotImplementedError("raw_input was called, but this frontend does not support input requests")

    no_platform.setattr(notebook.getpass, "getpass", no_stdin)
    assert notebook.hf_token() is None


def device(kind: str = "cpu", platform: str | None = None, **extra: Any) -> DeviceInfo:
    return DeviceInfo(kind=kind, name=kind, memory_bytes=None, torch_version="2.5.1+cu121", platform=platform, **extra)


@pytest.mark.parametrize(
    ("info", "env", "expected"),
    [
        (device("cuda", "kaggle"), {}, []),
        (device("cpu", "kaggle"), {}, ["Kaggle: no accelerator; Settings -> Accelerator -> GPU T4 x2"]),
        (device("cpu", "colab"), {}, ["Runtime -> Change runtime type -> T4 GPU"]),
        (device("cuda", "colab"), {}, []),
        (device("tpu", "colab", torch_xla_version="2.5.1"), {}, ["preinstalled torch 2.5.1+cu121 / torch_xla 2.5.1"]),
        (device("cpu", "colab"), {"COLAB_TPU_ADDR": "10.0.0.2:8470"}, ["torch_xla is not usable", "torch~=2.5.0"]),
        (device("cpu", None), {}, ["No accelerator found: contributing on CPU"]),
    ],
)
def test_platform_hints_are_one_line_each_and_name_the_fix(
    no_platform: pytest.MonkeyPatch, info: DeviceInfo, env: dict[str, str], expected: list[str]
) -> None:
    for key, value in env.items():
        no_platform.setenv(key, value)
    hints = notebook.platform_hints(info)
    assert len(hints) == (1 if expected else 0) and all("\n" not in h for h in hints)
    for fragment in expected:
        assert fragment in hints[0]
