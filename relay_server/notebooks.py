"""``relay-server notebook``: the one-cell notebook an organizer shares, pinned to what the relay serves.

The templates ship as package data (``defaults/notebooks/<platform>.ipynb``; the repository's
``notebooks/`` holds the same bytes). Their cell installs ``collabtrain[<TOOLKIT_EXTRAS>]`` from
``<RELAY_URL>/toolkit/<TOOLKIT_WHEEL>#sha256=<TOOLKIT_SHA256>``, and with those left empty it
installs nothing. Filling them in is the main thing this module does: it asks the relay at
``--url`` which wheel it serves (``GET /api/toolkit``) and writes the three values, and the
extras the run needs (``TOOLKIT_EXTRAS``: bitsandbytes for 8-bit inner state), into the cell's
assignment lines, so the volunteer's pip accepts exactly the toolkit the relay runs and nothing a
package index or a later swap on the relay's disk could hand it.

Before pip runs, the cell checks the relay with the standard library alone (the toolkit is not
installed yet) and stops with one line of what happened and one of what to do. Those lines are
the toolkit's own (:data:`toolkit.errors.MESSAGES`): :func:`render` writes that table, and the two
small functions that word a failure, into the cell's generated block, so the notebook and the
toolkit cannot drift apart.

The organizer is refused a notebook nobody could use: a hosted notebook (Colab, Kaggle, TPU)
pointed at a loopback or private address it cannot reach, or at plain ``http://`` (tokens and
gradients in clear), unless ``--local-test`` says the notebook runs on the relay's own machine;
and a notebook for a run that already finished, which would stop every volunteer at once.
"""

from __future__ import annotations

import inspect
import ipaddress
import json
import re
import urllib.parse
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import requests

import toolkit.errors as errors
from relay_server.core.distribution import TOOLKIT_INFO_PATH
from relay_server.core.typed import ConfigError
from toolkit.errors import NOT_A_RELAY_HINT, not_a_relay_message

PLATFORMS = ("colab", "kaggle", "tpu", "local")
HOSTED = ("colab", "kaggle", "tpu")
"""Platforms whose notebooks run on someone else's machines, far from the relay's network."""
URL_PATTERN = re.compile(r"https?://[^\s\"'\\]+")
WHEEL_PATTERN = re.compile(r"[A-Za-z0-9_.]+-[A-Za-z0-9_.+!]+-py3-none-any\.whl")
SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")
EXTRAS_PATTERN = re.compile(r"[a-z0-9]+(,[a-z0-9]+)*")
"""Extras as the relay names them ("hf", "hf,peer8bit"): nothing else reaches the cell's source."""
# The cell's four assignment lines; the template holds exactly one of each.
RELAY_LINE = re.compile(r'^(RELAY_URL = os\.environ\.get\("COLLAB_RELAY_URL", )"[^"]*"', re.M)
WHEEL_LINE = re.compile(r'^(TOOLKIT_WHEEL = )"[^"]*"', re.M)
SHA256_LINE = re.compile(r'^(TOOLKIT_SHA256 = )"[^"]*"', re.M)
EXTRAS_LINE = re.compile(r'^(TOOLKIT_EXTRAS = )"[^"]*"', re.M)
GENERATED_START = "# --- generated from toolkit/errors.py by `relay-server notebook`"
GENERATED_END = "# --- end of the generated block"
GENERATED_BLOCK = re.compile(rf"^{re.escape(GENERATED_START)}.*?^{re.escape(GENERATED_END)}[^\n]*$", re.M | re.S)


@dataclass(frozen=True)
class ToolkitPin:
    """What a notebook pins: the relay, the wheel it serves there and that wheel's sha256, and
    the extras the run needs beside it (``hf``; ``hf,peer8bit`` for 8-bit inner state)."""

    relay_url: str
    wheel: str
    sha256: str
    version: str = ""
    extras: str = "hf"


def template(platform: str) -> str:
    """The shipped template for ``platform`` (the bytes of ``notebooks/<platform>.ipynb``)."""
    if platform not in PLATFORMS:
        raise ConfigError(f"no notebook for {platform!r}: pick one of {', '.join(PLATFORMS)}")
    return resources.files("relay_server").joinpath(f"defaults/notebooks/{platform}.ipynb").read_text()


def generated_block() -> str:
    """The cell's copy of the toolkit's words: :data:`toolkit.errors.MESSAGES`, the reasons a
    connection fails, and the two functions that pick them (plain standard-library Python)."""
    lines = [
        f"{GENERATED_START}: the toolkit's own words for what can stop",
        "# this cell before the toolkit is installed (what happened, what to do); do not edit.",
        "MESSAGES = {",
    ]
    for code, (what, todo) in errors.MESSAGES.items():
        lines += [f"    {json.dumps(code)}: (", f"        {json.dumps(what)},", f"        {json.dumps(todo)}),"]
    lines += ["}", "UNREACHABLE_REASONS = ("]
    lines += [f"    ({json.dumps(sign)}, {json.dumps(words)})," for sign, words in errors.UNREACHABLE_REASONS]
    lines += [")", "", ""]
    for function in (errors.unreachable_reason, errors.body_kind):
        lines += [inspect.getsource(function).rstrip("\n"), "", ""]
    lines += [f"{GENERATED_END} ---"]
    return "\n".join(lines)


def render(template_text: str, pin: ToolkitPin) -> str:
    """The template with the pin and the toolkit's messages written into its code cell, in the
    templates' own JSON layout (so rendering a template with its own values gives back the same
    bytes)."""
    notebook = json.loads(template_text)
    cells = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    if len(cells) != 1:
        raise ConfigError("a notebook template must have exactly one code cell")
    source = "".join(cells[0]["source"])
    block = generated_block()
    for pattern, value in (
        (RELAY_LINE, f'"{pin.relay_url}"'),
        (WHEEL_LINE, f'"{pin.wheel}"'),
        (SHA256_LINE, f'"{pin.sha256}"'),
        (EXTRAS_LINE, f'"{pin.extras}"'),
        (GENERATED_BLOCK, block),
    ):
        source, count = pattern.subn(lambda match: (match.group(1) if match.groups() else "") + value, source)
        if count != 1:
            raise ConfigError(f"the notebook template has no line matching {pattern.pattern!r}: reinstall collabtrain")
    lines = source.split("\n")
    cells[0]["source"] = [line + "\n" for line in lines[:-1]] + [lines[-1]]
    return json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"


def checked_url(relay_url: str) -> str:
    """``relay_url`` without a trailing slash, refused unless it is an http(s) address."""
    base = relay_url.rstrip("/")
    if not URL_PATTERN.fullmatch(base):
        raise ConfigError(
            f"--url must be the relay's public http(s) address, e.g. https://relay.example.org, got {relay_url!r}"
        )
    return base


def check_reachable(platform: str, relay_url: str, local_test: bool) -> None:
    """Refuse a hosted notebook (Colab, Kaggle, TPU) an address it cannot use: loopback or
    private (the notebook runs on the platform's machines, which cannot reach it) or plain http
    (the volunteer's token and every gradient would cross the internet in clear). ``local_test``:
    the organizer runs it on the relay's own machine, knowingly."""
    if platform not in HOSTED or local_test:
        return
    parts = urllib.parse.urlsplit(relay_url)
    host = (parts.hostname or "").lower()
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if (
        host == "localhost"
        or host.endswith(".localhost")
        or (
            address is not None
            and (address.is_loopback or address.is_private or address.is_unspecified or address.is_link_local)
        )
    ):
        raise ConfigError(
            f"a {platform} notebook runs on {platform}'s machines, which cannot reach {relay_url} (an "
            f"address of this machine or its network): pass the relay's public https:// address, or "
            f"--local-test for a notebook you run on this machine yourself"
        )
    if parts.scheme != "https":
        raise ConfigError(
            f"{relay_url} is plain http, so a {platform} notebook would send volunteers' tokens and "
            f"gradients across the internet in clear: put the relay behind TLS (README: 'TLS through a "
            f"reverse proxy') and pass its https:// address, or --local-test for a notebook you run on "
            f"this machine yourself"
        )


def fetch_pin(relay_url: str, timeout_s: float = 15.0) -> ToolkitPin:
    """Ask the relay which toolkit wheel it serves; every failure says what to do."""
    base = checked_url(relay_url)
    url = base + TOOLKIT_INFO_PATH
    try:
        response = requests.get(url, timeout=timeout_s)
    except requests.RequestException as exc:
        raise ConfigError(
            f"cannot reach the relay at {url} ({errors.unreachable_reason(exc)}): start it "
            f"(relay-server serve --config RUN.toml) and pass the address volunteers will use, with its "
            f"scheme and port"
        )
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise ConfigError(
            f"{not_a_relay_message(url, response.status_code, response.headers.get('Content-Type', ''))} "
            f"{NOT_A_RELAY_HINT}"
        )
    if response.status_code != 200:
        raise ConfigError(
            f"{url} answered HTTP {response.status_code}: {body.get('message', body)}. "
            f"{body.get('hint') or 'Upgrade the relay to a collabtrain that serves its toolkit.'}"
        )
    extras = body.get("extras", "hf")  # a relay older than the extras names none: hf
    pin = ToolkitPin(
        relay_url=base,
        wheel=str(body.get("wheel", "")),
        sha256=str(body.get("sha256", "")),
        version=str(body.get("version", "")),
        extras=extras if isinstance(extras, str) else "",
    )
    if not (
        WHEEL_PATTERN.fullmatch(pin.wheel)
        and SHA256_PATTERN.fullmatch(pin.sha256)
        and EXTRAS_PATTERN.fullmatch(pin.extras)
    ):
        raise ConfigError(
            f"{url} answered without a wheel name, sha256 and extras ({body}): is this a collabtrain "
            f"relay? {NOT_A_RELAY_HINT}"
        )
    return pin


def check_not_finished(relay_url: str, timeout_s: float = 15.0) -> None:
    """Refuse to write a notebook for a run that already finished: every volunteer who opens it
    would stop at its first line (the relay is known to answer: :func:`fetch_pin` asked it)."""
    try:
        status = requests.get(relay_url.rstrip("/") + "/api/status", timeout=timeout_s).json()
    except (requests.RequestException, ValueError):
        return  # a relay that cannot report its status now: the notebook checks again when it runs
    if isinstance(status, dict) and status.get("finished"):
        raise ConfigError(
            f"run {status.get('run_name')!r} at {relay_url} already finished at step "
            f"{status.get('step')}, so every volunteer opening this notebook would stop at once: raise "
            f"[run] total_steps and restart the relay, or pass the address of the next run's relay"
        )


def write_notebook(platform: str, relay_url: str, out: Path, *, local_test: bool = False) -> ToolkitPin:
    """Ask the relay at ``relay_url`` for its toolkit and write ``platform``'s notebook to ``out``."""
    text = template(platform)
    check_reachable(platform, checked_url(relay_url), local_test)
    pin = fetch_pin(relay_url)
    check_not_finished(relay_url)
    out.write_text(render(text, pin))
    return pin


def refresh_templates() -> list[Path]:
    """Write the toolkit's current messages into every template, in the package and in the
    repository's ``notebooks/`` (``python -m relay_server.notebooks``, after toolkit/errors.py
    changes); each keeps its own default relay and pins nothing."""
    package = Path(__file__).resolve().parent / "defaults" / "notebooks"
    written = []
    for platform in PLATFORMS:
        text = template(platform)
        default = RELAY_LINE.search(
            "".join(next(c for c in json.loads(text)["cells"] if c["cell_type"] == "code")["source"])
        )
        # every template names a default relay in its code cell (render() and the tests depend on it)
        url = re.search(r'"([^"]*)"$', default.group(0)).group(1)  # type: ignore[union-attr]
        fresh = render(text, ToolkitPin(relay_url=url, wheel="", sha256=""))
        for directory in (package, package.parents[2] / "notebooks"):
            if directory.is_dir():
                (directory / f"{platform}.ipynb").write_text(fresh)
                written.append(directory / f"{platform}.ipynb")
    return written


if __name__ == "__main__":
    print("\n".join(f"wrote {path}" for path in refresh_templates()))
