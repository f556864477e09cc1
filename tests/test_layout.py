"""The tree shows the architecture: imports only go downward.

Walks every import statement of the project's modules (lazy ones inside functions included, but
not those under ``if TYPE_CHECKING:``, which never run) and asserts that there is no cycle among
modules nor among subpackages, that each unit imports only from the units declared below it (the
order the ``toolkit`` and ``relay_server`` ``__init__`` docstrings state, read from there: they are
the one statement of the layering), that the relay imports only the toolkit's shared layer (the
units ``toolkit/__init__.py`` lists under "The shared layer", every module of which mypy checks:
pyproject.toml's ``[tool.mypy]``), that ARCHITECTURE.md draws the same
order, that the peer side never imports the relay, that no module holds more than one sitting's
reading (past 400 lines a warning names it; past 600 it fails), and that none was squeezed.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
import tomllib
import warnings
from pathlib import Path

from tests.support.source import parse_source

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("toolkit", "relay_server", "research")
MAX_LINES = 400  # a hint to look for a seam (a warning)
HARD_MAX_LINES = 600  # more than one concern

SHARED_HEADING, PEER_HEADING = "The shared layer", "The peer side"
"""The paragraphs of ``toolkit/__init__.py``'s docstring that open its two lists of units."""


def declared_units(package: str) -> list[str]:
    """The units ``package``'s ``__init__`` docstring lists, lowest first: its ``* :mod:`name```
    lines, the one place the layering is stated."""
    doc = ast.get_docstring(parse_source((REPO / package / "__init__.py").read_text())) or ""
    return re.findall(r"^\* :mod:`([\w.]+)`", doc, re.M)


def shared_layer() -> list[str]:
    """The toolkit units the relay may import: those listed between the docstring's two headings."""
    doc = ast.get_docstring(parse_source((REPO / "toolkit" / "__init__.py").read_text())) or ""
    assert SHARED_HEADING in doc and PEER_HEADING in doc, (
        f"toolkit/__init__.py's docstring must open its unit lists with {SHARED_HEADING!r} and {PEER_HEADING!r}"
    )
    return re.findall(r"^\* :mod:`([\w.]+)`", doc[doc.index(SHARED_HEADING) : doc.index(PEER_HEADING)], re.M)


# Lowest first. A unit imports only units listed before it (and modules of its own unit).
LAYERS = [
    *declared_units("toolkit"),
    "toolkit",
    *declared_units("relay_server"),
    "relay_server",
    "research",
]  # the papers' algorithms, reproduced to test against: above the product, which never imports them
SHARED = shared_layer()


def module_files() -> dict[str, Path]:
    mods = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    return skip


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports: ``from a.b import c`` counts as a.b.c when c is a module."""
    tree = parse_source(path.read_text())
    skip = _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in mods and t != name)
    return found


def unit_of(module: str) -> str:
    """The longest declared unit ``module`` is or lies in (``toolkit.moe.host`` inside ``toolkit.moe``)."""
    return max((u for u in LAYERS if module == u or module.startswith(u + ".")), key=len)


def subpackage_of(module: str) -> str:
    """``toolkit.moe`` for ``toolkit.moe.host``: the package's direct child a module belongs to."""
    return ".".join(module.split(".")[:2])


def folder_node(module: str) -> str:
    """What ``module`` counts as among folders: its subpackage, except a unit the relay declares
    inside one of its folders, which counts on its own (``relay_server.moe.feature``, the DMoE
    folder's routes, sits above the app's feature contract while ``relay_server.moe.moe_config``,
    its config section, sits below the run's config)."""
    sub, unit = subpackage_of(module), unit_of(module)
    return unit if module.startswith("relay_server.") and unit.startswith(sub + ".") else sub


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep, stack + [dep])):
                return cycle
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name, [name])):
            return cycle
    return None


MODULES = module_files()
GRAPH = {name: imports_of(name, path, MODULES) for name, path in MODULES.items()}


def test_no_import_cycle_among_modules() -> None:
    cycle = find_cycle(GRAPH)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_among_subpackages() -> None:
    """Units inside one subpackage may sit in different layers (``toolkit.moe``'s math is shared,
    its ``host`` is the peer's), so the layer order alone would let ``toolkit.moe.host`` import
    ``toolkit.client`` while ``toolkit.client`` imports ``toolkit.moe``: this refuses that.

    The relay's feature folders span layers by design (:func:`folder_node`): a feature's config
    section is part of the run's config, low; its routes plug into the app, high; its state and
    service sit between. Each unit such a folder declares is checked on its own here, and the
    layer order keeps them acyclic; a relay folder that declares no unit inside is one node, as
    every toolkit folder is."""
    packages: dict[str, set[str]] = {}
    for mod, deps in GRAPH.items():
        packages.setdefault(folder_node(mod), set()).update(
            folder_node(d) for d in deps if folder_node(d) != folder_node(mod)
        )
    cycle = find_cycle(packages)
    assert not cycle, (
        "subpackage cycle: " + " -> ".join(cycle) + ". Move the module both sides need into the "
        "lower subpackage (or the shared layer), so the imports go one way."
    )


def test_every_module_lies_in_a_declared_unit_and_every_unit_exists() -> None:
    declaring = ("toolkit", "relay_server")  # these roots hold only their __init__: their docstrings list the units
    units = [u for u in LAYERS if u not in declaring]
    stray = sorted(
        m for m in MODULES if m not in declaring and not any(m == u or m.startswith(u + ".") for u in units)
    )
    assert not stray, (
        f"modules in no declared unit: {stray}. List each new subpackage or module in its package's "
        "__init__ docstring (toolkit/__init__.py or relay_server/__init__.py), at its layer"
    )
    missing = sorted(u for u in LAYERS if u not in MODULES)
    assert not missing, f"units the __init__ docstrings list but the tree lacks: {missing}"
    assert SHARED and SHARED == declared_units("toolkit")[: len(SHARED)], (
        "the shared layer is the toolkit's lowest units: list them first in toolkit/__init__.py"
    )


def test_the_relay_imports_only_the_shared_layer() -> None:
    outside = sorted(
        f"{mod} -> {dep} (unit {unit_of(dep)})"
        for mod, deps in GRAPH.items()
        if mod.startswith("relay_server")
        for dep in deps
        if dep.startswith("toolkit") and unit_of(dep) not in SHARED
    )
    assert not outside, (
        "the relay imports toolkit modules outside the shared layer (toolkit/__init__.py lists it):\n"
        + "\n".join(outside)
        + "\nMove what both sides need into a shared unit, or find the seam "
        "that keeps the relay off the peer side."
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


def test_the_toolkit_never_imports_the_relay() -> None:
    upward = sorted(
        f"{mod} -> {dep}"
        for mod, deps in GRAPH.items()
        if mod.startswith("toolkit")
        for dep in deps
        if dep.startswith("relay_server")
    )
    assert not upward, "the peer side imports the relay:\n" + "\n".join(upward)


def architecture_drawing() -> tuple[list[str], list[str], list[str]]:
    """ARCHITECTURE.md's two columns, each turned into unit names, lowest first: the toolkit's,
    the shared layer's (the toolkit rows below the ``shared layer`` line), and the relay's."""
    text = (REPO / "ARCHITECTURE.md").read_text()
    section = text[text.index("## Two packages, each layered") :]
    lines = section.split("```")[1].strip("\n").splitlines()
    split = lines[0].index("relay_server/")
    toolkit: list[str] = []
    relay: list[str] = []
    shared_from = None
    for line in lines[1:]:
        left, right = line[:split], line[split:]
        if "shared layer" in left:
            shared_from = len(toolkit)
        elif left.strip():
            toolkit.append("toolkit." + left.split()[0].rstrip("/").replace("/", "."))
        if right.strip():
            relay.append("relay_server." + right.split()[0].rstrip("/").replace("/", "."))
    assert shared_from is not None, "ARCHITECTURE.md's drawing lost its 'the shared layer' line"
    return toolkit[::-1], toolkit[shared_from:][::-1], relay[::-1]


def test_architecture_md_draws_the_layering_the_code_states() -> None:
    toolkit, shared, relay = architecture_drawing()
    assert toolkit == declared_units("toolkit"), (
        f"ARCHITECTURE.md draws the toolkit's units as {toolkit}, toolkit/__init__.py lists {declared_units('toolkit')}"
    )
    assert shared == SHARED, f"ARCHITECTURE.md's shared layer is {shared}, toolkit/__init__.py's is {SHARED}"
    assert relay == declared_units("relay_server"), (
        f"ARCHITECTURE.md draws the relay's units as {relay}, relay_server/__init__.py lists "
        f"{declared_units('relay_server')}"
    )


def test_units_import_only_downward() -> None:
    rank = {unit: i for i, unit in enumerate(LAYERS)}
    upward = sorted(
        f"{mod} -> {dep}"
        for mod, deps in GRAPH.items()
        for dep in deps
        if unit_of(dep) != unit_of(mod) and rank[unit_of(dep)] > rank[unit_of(mod)]
    )
    assert not upward, (
        "imports against the layer order (toolkit/__init__.py and relay_server/__init__.py state it):\n"
        + "\n".join(upward)
    )


def test_every_subpackage_says_what_it_owns() -> None:
    for name, path in module_files().items():
        if path.name == "__init__.py":
            doc = ast.get_docstring(parse_source(path.read_text()))
            assert doc and len(doc) > 60, f"{name}/__init__.py needs a docstring saying what it owns"


def layout_doc() -> tuple[list[str], list[str], list[str]]:
    """docs/layout.md's list (README's "Layout" links to it) as unit names, lowest first: the
    toolkit's entries, those under its ``-- the shared layer`` line (up to the next ``--`` line),
    and the relay's. An entry is a line indented two spaces, naming its paths before the first
    wide gap (``signing.py, transfer.py, client/``); paths that are no module (``defaults/``) are
    not units."""
    block = (REPO / "docs" / "layout.md").read_text().split("```")[1]
    names: dict[str, list[str]] = {"toolkit": [], "relay_server": []}
    package, shared, in_shared = "toolkit", [], False
    for line in block.splitlines():
        if re.match(r"(toolkit|relay_server)/ ", line):
            package = line.split("/")[0]
        elif line.startswith("  --"):
            in_shared = "shared layer" in line
        elif re.match(r"  \S", line) and package in names:
            for path in re.split(r"\s{2,}", line.strip())[0].split(", "):
                unit = f"{package}." + path.rstrip("/").removesuffix(".py").replace("/", ".")
                if unit in MODULES:
                    names[package].append(unit)
                    shared += [unit] if in_shared else []
    return names["toolkit"], shared, names["relay_server"]


def test_docs_layout_lists_the_units_in_the_order_the_code_states() -> None:
    toolkit, shared, relay = layout_doc()
    assert toolkit == declared_units("toolkit"), (
        f"docs/layout.md lists the toolkit as {toolkit}, toolkit/__init__.py as {declared_units('toolkit')}"
    )
    assert shared == SHARED, f"docs/layout.md puts {shared} in the shared layer, toolkit/__init__.py {SHARED}"
    assert relay == declared_units("relay_server"), (
        f"docs/layout.md lists the relay as {relay}, relay_server/__init__.py as {declared_units('relay_server')}"
    )


def test_modules_stay_small() -> None:
    """Past ~400 lines a module is worth reading for a seam (a class or concern that stands on its
    own): a warning, not a gate to squeeze under. Past 600 it holds more than one concern: split it."""
    sizes = {name: len(path.read_text().splitlines()) for name, path in module_files().items()}
    if big := {name: n for name, n in sizes.items() if n > MAX_LINES}:
        warnings.warn(f"modules over {MAX_LINES} lines, worth reading for a seam: {big}", stacklevel=1)
    too_big = {name: n for name, n in sizes.items() if n > HARD_MAX_LINES}
    assert not too_big, (
        f"modules over {HARD_MAX_LINES} lines: {too_big}. Split each along a seam: a class or "
        "concern that stands on its own moves into its own module of the subpackage."
    )


def squeezes(path: Path) -> list[str]:
    """What squeezing a module under the size limit leaves behind, where the code otherwise never has
    it: statements joined with ``;``, a block's body on its header line (only a Protocol's ``...``
    stub may be), a ``def``/``class`` line carrying a comment where its docstring belongs, and
    definitions without PEP 8's blank lines before them (two at module level, one in a class)."""
    text = path.read_text()
    lines, tree, found = text.splitlines(), parse_source(text), []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.OP and tok.string == ";":
            found.append(f"line {tok.start[0]}: statements joined with ';'")
    for node in ast.walk(tree):
        if isinstance(node, (ast.stmt, ast.ExceptHandler)) and hasattr(node, "body") and isinstance(node.body, list):
            first = node.body[0]
            stub = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and first.value.value is ...
            if first.lineno == node.lineno and not stub:
                found.append(f"line {node.lineno}: a block's body on its header line")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            header_end = node.body[0].lineno - 1 if node.body[0].lineno > node.lineno else node.lineno
            header = re.sub(r"\s+# type: ignore\[[a-z, -]+\]$", "", lines[header_end - 1])  # mypy's, not prose
            if re.search(r":\s+#", header) and not header.lstrip().startswith("#"):
                found.append(f"line {header_end}: a comment on the {node.name} line (say it in a docstring)")

    def gaps(body: list[ast.stmt], need: int) -> None:
        for before, node in zip(body, body[1:]):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                i = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 2  # the line above, 0-based
                while i >= 0 and lines[i].lstrip().startswith("#"):
                    i -= 1
                blank = 0
                while i >= 0 and not lines[i].strip():
                    blank, i = blank + 1, i - 1
                if blank < need:
                    found.append(f"line {node.lineno}: {node.name} needs {need} blank line(s) before it")
            if isinstance(node, ast.ClassDef):
                gaps(node.body, 1)
        if body and isinstance(body[0], ast.ClassDef):
            gaps(body[0].body, 1)

    gaps(tree.body, 2)
    return found


def test_code_is_not_squeezed() -> None:
    squeezed = {name: found for name, path in module_files().items() if (found := squeezes(path))}
    assert not squeezed, (
        "code squeezed (restore the docstrings and the lines; split a module that is too long along "
        "a seam instead):\n" + "\n".join(f"{name}: {found}" for name, found in squeezed.items())
    )


def test_docstrings_cite_documents_that_exist() -> None:
    """A docstring citing ``DESIGN.md s3`` sends the reader to a file and section of this repository."""
    sections = {int(n) for n in re.findall(r"^## (\d+)\.", (REPO / "DESIGN.md").read_text(), re.M)}
    for name, path in module_files().items():
        text = path.read_text()
        for doc in set(re.findall(r"\b([A-Za-z_][\w/]*\.md)\b", text)):
            assert (REPO / doc).is_file(), f"{name} cites {doc}, which is not in the repository"
        for first, last in re.findall(r"DESIGN\.md (?:s|sections? )(\d+)(?:-(\d+))?", text):
            cited = range(int(first), int(last or first) + 1)
            assert set(cited) <= sections, f"{name} cites DESIGN.md section {first}{'-' + last if last else ''}"


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports (lazy ones included), with its line."""
    found = []
    for node in ast.walk(parse_source(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
    return found


def test_tests_import_no_benchmark_and_no_conftest_and_benchmarks_no_test() -> None:
    """One harness (``relay_server.harness``) for tests, demo and benchmarks: a test needing what a
    benchmark has means that thing belongs in the harness (or ``research/``), and a helper in
    ``tests/conftest.py`` belongs in ``tests/support/`` (conftest holds fixtures, which pytest
    hands out). A benchmark importing a test module would tie measurements to test scaffolding."""
    scripts = {p.stem for p in (REPO / "benchmarks").glob("*.py")}  # importable bare once on sys.path
    wrong = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for line, module in _imported_modules(path):
            top = module.split(".")[0]
            if top in ("benchmarks", "conftest") or top in scripts or module.startswith("tests.conftest"):
                wrong.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        for line, module in _imported_modules(path):
            if module.split(".")[0] == "tests":
                wrong.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not wrong, (
        "tests import no benchmark and no tests/conftest.py, benchmarks no test module: move what both "
        "need into relay_server/harness/ (or research/), a test helper into tests/support/:\n" + "\n".join(wrong)
    )
