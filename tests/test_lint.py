"""The tree passes ruff's formatter check and lint (pyproject.toml's ``[tool.ruff]``: line length 119,
pyflakes, syntax, sorted imports) and mypy on what ``[tool.mypy]`` covers (the toolkit's shared
layer and the relay's lower units, every ``type: ignore`` with its code; the shared layer all of it),
as part of the suite the README's test command runs, so CI cannot skip them."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import REPO
from tests.test_layout import SHARED, module_files, unit_of

linter = pytest.mark.integration  # runs ruff or mypy, a process


@linter
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


@linter
def test_ruff_format_changes_nothing() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"files ruff format would change (run `ruff format .`):\n{done.stdout}{done.stderr}"


@linter
@pytest.mark.timeout(600)  # a first run without .mypy_cache analyzes torch's stubs too (~1 min of CPU); then ~1 s
def test_mypy_finds_nothing() -> None:
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, (
        "mypy found type errors in what pyproject.toml's [tool.mypy] covers (fix the types, or add "
        "`# type: ignore[code]` with a comment saying why; mypy comes with pip install -e '.[test]'):\n"
        f"{done.stdout}{done.stderr}"
    )


def test_mypy_covers_the_shared_layer() -> None:
    """Every module of a unit toolkit/__init__.py lists under "The shared layer" is in what
    ``[tool.mypy]`` checks: a unit added to the layer, or a module added to a unit, is typed too."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    covered = [REPO / entry for entry in config["files"]]
    excludes = config.get("exclude", [])
    exclude = re.compile("|".join(excludes if isinstance(excludes, list) else [excludes]) or "(?!)")
    missing = [
        rel
        for name, path in module_files().items()
        if name.startswith("toolkit.") and unit_of(name) in SHARED
        for rel in [path.relative_to(REPO).as_posix()]
        if exclude.search(rel) or not any(path == c or c in path.parents for c in covered)
    ]
    assert SHARED and not missing, (
        "shared-layer modules mypy does not check (add them to [tool.mypy] files in pyproject.toml, "
        f"or take them out of exclude): {missing}"
    )
