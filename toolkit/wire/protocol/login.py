"""Authentication messages (``toolkit.wire.auth`` / ``toolkit.signing``, ``relay_server.auth.access``):
the Hugging Face login and the access pass it returns (refresh answers the same way).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.wire.schema import Schema, limits

MAX_PASS_CHARS = 512


@dataclass(frozen=True, kw_only=True)
class LoginRequest(Schema):
    """``POST /api/auth/login``: the only message that carries the HF token (never in a URL)."""

    hf_token: str = field(repr=False, metadata=limits(max_len=512))
    peer_public_key: str = field(metadata=limits(max_len=64))
    """Raw Ed25519 public key, b64u (43 chars): the pass binds the username to it."""


@dataclass(frozen=True, kw_only=True)
class LoginResponse(Schema):
    """Answer to login and refresh. ``server_time`` lets the peer sign with the relay's clock."""

    access_pass: str = field(metadata=limits(max_len=MAX_PASS_CHARS))
    username: str = field(metadata=limits(max_len=96))
    issued_at: int
    expires_at: int
    server_time: float
    relay_public_key: str = field(metadata=limits(max_len=64))
    relay_key_id: str = field(metadata=limits(max_len=16))
    warnings: list[str] = field(default_factory=list, metadata=limits(max_len=8))
