"""``relay-server notebook``: the one-cell notebook an organizer shares, pinned to what the relay serves.

The templates ship as package data (``defaults/notebooks/<platform>.ipynb``; the repository's
``notebooks/`` holds the same bytes). Their cell installs ``collabtrain[hf]`` from
``<RELAY_URL>/toolkit/<TOOLKIT_WHEEL>#sha256=<TOOLKIT_SHA256>``, and with those left empty it
installs nothing. Filling them in is all this module does: it asks the relay at ``--url`` which
wheel it serves (``GET /api/toolkit``) and writes the three values into the cell's assignment
lines, so the volunteer's pip accepts exactly the toolkit the relay runs and nothing a package
index or a later swap on the relay's disk could hand it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import requests

from relay_server.core.distribution import TOOLKIT_INFO_PATH
from relay_server.core.typed import ConfigError
from toolkit.errors import NOT_A_RELAY_HINT, not_a_relay_message

PLATFORMS = ("colab", "kaggle", "tpu", "local")
URL_PATTERN = re.compile(r"https?://[^\s\"'\\]+")
WHEEL_PATTERN = re.compile(r"[A-Za-z0-9_.]+-[A-Za-z0-9_.+!]+-py3-none-any\.whl")
SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")
# The cell's three assignment lines; the template holds exactly one of each.
RELAY_LINE = re.compile(r'^(RELAY_URL = os\.environ\.get\("COLLAB_RELAY_URL", )"[^"]*"', re.M)
WHEEL_LINE = re.compile(r'^(TOOLKIT_WHEEL = )"[^"]*"', re.M)
SHA256_LINE = re.compile(r'^(TOOLKIT_SHA256 = )"[^"]*"', re.M)


@dataclass(frozen=True)
class ToolkitPin:
    """What a notebook pins: the relay, the wheel it serves there and that wheel's sha256."""

    relay_url: str
    wheel: str
    sha256: str
    version: str = ""


def template(platform: str) -> str:
    """The shipped template for ``platform`` (the bytes of ``notebooks/<platform>.ipynb``)."""
    if platform not in PLATFORMS:
        raise ConfigError(f"no notebook for {platform!r}: pick one of {', '.join(PLATFORMS)}")
    return resources.files("relay_server").joinpath(f"defaults/notebooks/{platform}.ipynb").read_text()


def render(template_text: str, pin: ToolkitPin) -> str:
    """The template with the pin written into its code cell, in the templates' own JSON layout
    (so rendering a template with its own values gives back the same bytes)."""
    notebook = json.loads(template_text)
    cells = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    if len(cells) != 1:
        raise ConfigError("a notebook template must have exactly one code cell")
    source = "".join(cells[0]["source"])
    for pattern, value in ((RELAY_LINE, pin.relay_url), (WHEEL_LINE, pin.wheel), (SHA256_LINE, pin.sha256)):
        source, count = pattern.subn(lambda match: f'{match.group(1)}"{value}"', source)
        if count != 1:
            raise ConfigError(f"the notebook template has no line matching {pattern.pattern!r}: reinstall collabtrain")
    lines = source.split("\n")
    cells[0]["source"] = [line + "\n" for line in lines[:-1]] + [lines[-1]]
    return json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"


def fetch_pin(relay_url: str, timeout_s: float = 15.0) -> ToolkitPin:
    """Ask the relay which toolkit wheel it serves; every failure says what to do."""
    base = relay_url.rstrip("/")
    if not URL_PATTERN.fullmatch(base):
        raise ConfigError(f"--url must be the relay's public http(s) address, e.g. https://relay.example.org, "
                          f"got {relay_url!r}")
    url = base + TOOLKIT_INFO_PATH
    try:
        response = requests.get(url, timeout=timeout_s)
    except requests.RequestException as exc:
        raise ConfigError(f"cannot reach the relay at {url} ({type(exc).__name__}): start it (relay-server serve "
                          f"--config RUN.toml) and pass the address volunteers will use, with its scheme and port")
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise ConfigError(f"{not_a_relay_message(url, response.status_code, response.headers.get('Content-Type', ''))} "
                          f"{NOT_A_RELAY_HINT}")
    if response.status_code != 200:
        raise ConfigError(f"{url} answered HTTP {response.status_code}: {body.get('message', body)}. "
                          f"{body.get('hint') or 'Upgrade the relay to a collabtrain that serves its toolkit.'}")
    pin = ToolkitPin(relay_url=base, wheel=str(body.get("wheel", "")), sha256=str(body.get("sha256", "")),
                     version=str(body.get("version", "")))
    if not (WHEEL_PATTERN.fullmatch(pin.wheel) and SHA256_PATTERN.fullmatch(pin.sha256)):
        raise ConfigError(f"{url} answered without a wheel name and sha256 ({body}): is this a collabtrain relay? "
                          f"{NOT_A_RELAY_HINT}")
    return pin


def write_notebook(platform: str, relay_url: str, out: Path) -> ToolkitPin:
    """Ask the relay at ``relay_url`` for its toolkit and write ``platform``'s notebook to ``out``."""
    text = template(platform)
    pin = fetch_pin(relay_url)
    out.write_text(render(text, pin))
    return pin
