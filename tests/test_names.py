"""Names that explain themselves: no two modules or classes of the package share a name for different things.

A reader who meets ``stages`` or ``PlanError`` must not have to ask "which one?". Scanned: every
module file of ``toolkit/`` and ``relay_server/`` (``__init__`` excluded) by its basename, and every
public class defined at a module's top level by its name (a private ``_Helper`` is its module's own
business). Two classes of one name are always two things: were they one, the second module would
import it.

A basename may name *one* concept in several layers, e.g. the DMoE's wire messages
(``toolkit/wire/protocol/moe.py``) and its client calls (``toolkit/client/moe.py``): the folder says
the layer and the name says the concept. :data:`ONE_CONCEPT` lists those, path by path, so a new
module that reuses such a name for something else fails here too.

:data:`KNOWN_COLLISIONS` lists the collisions that other work in progress (issue 36) restructures;
each is to be renamed there and then dropped from the list. The list only shrinks: an entry that no
longer collides, exactly as listed, fails the test, so a rename must also remove its line.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.support.source import parse_source

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("toolkit", "relay_server")

ONE_CONCEPT: dict[str, set[str]] = {
    # one feature, one module per layer: its wire messages, its client calls, its relay routes/state
    "moe": {"toolkit/client/moe.py", "toolkit/wire/protocol/moe.py"},
    "params": {"toolkit/client/params.py", "toolkit/wire/protocol/params.py"},
    "pipeline": {"toolkit/client/pipeline.py", "toolkit/wire/protocol/pipeline.py"},
    "shards": {"toolkit/data/shards.py", "toolkit/wire/protocol/shards.py", "relay_server/api/shards.py"},
    # each feature's plug (relay_server/<feature>/feature.py) and the contract they meet
    "feature": {
        "relay_server/api/feature.py",
        "relay_server/moe/feature.py",
        "relay_server/pipeline/feature.py",
        "relay_server/local_sgd/feature.py",
        "relay_server/evaluation/feature.py",
    },
    "status": {
        "toolkit/wire/protocol/status.py",
        "relay_server/collaboration/status.py",
        "relay_server/pipeline/status.py",
    },
    # each side's errors: the relay's ApiError is a toolkit CollabError with an HTTP status
    "errors": {"toolkit/errors.py", "relay_server/core/errors.py"},
}
"""Basenames that name one concept in several layers, with every module that carries each."""

KNOWN_COLLISIONS: dict[str, set[str]] = {}
"""Collisions waiting for a rename, ``name`` for modules and ``class Name`` for classes. Only shrinks."""


def names_in_use(repo: Path = REPO) -> dict[str, set[str]]:
    """Every module basename and every ``class Name`` under ``repo``'s package roots, with the files
    that carry it."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in (p for root in ROOTS for p in sorted((repo / root).rglob("*.py"))):
        rel = path.relative_to(repo).as_posix()
        if path.name != "__init__.py":
            found[path.stem].add(rel)
        for node in parse_source(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                found[f"class {node.name}"].add(rel)
    return found


def collisions(repo: Path = REPO) -> dict[str, set[str]]:
    return {name: files for name, files in names_in_use(repo).items() if len(files) > 1}


def test_no_two_modules_or_classes_share_a_name() -> None:
    unexplained = {
        name: sorted(files)
        for name, files in collisions().items()
        if files != ONE_CONCEPT.get(name) and files != KNOWN_COLLISIONS.get(name)
    }
    assert not unexplained, (
        "names carried by more than one module or class:\n"
        + "\n".join(f"  {name}: {', '.join(files)}" for name, files in sorted(unexplained.items()))
        + "\nRename one so the name says which thing it is (e.g. toolkit/data/input_pipeline.py, not "
        "data/pipeline.py). Only if modules are one concept in different layers, list them in ONE_CONCEPT."
    )


def test_allowlists_only_hold_collisions_that_exist() -> None:
    """A rename that ends a listed collision removes its line: the lists only shrink."""
    now = collisions()
    stale = {
        name: sorted(files)
        for lists in (ONE_CONCEPT, KNOWN_COLLISIONS)
        for name, files in lists.items()
        if now.get(name) != files
    }
    assert not stale, "these entries no longer match the tree (drop the line, or fix its files):\n" + "\n".join(
        f"  {name}: {', '.join(files)} (now: {sorted(now.get(name, ()))})" for name, files in sorted(stale.items())
    )
    assert not set(ONE_CONCEPT) & set(KNOWN_COLLISIONS)


def test_the_scan_finds_modules_and_classes_of_one_name(tmp_path: Path) -> None:
    """Not vacuous: across the two roots, a shared basename, a shared public class and nested
    packages are all seen; ``__init__`` and private classes are not."""
    files = {
        "toolkit/data/stages.py": "class Plan:\n    pass\n\n\nclass _Json:\n    pass\n",
        "relay_server/pipeline/deep/stages.py": "class _Json:\n    pass\n",
        "relay_server/planning/problem.py": "class Plan:\n    pass\n",
        "toolkit/__init__.py": "",
        "relay_server/__init__.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert collisions(tmp_path) == {
        "stages": {"toolkit/data/stages.py", "relay_server/pipeline/deep/stages.py"},
        "class Plan": {"toolkit/data/stages.py", "relay_server/planning/problem.py"},
    }
