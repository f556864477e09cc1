"""The tree passes ruff's formatter check and lint (pyproject.toml's ``[tool.ruff]``: line length 119,
pyflakes, syntax, sorted imports) and mypy on what ``[tool.mypy]`` covers (the toolkit's shared
layer, which tests/test_layout.py checks is all in it, and the relay's lower units; every
``type: ignore`` with its code), as part of the suite the README's test command runs, so CI
cannot skip them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.processes import REPO

pytestmark = pytest.mark.integration  # runs ruff, a process


def test_ruff_finds_nothing() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (
        f"ruff check found problems (fix them, or run `ruff check --fix .`):\n{done.stdout}{done.stderr}"
    )


def test_ruff_format_changes_nothing() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"files ruff format would change (run `ruff format .`):\n{done.stdout}{done.stderr}"


@pytest.mark.timeout(600)  # a first run without .mypy_cache analyzes torch's stubs too (~1 min of CPU); then ~1 s
def test_mypy_finds_nothing() -> None:
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, (
        "mypy found type errors in what pyproject.toml's [tool.mypy] covers (fix the types, or add "
        "`# type: ignore[code]` with a comment saying why; mypy comes with pip install -e '.[test]'):\n"
        f"{done.stdout}{done.stderr}"
    )
