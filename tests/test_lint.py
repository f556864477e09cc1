"""The tree passes ruff's formatter check and lint (pyproject.toml's ``[tool.ruff]``: line length 119,
pyflakes, syntax, sorted imports), as part of the suite the README's test command runs, so CI
cannot skip it."""

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
