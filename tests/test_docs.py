"""The documentation holds together: the README stays a quick start that links every page under
``docs/``, every relative link and anchor resolves, every block marked runnable parses, no page
points at an issue number, and docs/configuration.md names every field the relay reads.

A fenced block whose info string ends in ``runnable`` (```` ```bash runnable ````, ```` ```python
runnable ````) is a command or program a reader can paste as it is: it must parse (``bash -n``,
``ast.parse``). Other blocks (TOML excerpts, systemd units, shell lines with placeholders such as
``--url ...``) are not checked here; the tests that load them say so where they do.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.source import parse_source

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
README = REPO / "README.md"
README_MAX_LINES = 250


def pages() -> list[Path]:
    """Every Markdown page a reader is pointed to: the README, docs/, and the top-level guides."""
    extra = [REPO / name for name in ("ARCHITECTURE.md", "CONTRIBUTING.md") if (REPO / name).exists()]
    return [README, *sorted(DOCS.glob("*.md")), *extra]


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks (a ``#`` in a TOML block is no heading)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced code block."""
    return [(m[1].strip(), m[2]) for m in re.finditer(r"^```([^\n]*)\n(.*?)^```", text, re.S | re.M)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the text without markup, lower-cased, punctuation dropped
    (letters, digits, spaces, '-' and '_' kept), spaces turned into '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts by its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub gives the headings of ``path`` (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(path.read_text()):
        match = re.match(r"#{1,6} (.+)", line)
        if not match:
            continue
        base = slug(match[1])
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(path: Path) -> list[str]:
    """The targets of the page's Markdown links and images, outside code blocks and code spans."""
    targets = []
    for line in prose_lines(path.read_text()):
        line = re.sub(r"`[^`]*`", "", line)
        targets += re.findall(r"\]\(([^)\s]+)\)", line)
    return targets


def test_the_slug_rule_matches_githubs() -> None:
    assert slug("Weights & Biases") == "weights--biases"
    assert slug("`[local_sgd]`") == "local_sgd"
    assert (
        slug("A plain PyTorch loop: [`examples/plain_loop.py`](../examples/plain_loop.py)")
        == "a-plain-pytorch-loop-examplesplain_looppy"
    )
    assert (
        slug("Putting an HTTP cache in front: downloads past one VM's link")
        == "putting-an-http-cache-in-front-downloads-past-one-vms-link"
    )


def broken_links(page: Path) -> list[str]:
    """The page's relative links whose file is missing, or whose anchor no heading there has."""
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not this repository's
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading with anchor #{anchor} in {resolved.name})")
    return broken


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(REPO)}: broken links: {broken}"


def test_a_broken_link_or_anchor_is_caught(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n\n```toml\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-section) [gone](missing.md) [anchor](other.md#not-a-heading) "
        "[self](#nowhere) `[code](missing-too.md)` [web](https://example.org/x.md)\n"
    )
    assert broken_links(page) == [
        "missing.md (no such file)",
        "other.md#not-a-heading (no heading with anchor #not-a-heading in other.md)",
        "#nowhere (no heading with anchor #nowhere in page.md)",
    ]


def runnable_blocks() -> list[tuple[Path, str, str]]:
    return [
        (page, info.split()[0], body)
        for page in pages()
        for info, body in fenced_blocks(page.read_text())
        if info.split()[-1:] == ["runnable"]
    ]


def test_the_runnable_blocks_are_marked_with_a_language_the_test_checks() -> None:
    blocks = runnable_blocks()
    assert len(blocks) >= 10, "the docs lost their runnable blocks (```bash runnable / ```python runnable)"
    assert {language for _, language, _ in blocks} <= {"bash", "python"}


def bash_error(body: str) -> str:
    """``bash -n``'s complaint about ``body``; empty when it parses."""
    done = subprocess.run(["bash", "-n"], input=body, capture_output=True, text=True)
    return "" if done.returncode == 0 else done.stderr or f"bash -n exited {done.returncode}"


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_every_runnable_shell_block_parses() -> None:
    for page, language, body in runnable_blocks():
        if language == "bash":
            error = bash_error(body)
            assert not error, f"{page.relative_to(REPO)}: a runnable block does not parse:\n{body}\n{error}"


def python_error(body: str) -> str:
    """What ``ast.parse`` says of ``body`` (empty: it parses)."""
    try:
        parse_source(body)
    except SyntaxError as exc:
        return f"line {exc.lineno}: {exc.msg}"
    return ""


def test_every_runnable_python_block_parses() -> None:
    blocks = [(page, body) for page, language, body in runnable_blocks() if language == "python"]
    assert blocks, "no block is marked python runnable: the docs lost their runnable examples"
    broken = [f"{page.relative_to(REPO)}: {error}\n{body}" for page, body in blocks if (error := python_error(body))]
    assert not broken, "runnable python blocks that do not parse:\n" + "\n".join(broken)


def test_a_malformed_python_block_is_caught() -> None:
    assert python_error("def f(:\n    pass\n")
    assert not python_error("import toolkit\nrun = toolkit.join('http://127.0.0.1:8750')\n")


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_a_malformed_shell_block_is_caught() -> None:
    assert bash_error("echo 'unclosed\n")
    assert not bash_error("pip install -e '.[test]' && python -m pytest -n 2\n")


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_page_points_at_an_issue_number(page: Path) -> None:
    hits = [line for line in page.read_text().splitlines() if re.search(r"\bissue [0-9]", line, re.I)]
    assert not hits, f"{page.relative_to(REPO)} cites issue numbers a reader cannot open: {hits}"


def test_no_module_points_at_an_issue_number() -> None:
    """The package's docstrings and comments say why, not which tracker entry asked."""
    hits = [
        f"{path.relative_to(REPO)}:{n}"
        for root in ("toolkit", "relay_server")
        for path in sorted((REPO / root).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bissue [0-9]", line, re.I)
    ]
    assert not hits, f"modules cite issue numbers a reader cannot open: {hits}"


def test_the_readme_is_a_quick_start_that_links_every_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, "README.md grew past a quick start: move the detail to docs/"
    linked = {(REPO / target.partition("#")[0]).resolve() for target in links(README)}
    missing = [page.name for page in DOCS.glob("*.md") if page.resolve() not in linked]
    assert not missing, f"README.md links no docs/ page {missing}"


def configuration_sections() -> dict[str, str]:
    """docs/configuration.md's ``### `[section]` `` parts, by section name."""
    text = (DOCS / "configuration.md").read_text()
    parts = re.split(r"^### `\[([\w.]+)\]`\n", text, flags=re.M)
    return {name: re.split(r"^#{1,3} ", body, flags=re.M)[0] for name, body in zip(parts[1::2], parts[2::2])}


def documented_fields(section_text: str) -> set[str]:
    return set(re.findall(r"^\| `(\w+)` \|", section_text, re.M))


def test_the_configuration_page_names_every_field_of_every_section() -> None:
    from relay_server.core.config import RelayConfig
    from toolkit.data.objectives import ObjectiveConfig

    sections = configuration_sections()
    config = RelayConfig()
    missing = []
    for section in dataclasses.fields(RelayConfig):
        assert section.name in sections, f"docs/configuration.md has no ### `[{section.name}]` section"
        value = getattr(config, section.name)
        expected = (
            {f.name for f in dataclasses.fields(value)}
            if dataclasses.is_dataclass(value)
            else {f.name for f in dataclasses.fields(ObjectiveConfig)}
            if section.name == "objective"
            else {"kind", "sources", "shuffle_buffer", "report_every", "max_shard_failures", "cache_dir", "leases"}
        )
        missing += [f"{section.name}.{name}" for name in sorted(expected - documented_fields(sections[section.name]))]
    assert not missing, f"docs/configuration.md does not document {missing}: add a table row for each"


def test_the_configuration_page_documents_no_field_the_relay_does_not_read() -> None:
    from relay_server.core.config import RelayConfig

    config = RelayConfig()
    stale = []
    for section in dataclasses.fields(RelayConfig):
        value = getattr(config, section.name)
        if dataclasses.is_dataclass(value):
            known = {f.name for f in dataclasses.fields(value)}
            stale += [
                f"{section.name}.{name}" for name in documented_fields(configuration_sections()[section.name]) - known
            ]
    assert not stale, f"docs/configuration.md documents fields the relay no longer has: {stale}"
