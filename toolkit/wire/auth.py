"""Access passes and signed requests: the wire format both sides share, and the peer's half.

DeDLOC Appendix I.5, adapted to one relay: a peer proves its Hugging Face identity ONCE (the relay
calls ``whoami``), receives a short-lived **access pass** signed by the relay's Ed25519 key, and
signs every later request with its own Ed25519 key. The relay signs the responses peers rely on.

Wire format (all base64 is URL-safe without padding, "b64u"):

* Pass (header ``X-Collab-Pass``): ``b64u(claims || relay_signature[64])`` where ``claims`` is
  ``version u8=1 | relay key id [8] | issued_at u64 | expires_at u64 | auth_at u64 |
  peer public key [32] | len u8 | username ASCII`` (big-endian, unix seconds). Binary, not JSON,
  so the relay parses it with a few slices (~190 characters for a 12-letter username).
* Request headers: ``X-Collab-Pass``, ``X-Collab-Timestamp`` (unix seconds, relay clock),
  ``X-Collab-Nonce`` (16 random bytes, b64u), ``X-Collab-Body-Sha256`` (hex) and
  ``X-Collab-Signature`` (b64u Ed25519 over :func:`request_message`).
* Body hash: ``sha256(body)`` for ordinary bodies. For a streamed tensor container
  (``application/octet-stream``) it is ``sha256`` of the container's header bytes only, and the
  header's metadata carries one sha256 per data chunk (:func:`digest_metadata`): the relay reduces
  chunks as they arrive and cannot un-add one after a late mismatch, so it checks each chunk
  against its digest before using it.
* Response header ``X-Collab-Relay-Signature: v1;kid=<hex>;covers=<body|headers:a,b>;sig=<b64u>``
  over :func:`response_message`, bound to the request's nonce so an old answer cannot be replayed.

Every signed message starts with its own domain tag, so a signature of one kind can never be
presented as another. Secrets (HF token, private keys) never appear in a repr or a log line.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from toolkit.errors import RelaySignatureInvalid
from toolkit.wire.protocol import MAX_PASS_CHARS, ROUTES
from toolkit.wire.tensor_container import encode_header

log = logging.getLogger(__name__)

PASS_HEADER = "X-Collab-Pass"
TIMESTAMP_HEADER = "X-Collab-Timestamp"
NONCE_HEADER = "X-Collab-Nonce"
BODY_SHA256_HEADER = "X-Collab-Body-Sha256"
SIGNATURE_HEADER = "X-Collab-Signature"
RELAY_SIGNATURE_HEADER = "X-Collab-Relay-Signature"
CONTAINER_TYPE = "application/octet-stream"  # bodies hashed by container header + chunk digests
LOGIN_PATH = ROUTES["login"]  # public: carries the HF token, there is nothing to sign with yet
REFRESH_PATH = ROUTES["refresh"]  # signed with the current pass

CHUNK_BYTES_KEY = "collab_chunk_bytes"
CHUNK_SHA256_KEY = "collab_chunk_sha256"
DEFAULT_CHUNK_BYTES = 4 << 20  # = relay_server.rounds.membership.CHUNK_ELEMS float32: reads align, no re-buffering

_PASS_TAG = b"collabtrain-pass-v1\0"
_REQUEST_TAG = b"collabtrain-request-v1\n"
_RESPONSE_TAG = b"collabtrain-response-v1\n"
_PASS_FIXED = struct.Struct(">B8sQQQ32sB")  # version, key id, issued, expires, auth_at, peer key, len
PASS_VERSION = 1
USERNAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
NONCE_RE = re.compile(r"[A-Za-z0-9_-]{16,64}")
_B64U_RE = re.compile(r"[A-Za-z0-9_-]*")
_HEX64_RE = re.compile(r"[0-9a-f]{64}")
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


# --- encoding helpers ---------------------------------------------------------------------------
def b64u(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def unb64u(text: str, what: str = "value") -> bytes:
    """Strict, canonical decode (unused trailing bits must be zero, so each value has exactly one
    spelling); raises ValueError whose message never echoes the input."""
    if not isinstance(text, str) or not _B64U_RE.fullmatch(text) or len(text) % 4 == 1:
        raise ValueError(f"{what} is not URL-safe base64")
    try:
        data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise ValueError(f"{what} is not URL-safe base64") from None
    if b64u(data) != text:
        raise ValueError(f"{what} is not canonical base64")
    return data


def key_id(public_raw: bytes) -> str:
    """16 hex chars naming a relay key: short enough to print, in passes and in pins."""
    return hashlib.sha256(public_raw).hexdigest()[:16]


def public_key_from_b64(text: str, what: str = "public key") -> Ed25519PublicKey:
    raw = unb64u(text, what)
    if len(raw) != 32:
        raise ValueError(f"{what} must be 32 bytes (raw Ed25519)")
    return Ed25519PublicKey.from_public_bytes(raw)


# --- access passes ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PassClaims:
    """What a pass asserts: ``username`` (verified with HF at ``auth_at``) owns ``peer_key``."""

    relay_key_id: str
    issued_at: int
    expires_at: int
    auth_at: int
    peer_key: bytes  # raw Ed25519 public key, 32 bytes
    username: str

    def encode_claims(self) -> bytes:
        name = self.username.encode("ascii")
        return (
            _PASS_FIXED.pack(
                PASS_VERSION,
                bytes.fromhex(self.relay_key_id),
                self.issued_at,
                self.expires_at,
                self.auth_at,
                self.peer_key,
                len(name),
            )
            + name
        )

    @staticmethod
    def signed_message(claims: bytes) -> bytes:
        return _PASS_TAG + claims


def decode_pass(token: str) -> tuple[PassClaims, bytes, bytes]:
    """Parse (do not verify) a pass: ``(claims, claims_bytes, signature)``; ValueError if malformed."""
    if len(token) > MAX_PASS_CHARS:
        raise ValueError("pass is too long")
    raw = unb64u(token, "pass")
    if len(raw) < _PASS_FIXED.size + 1 + 64:
        raise ValueError("pass is too short")
    version, kid, issued, expires, auth_at, peer_key, n = _PASS_FIXED.unpack_from(raw)
    if version != PASS_VERSION:
        raise ValueError(f"pass version {version} is not supported")
    end = _PASS_FIXED.size + n
    if len(raw) != end + 64:
        raise ValueError("pass length does not match its username length")
    try:
        username = raw[_PASS_FIXED.size : end].decode("ascii")
    except UnicodeDecodeError:
        raise ValueError("pass username is not ASCII") from None
    if not USERNAME_RE.fullmatch(username):
        raise ValueError("pass username has invalid characters")
    return PassClaims(kid.hex(), issued, expires, auth_at, peer_key, username), raw[:end], raw[end:]


def verify_pass(token: str, relay_public: Ed25519PublicKey) -> PassClaims:
    """Decode and check the relay's signature; ValueError if malformed, InvalidSignature if forged."""
    claims, body, signature = decode_pass(token)
    relay_public.verify(signature, PassClaims.signed_message(body))
    return claims


# --- request / response messages ----------------------------------------------------------------
def request_message(
    relay_key_id: str, method: str, path_qs: str, content_type: str, timestamp: str, nonce: str, body_sha256: str
) -> bytes:
    """The bytes a peer signs. ``path_qs`` is the path and query exactly as sent (requests'
    ``path_url`` == aiohttp's ``raw_path``): a reverse proxy must not rewrite paths. The relay key
    id names the intended recipient (paper I.5), the content type fixes which body-hash rule applies."""
    fields = (relay_key_id, method, path_qs, content_type, timestamp, nonce, body_sha256)  # method: case-sensitive
    return _REQUEST_TAG + "\n".join(fields).encode("utf-8", "surrogateescape")


def response_message(relay_key_id: str, request_nonce: str, covers: str, payload: bytes) -> bytes:
    digest = hashlib.sha256(payload).hexdigest()
    return _RESPONSE_TAG + "\n".join((relay_key_id, request_nonce, covers, digest)).encode()


def covered_headers_payload(headers: Mapping[str, str], names: Iterable[str]) -> bytes:
    """Canonical bytes of the named response headers (a missing header counts as empty)."""
    return "".join(f"{n.lower()}:{headers.get(n, '')}\n" for n in names).encode("utf-8", "surrogateescape")


def format_relay_signature(relay_key_id: str, covers: str, signature: bytes) -> str:
    return f"v1;kid={relay_key_id};covers={covers};sig={b64u(signature)}"


def verify_relay_signature(
    relay_public: Ed25519PublicKey,
    header_value: str | None,
    *,
    request_nonce: str,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Check a relay-signed response: raise :class:`RelaySignatureInvalid` unless the header
    verifies over ``body`` (``covers=body``) or the named ``headers`` (``covers=headers:...``)."""
    if not header_value:
        raise RelaySignatureInvalid("unsigned_response", "the relay's answer carries no signature")
    parts = dict(p.split("=", 1) for p in header_value.split(";") if "=" in p)
    covers, kid, sig = parts.get("covers", ""), parts.get("kid", ""), parts.get("sig", "")
    if not header_value.startswith("v1;") or not covers or not kid or not sig:
        raise RelaySignatureInvalid("bad_relay_signature", "the relay signature header is malformed")
    if covers == "body":
        payload = body if body is not None else b""
    elif covers.startswith("headers:"):
        payload = covered_headers_payload(headers or {}, covers[len("headers:") :].split(","))
    else:
        raise RelaySignatureInvalid("bad_relay_signature", f"unknown signature coverage {covers[:40]!r}")
    if kid != key_id(relay_public.public_bytes_raw()):
        raise RelaySignatureInvalid("bad_relay_signature", "the answer is signed by another relay key")
    try:
        relay_public.verify(unb64u(sig, "signature"), response_message(kid, request_nonce, covers, payload))
    except (InvalidSignature, ValueError):
        raise RelaySignatureInvalid("bad_relay_signature", "the relay's signature does not verify") from None


# --- streamed bodies: container header hash + per-chunk digests ---------------------------------
def chunk_sha256(buffer: np.ndarray | bytes | memoryview, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[bytes]:
    """sha256 of each ``chunk_bytes`` slice of a contiguous buffer (the last one may be short)."""
    flat = (np.ascontiguousarray(buffer).data if isinstance(buffer, np.ndarray) else memoryview(buffer)).cast("B")
    return [hashlib.sha256(flat[i : i + chunk_bytes]).digest() for i in range(0, len(flat), chunk_bytes)]


def digest_metadata(tensors: list[tuple[str, np.ndarray]], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict[str, str]:
    """Container metadata entries for the chunk digests of ``tensors`` (in data order; each
    tensor is cut separately, so chunk boundaries align with the relay's per-tensor reads)."""
    digests = b"".join(d for _, array in tensors for d in chunk_sha256(array, chunk_bytes))
    return {CHUNK_BYTES_KEY: str(chunk_bytes), CHUNK_SHA256_KEY: b64u(digests)}


def container_body_sha256(tensors: list[tuple[str, np.ndarray]], metadata: dict[str, str]) -> str:
    """The body hash a peer signs for a streamed container: sha256 of its header bytes. Pass the
    same ``tensors`` and ``metadata`` (including :func:`digest_metadata`) as the upload."""
    return hashlib.sha256(encode_header(tensors, metadata)).hexdigest()


def segment_lengths(tensor_sizes: Iterable[int], chunk_bytes: int) -> list[int]:
    """Byte lengths of the digest segments for tensors of the given byte sizes, in data order."""
    out = []
    for size in tensor_sizes:
        full, rest = divmod(size, chunk_bytes)
        out += [chunk_bytes] * full + ([rest] if rest else [])
    return out
