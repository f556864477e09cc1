"""The tree shows the architecture: imports only go downward.

Walks every import statement of the project's modules (lazy ones inside functions included, but
not those under ``if TYPE_CHECKING:``, which never run) and asserts that there is no cycle among
modules, that each subpackage imports only from the layers declared below it (the order the
packages' ``__init__`` docstrings state), that the peer side never imports the relay, that no
module outgrows what a reader takes in at one sitting, and that none was squeezed to stay under it.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("toolkit", "relay_server", "research")
MAX_LINES = 400

# Lowest first. A unit imports only units listed before it (and modules of its own unit).
LAYERS = [
    "toolkit.errors", "toolkit.wire", "toolkit.runtime", "toolkit.corpus", "toolkit.moe", "toolkit.models", "toolkit.signing", "toolkit.transfer", "toolkit.client", "toolkit.run_membership", "toolkit.moe.remote", "toolkit.moe.host", "toolkit.accumulator", "toolkit.worker",
    "toolkit.data", "toolkit.optim_base", "toolkit.optimizer", "toolkit.pipeline", "toolkit.integrations", "toolkit.notebook", "toolkit.roles", "toolkit.session", "toolkit.peer",
    "toolkit",
    "relay_server.core", "relay_server.auth", "relay_server.tasks", "relay_server.moe", "relay_server.rounds", "relay_server.planning",
    "relay_server.observers", "relay_server.data", "relay_server.backbone", "relay_server.collaboration",
    "relay_server.pipeline",
    "relay_server.api", "relay_server.aggregator", "relay_server.demo", "relay_server.notebooks", "relay_server.cli", "relay_server",
    "research",  # the papers' algorithms, reproduced to test against: above the product, which never imports them
]


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
    tree = ast.parse(path.read_text())
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
    return max((u for u in LAYERS if module == u or module.startswith(u + ".")), key=len)


GRAPH = {name: imports_of(name, path, module_files()) for name, path in module_files().items()}


def test_no_import_cycle_among_modules() -> None:
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(GRAPH[node]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep] if dep in stack else [node, dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])


def test_units_import_only_downward() -> None:
    rank = {unit: i for i, unit in enumerate(LAYERS)}
    upward = sorted(f"{mod} -> {dep}" for mod, deps in GRAPH.items() for dep in deps
                    if unit_of(dep) != unit_of(mod) and rank[unit_of(dep)] > rank[unit_of(mod)])
    assert not upward, "imports against the layer order (see relay_server/__init__.py):\n" + "\n".join(upward)


def test_every_subpackage_says_what_it_owns() -> None:
    for name, path in module_files().items():
        if path.name == "__init__.py":
            doc = ast.get_docstring(ast.parse(path.read_text()))
            assert doc and len(doc) > 60, f"{name}/__init__.py needs a docstring saying what it owns"


def test_modules_stay_small() -> None:
    big = {name: n for name, path in module_files().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not big, (f"modules over {MAX_LINES} lines: {big}. Split each along a seam: a class or concern that stands "
                     "on its own moves into its own module of the subpackage. Never squeeze one under the limit "
                     "(docstrings turned into comments, merged lines): test_code_is_not_squeezed refuses that.")


def squeezes(path: Path) -> list[str]:
    """What squeezing a module under the size limit leaves behind, where the code otherwise never has
    it: statements joined with ``;``, a block's body on its header line (only a Protocol's ``...``
    stub may be), a ``def``/``class`` line carrying a comment where its docstring belongs, and
    definitions without PEP 8's blank lines before them (two at module level, one in a class)."""
    text = path.read_text()
    lines, tree, found = text.splitlines(), ast.parse(text), []
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
            if re.search(r":\s+#", lines[header_end - 1]) and not lines[header_end - 1].lstrip().startswith("#"):
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
    assert not squeezed, ("code squeezed (restore the docstrings and the lines; split a module that is too long along "
                          f"a seam instead):\n" + "\n".join(f"{name}: {found}" for name, found in squeezed.items()))


def test_docstrings_cite_documents_that_exist() -> None:
    """A docstring citing ``DESIGN.md s3`` sends the reader to a file and section of this repository."""
    sections = {int(n) for n in re.findall(r"^## (\d+)\.", (REPO / "DESIGN.md").read_text(), re.M)}
    for name, path in module_files().items():
        text = path.read_text()
        for doc in set(re.findall(r"\b([A-Za-z_]+\.md)\b", text)):
            assert (REPO / doc).is_file(), f"{name} cites {doc}, which is not in the repository"
        for first, last in re.findall(r"DESIGN\.md (?:s|sections? )(\d+)(?:-(\d+))?", text):
            cited = range(int(first), int(last or first) + 1)
            assert set(cited) <= sections, f"{name} cites DESIGN.md section {first}{'-' + last if last else ''}"
