"""One server per data directory: an exclusive lock taken before anything reads or writes it.

Two relays on one data dir both resume from its latest version and both write versions into its
store, each behind the other's back: what happens when an organizer thinks the relay died and
starts it again, or a service unit runs beside a manual start. So ``relay-server serve`` and
``relay-server aggregator`` first take :class:`DataDirLock` on ``<data_dir>/relay.lock``; a second
server on the same directory refuses in one line naming the holder's pid and address, before it
has read or written anything there (not even the admin token or the relay key).

Why ``flock`` on a file and not a pid file: the kernel drops the lock with the process's last
file descriptor, so a relay killed by SIGKILL, the OOM killer or a power cut leaves no stale lock
for anyone to delete, and a pid reused by another program can never look like a live relay. The
descriptor is not inherited by the processes a server starts (Python opens it non-inheritable),
so a child outliving the relay holds nothing. The file's text (pid, role, address) is only for
the refusal's message; holding the lock is what counts.

Read-only commands (``relay-server export``, ``relay-server admin``) do not take it: they read
what the running server wrote atomically (:meth:`relay_server.rounds.store.Store.reader` says why
that is a consistent snapshot).
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

LOCK_FILE = "relay.lock"


class DataDirInUse(Exception):
    """Another live process holds the data directory's lock; the message names it and what to do."""


class DataDirLock:
    """The exclusive lock on one data directory, held until :meth:`release` (or the process ends)."""

    def __init__(self, fd: int, path: Path, role: str) -> None:
        self._fd, self.path, self.role = fd, path, role

    @classmethod
    def acquire(cls, data_dir: str | Path, role: str) -> "DataDirLock":
        """Lock ``data_dir`` (created if missing) for this process as ``role`` ("relay",
        "aggregator"), or raise :class:`DataDirInUse` without changing anything in it."""
        directory = Path(data_dir)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # no O_TRUNC: the holder's text stays readable
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DataDirInUse(
                f"{directory} is in use by {_describe(path)}: stop that process first (its state "
                "would be written by two servers at once), or pass another --data-dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        lock = cls(fd, path, role)
        lock.announce("")
        return lock

    def announce(self, address: str) -> None:
        """Record this process's pid and ``address`` (the URL it listens on, known once bound) for
        the message a second server prints. One ``pwrite`` of the whole record, then a truncate
        to its length: a reader sees the old record or the new one, never half of each."""
        record = json.dumps({"pid": os.getpid(), "role": self.role, "address": address}).encode() + b"\n"
        os.pwrite(self._fd, record, 0)
        os.ftruncate(self._fd, len(record))

    def release(self) -> None:
        """Give the directory up (closing the descriptor drops the lock); the file stays, harmless."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "DataDirLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _describe(path: Path) -> str:
    """ "relay pid 123 at http://127.0.0.1:8750" from the holder's record, as far as it is written
    (the holder may be between taking the lock and writing it, or not bound yet)."""
    try:
        record = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        record = {}
    if not isinstance(record, dict) or "pid" not in record:
        return "another process (starting: no pid written yet)"
    where = f"listening on {record['address']}" if record.get("address") else "not listening yet"
    return f"{record.get('role') or 'a server'} pid {record['pid']}, {where}"
