"""Each expert's latest checkpoints, on the relay's disk: what a new host resumes from.

Hosts upload ``p.*`` (parameters) and ``opt.*`` (their optimizer state) every
``moe.checkpoint_every_s``; the relay validates them against the expert's parameter shapes
(:func:`toolkit.wire.payloads.read_checkpoint`), writes them atomically under
``data_dir/experts/<uid>/`` and keeps the last ``keep``. A host that dies loses at most one period
of its experts' training; an organizer can roll an expert back by deleting newer files.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

_NAME = re.compile(r"(\d{10})\.safetensors")
CHECKPOINTS_DIR = "experts"
"""Where under ``server.data_dir`` the relay keeps them (read also by ``[evaluation]``:
:mod:`relay_server.observers.eval_experts`)."""


class CheckpointStore:
    def __init__(self, root: Path, keep: int) -> None:
        self.root, self.keep = root, keep
        root.mkdir(parents=True, exist_ok=True)

    def _dir(self, uid: str) -> Path:
        return self.root / uid  # uids are validated against the run's own list before they get here

    def versions(self, uid: str) -> list[int]:
        folder = self._dir(uid)
        if not folder.is_dir():
            return []
        return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _NAME.fullmatch(p.name)))

    def save(self, uid: str, body: bytes) -> int:
        folder = self._dir(uid)
        folder.mkdir(exist_ok=True)
        versions = self.versions(uid)
        number = (versions[-1] + 1) if versions else 1
        tmp = folder / f".{number}.tmp"
        with open(tmp, "wb") as out:
            out.write(body)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, folder / f"{number:010d}.safetensors")
        for old in versions[: max(0, len(versions) + 1 - self.keep)]:
            (folder / f"{old:010d}.safetensors").unlink(missing_ok=True)
        return number

    def latest(self, uid: str) -> bytes | None:
        newest = self.newest(uid)
        return newest[1] if newest is not None else None

    def bodies(self, uid: str) -> Iterator[bytes]:
        """Every checkpoint kept of ``uid``, newest first, each read when asked for (one pruned
        meanwhile is skipped)."""
        for number in reversed(self.versions(uid)):
            try:
                yield (self._dir(uid) / f"{number:010d}.safetensors").read_bytes()
            except FileNotFoundError:
                continue

    def newest(self, uid: str) -> tuple[int, bytes] | None:
        """The newest checkpoint's number and bytes (None: none yet). Another process may read
        while the relay saves: a file pruned between listing and reading is skipped for the newer one."""
        while versions := self.versions(uid):
            try:
                return versions[-1], (self._dir(uid) / f"{versions[-1]:010d}.safetensors").read_bytes()
            except FileNotFoundError:
                continue
        return None
