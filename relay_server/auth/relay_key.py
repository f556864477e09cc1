"""The relay's Ed25519 identity: generated once, kept in the data dir, loaded on every restart.

It signs access passes and the responses peers rely on; peers pin its public key per relay URL.
Losing the file only forces everyone to log in again (old passes name the old key id); leaking
it lets anyone mint passes, so it is created 0600 and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from toolkit.errors import RelayKeyError
from toolkit.wire.auth import b64u, key_id

log = logging.getLogger(__name__)

KEY_FILE = "relay_ed25519.pem"


class RelayKey:
    """The private key plus what peers see of it: raw public bytes, b64u form and key id."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.public: Ed25519PublicKey = private.public_key()
        self.public_raw = self.public.public_bytes_raw()
        self.public_b64 = b64u(self.public_raw)
        self.key_id = key_id(self.public_raw)

    @classmethod
    def generate(cls) -> "RelayKey":
        """An in-memory key (tests; a relay that must not persist one)."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, data_dir: str | Path) -> "RelayKey":
        """Load ``data_dir/relay_ed25519.pem``, creating it (0600) on first start."""
        path = Path(data_dir) / KEY_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            _create(path)
        key = cls(_load(path))
        log.info("relay key %s (%s)", key.key_id, path)
        return key

    def sign(self, message: bytes) -> bytes:
        return self._private.sign(message)

    def derive_secret(self, purpose: str) -> bytes:
        """32 bytes only this key's holder can compute, one secret per ``purpose``: HMAC-SHA256
        over the purpose, keyed with the private key. Why derived and not a file of its own: it
        lives and dies with the key (a relay that loses its key, and so everyone's passes, also
        changes what it derived), and it survives restarts as the key does. The purpose label
        keeps each derived secret useless for any other purpose, and none is a signature."""
        label = b"collabtrain relay secret\0" + purpose.encode("ascii")
        return hmac.new(self._private.private_bytes_raw(), label, hashlib.sha256).digest()

    def __repr__(self) -> str:
        return f"RelayKey(key_id={self.key_id})"


def _create(path: Path) -> None:
    """Write a new key without a window where it is readable by others or half-written: a 0600
    temp file, then ``link`` (atomic, refuses to overwrite a key another process just made)."""
    pem = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
            log.warning("generated a new relay key in %s: keep this file private and backed up", path)
        except FileExistsError:
            pass  # a concurrent start won; use its key
    finally:
        tmp.unlink(missing_ok=True)


def _load(path: Path) -> Ed25519PrivateKey:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        log.warning("relay key %s was readable by others (mode %o); restricting it to 0600", path, mode)
        os.chmod(path, 0o600)
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError, OSError) as exc:
        raise RelayKeyError("bad_relay_key", f"cannot load the relay key {path}: {type(exc).__name__}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise RelayKeyError("bad_relay_key", f"{path} is not an Ed25519 private key")
    return key
