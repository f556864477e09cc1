"""The wheel of the toolkit this relay runs, built byte-for-byte reproducibly, so notebooks can pin it.

Volunteers install the toolkit from the relay (``collabtrain[hf] @ <relay>/toolkit/<wheel>#sha256=...``)
instead of by bare name from an index, where whoever registers the name would run code in every
notebook. The relay cannot call ``python -m build``: an installed relay has no source tree, and a
run-time build would pull build tools. So this module writes the wheel itself from what is
installed: the ``toolkit`` and ``relay_server`` package directories (every file but caches and
hidden files, which is what the package data is) and the installed distribution's metadata
(name, version, Requires-Dist, extras, entry points).

Reproducible on purpose: entries sorted, one fixed timestamp, fixed permissions, stored
uncompressed (deflate's bytes depend on the zlib build, stored bytes do not). The same code
gives the same sha256 on every restart and every machine, so an organizer's notebook stays
valid across relay restarts and anyone can rebuild and compare.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import io
import os
import re
import zipfile
from dataclasses import dataclass
from email.message import Message
from importlib import metadata
from pathlib import Path

from relay_server.core.typed import ConfigError

DIST_NAME = "collabtrain"
TOOLKIT_INFO_PATH = "/api/toolkit"
"""Where a relay says which wheel it serves: ``{"wheel", "sha256", "version", "url"}``."""
WHEEL_PREFIX = "/toolkit/"
"""Where it serves that wheel: ``/toolkit/<wheel file name>``."""
PACKAGES = ("toolkit", "relay_server")
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest time a zip entry can carry
SKIP_DIRS = frozenset({"__pycache__"})
SKIP_SUFFIXES = (".pyc", ".pyo", ".swp", "~")
METADATA_FIELDS = ("Name", "Version", "Summary", "License", "Requires-Python")


@dataclass(frozen=True)
class ToolkitWheel:
    """A built wheel: where it lies and what notebooks pin."""

    path: Path
    sha256: str
    version: str

    @property
    def filename(self) -> str:
        return self.path.name


def installed_distribution() -> metadata.Distribution:
    """The installed ``collabtrain`` distribution: a pip-installed ``.dist-info`` before a stale
    ``.egg-info`` that a checkout's working directory may put first on ``sys.path``."""
    found = list(metadata.distributions(name=DIST_NAME))
    if not found:
        raise ConfigError(
            f"the {DIST_NAME} distribution is not installed, so the relay cannot serve the toolkit "
            f"to notebooks: install it (`pip install -e .` in a checkout, or the release wheel)"
        )
    dist_infos = [d for d in found if str(getattr(d, "_path", "")).endswith(".dist-info")]
    return (dist_infos or found)[0]


def wheel_filename(name: str, version: str) -> str:
    """``<name>-<version>-py3-none-any.whl`` with the escaping the wheel spec asks for."""
    return f"{_escape(name)}-{_escape(version)}-py3-none-any.whl"


def build_wheel_bytes(dist: metadata.Distribution | None = None) -> tuple[str, bytes]:
    """The wheel's file name and bytes for ``dist`` (default: the installed one) and the
    importable ``toolkit``/``relay_server`` packages."""
    dist = dist or installed_distribution()
    name, version = dist.metadata["Name"], dist.version
    info_dir = f"{_escape(name)}-{_escape(version)}.dist-info"
    files: list[tuple[str, bytes]] = []
    for package in PACKAGES:
        files += _package_files(package)
    files.sort()
    files += [
        (f"{info_dir}/METADATA", _metadata_text(dist).encode()),
        (f"{info_dir}/WHEEL", _wheel_text(version).encode()),
    ]
    entry_points = dist.read_text("entry_points.txt")
    if entry_points:
        files.append((f"{info_dir}/entry_points.txt", entry_points.encode()))
    record = "".join(f"{path},sha256={_urlsafe_digest(data)},{len(data)}\n" for path, data in files)
    files.append((f"{info_dir}/RECORD", (record + f"{info_dir}/RECORD,,\n").encode()))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        for path, data in files:
            entry = zipfile.ZipInfo(path, date_time=ZIP_EPOCH)
            entry.external_attr = 0o100644 << 16  # a regular file, rw-r--r--, whatever the umask was
            entry.create_system = 3  # unix, so the mode above is honoured everywhere
            archive.writestr(entry, data)
    return wheel_filename(name, version), buffer.getvalue()


def ensure_wheel(directory: Path, dist: metadata.Distribution | None = None) -> ToolkitWheel:
    """Build the wheel into ``directory``; a file already there with the same bytes is kept as
    it is, other wheels there (an older version, a different build) are removed."""
    dist = dist or installed_distribution()
    filename, data = build_wheel_bytes(dist)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / filename
    if not (target.is_file() and target.read_bytes() == data):
        partial = directory / f".{filename}.partial"
        partial.write_bytes(data)
        os.replace(partial, target)  # never a half-written wheel under the served name
    for stale in directory.glob("*.whl"):
        if stale.name != filename:
            stale.unlink()
    return ToolkitWheel(path=target, sha256=hashlib.sha256(data).hexdigest(), version=dist.version)


def _package_files(package: str) -> list[tuple[str, bytes]]:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"the {package} package is not importable, so the relay cannot build the toolkit's wheel: "
            f"reinstall {DIST_NAME}"
        )
    root = Path(list(spec.submodule_search_locations)[0])
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        for filename in sorted(names):
            if filename.startswith(".") or filename.endswith(SKIP_SUFFIXES):
                continue
            path = Path(folder) / filename
            found.append(((Path(package) / path.relative_to(root)).as_posix(), path.read_bytes()))
    return found


def _metadata_text(dist: metadata.Distribution) -> str:
    """Core metadata 2.1 from the installed distribution's fields (no long description: the
    wheel's bytes should change with the code, not with README edits)."""
    source, out = dist.metadata, Message()
    out["Metadata-Version"] = "2.1"
    for field in METADATA_FIELDS:
        if field in source and source[field]:
            out[field] = source[field]
    for extra in source.get_all("Provides-Extra") or []:
        out["Provides-Extra"] = extra
    for requirement in source.get_all("Requires-Dist") or []:
        out["Requires-Dist"] = requirement
    return "".join(f"{key}: {value}\n" for key, value in out.items())


def _wheel_text(version: str) -> str:
    return f"Wheel-Version: 1.0\nGenerator: relay-server ({version})\nRoot-Is-Purelib: true\nTag: py3-none-any\n"


def _escape(part: str) -> str:
    return re.sub(r"[^\w\d.]+", "_", part, flags=re.UNICODE)


def _urlsafe_digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
