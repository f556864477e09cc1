"""Property-based fuzzing of the authentication decoders: access passes, signed-request headers,
chunk digests of signed uploads, the admin token, the relay's response signature, and any change
to a validly signed request. The harness and its counts are ``tests/support/fuzz.py``'s.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np
import pytest
from cryptography.exceptions import InvalidSignature
from hypothesis import strategies as st

from relay_server.api.moderation import AdminToken
from relay_server.auth.access import PassIssuer
from relay_server.auth.relay_key import RelayKey
from relay_server.auth.verify import AuthRejected, ChunkDigests, RequestVerifier
from relay_server.core.errors import ApiError
from tests.support.auth import Env
from tests.support.fuzz import TEXT, fuzz
from toolkit.errors import RelaySignatureInvalid
from toolkit.signing import PeerKey
from toolkit.wire.auth import (
    BODY_SHA256_HEADER,
    NONCE_HEADER,
    PASS_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    b64u,
    decode_pass,
    digest_metadata,
    unb64u,
    verify_pass,
    verify_relay_signature,
)

# --- authentication ----------------------------------------------------------------------------------------
RELAY_KEY = RelayKey.generate()
PEER = PeerKey()
GOOD_PASS = PassIssuer(RELAY_KEY, ttl_s=600).issue("alice", PEER.public_raw).access_pass
GOOD_RAW = unb64u(GOOD_PASS)


def _pass_decoder(case: tuple[int, int, bytes | str]) -> None:
    """Arbitrary, truncated, extended or bit-flipped passes: ValueError or a decoded pass; and a
    pass that differs from the genuine one by any bit never verifies."""
    mode, flip, raw = case
    if isinstance(raw, str):
        token = raw
    elif mode == 0:
        token = b64u(raw)
    else:
        changed = bytearray(GOOD_RAW)
        changed[flip % len(changed)] ^= 1 << (flip // len(changed) % 8)
        token = b64u(bytes(changed) + raw[: mode - 1])  # the flipped pass, sometimes with trailing bytes
    try:
        claims, body, signature = decode_pass(token)
    except ValueError:
        return
    assert len(signature) == 64 and claims.encode_claims() == body  # decodes to what it re-encodes to
    try:
        verify_pass(token, RELAY_KEY.public)
    except InvalidSignature:
        return
    assert token == GOOD_PASS, "a modified pass verified"


test_fuzz_pass_decoder, test_fuzz_pass_decoder_slow = fuzz(
    st.tuples(st.integers(0, 4), st.integers(0, 10**5), st.one_of(st.binary(max_size=200), st.text(max_size=300)))
)(_pass_decoder)


HEADER_TEXT = st.text(max_size=80)
VERIFIER = RequestVerifier(RELAY_KEY, max_skew_s=60)
SIGNED_NAMES = [PASS_HEADER, TIMESTAMP_HEADER, NONCE_HEADER, BODY_SHA256_HEADER, SIGNATURE_HEADER]


def _valid_headers(body: bytes) -> dict[str, str]:
    import requests

    from toolkit.signing import AccessPass, AccessPassHolder, SignedAuth

    claims, _, _ = decode_pass(GOOD_PASS)
    access = AccessPass(
        token=GOOD_PASS,
        claims=claims,
        relay_public=RELAY_KEY.public,
        clock_offset_s=0.0,
        received_mono=time.monotonic(),
        lifetime_s=600,
    )
    prepared = requests.Request(
        "POST", "http://relay.test/api/progress", data=body, headers={"Content-Type": "application/json"}
    ).prepare()
    SignedAuth(PEER, AccessPassHolder(lambda previous: access))(prepared)
    return dict(prepared.headers)


def _signed_headers(case: tuple[dict[str, str | None], bytes]) -> None:
    """The signed-request header decoder (RequestVerifier) on a valid request with any of its auth
    headers replaced, dropped or kept: a typed 4xx refusal, or acceptance only of the request
    exactly as signed (a fresh valid signature for every example, so nonces never repeat)."""
    changes, body = case
    headers = _valid_headers(b'{"x":1}')
    original = dict(headers)
    for name, value in changes.items():
        if value is None:
            headers.pop(name, None)
        else:
            headers[name] = value
    try:
        VERIFIER.verify(method="POST", path_qs="/api/progress", headers=headers, body=body)
    except AuthRejected as exc:
        assert exc.status in (401, 403, 429, 503) and exc.code and exc.message
        return
    assert body == b'{"x":1}' and all(headers.get(n) == original[n] for n in [*SIGNED_NAMES, "Content-Type"]), (
        "a changed request verified"
    )


test_fuzz_signed_request_headers, test_fuzz_signed_request_headers_slow = fuzz(
    st.tuples(
        st.dictionaries(
            st.sampled_from(SIGNED_NAMES + ["Content-Type"]), st.one_of(st.none(), HEADER_TEXT), max_size=3
        ),
        st.sampled_from([b'{"x":1}', b'{"x":2}', b""]),
    )
)(_signed_headers)


CHUNK = 4096


def _chunk_digests(case: tuple[Any, Any, list[int], bytes, int]) -> None:
    """The chunk-digest metadata of a signed upload, and the per-chunk check it drives: a typed
    401 refusal, or digests that tile the tensors exactly; a chunk is accepted only if it is the
    data that was signed."""
    chunk_bytes, digests, sizes, data, flip = case
    arrays = [np.frombuffer((data * (s // max(len(data), 1) + 1))[:s], np.uint8) for s in sizes]
    metadata = digest_metadata([(f"t{i}", a) for i, a in enumerate(arrays)], CHUNK)
    if chunk_bytes is not None:
        metadata["collab_chunk_bytes"] = chunk_bytes
    if digests is not None:
        metadata["collab_chunk_sha256"] = digests
    try:
        checker = ChunkDigests(sizes, metadata, min_chunk_bytes=CHUNK)
    except AuthRejected as exc:
        assert exc.status == 401 and exc.code in ("missing_chunk_digests", "bad_chunk_digests")
        return
    assert len(checker.digests) == len(checker.lengths) and sum(checker.lengths) == sum(sizes)
    segments = [
        a.tobytes()[i : i + checker.chunk_bytes] for a in arrays for i in range(0, a.size, checker.chunk_bytes)
    ]
    for index, segment in enumerate(segments):
        tampered = bytes([segment[0] ^ (1 + flip % 255)]) + segment[1:] if flip % 2 else segment
        try:
            checker.check(index, tampered)
        except AuthRejected as exc:
            assert exc.code == "chunk_digest_mismatch"
            continue
        assert hashlib.sha256(tampered).digest() == checker.digests[index]


test_fuzz_chunk_digest_metadata, test_fuzz_chunk_digest_metadata_slow = fuzz(
    st.tuples(
        st.one_of(
            st.none(),
            st.sampled_from([str(CHUNK), "4096 ", "-1", "1e4", "\u0664\u0660\u0669\u0666"]),
            st.integers(0, 1 << 25).map(str),
            TEXT,
        ),
        st.one_of(st.none(), st.binary(max_size=160).map(b64u), TEXT),
        st.lists(st.integers(0, 3 * CHUNK), max_size=3),
        st.binary(min_size=1, max_size=32),
        st.integers(0, 1000),
    )
)(_chunk_digests)


ADMIN = AdminToken("s" * 43)


def _admin_authorization(header: str | None) -> None:
    """The admin token check: 401 for anything but the exact bearer token."""
    try:
        ADMIN.check(header)
    except ApiError as exc:
        assert exc.status == 401 and exc.code in ("admin_auth_required", "bad_admin_token")
        return
    assert header is not None and header.partition(" ")[2].strip() == "s" * 43 and header.startswith("Bearer ")


test_fuzz_admin_authorization, test_fuzz_admin_authorization_slow = fuzz(
    st.one_of(
        st.none(),
        st.text(max_size=60),
        st.text(max_size=50).map(lambda t: "Bearer " + t),
        st.tuples(st.integers(0, 42), st.characters()).map(
            lambda t: "Bearer " + ("s" * 43)[: t[0]] + t[1] + ("s" * 43)[t[0] + 1 :]
        ),
    )
)(_admin_authorization)


# --- any change to a validly signed request, and the relay's response signature -------------------------
_HEADER_TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=120)
_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"


def _mutate(text: str, position: int, replacement: str | None) -> str:
    """Replace ``text`` (if ``replacement`` is given) or change one of its characters."""
    if replacement is not None:
        return replacement
    if not text:
        return "A"
    i = position % len(text)
    swapped = _B64[(_B64.find(text[i]) + 1 + position // len(text) % 60) % len(_B64)]
    return text[:i] + swapped + text[i + 1 :]


_FUZZ_ENV = Env()
_BASE = _FUZZ_ENV.signed(path="/api/rounds/3/gradient?peer_id=p1", body=b'{"samples":32}')
_MUTABLE = ["pass", "timestamp", "nonce", "body_sha256", "signature", "body", "path", "method", "content_type"]
_HEADER_OF = {
    "pass": PASS_HEADER,
    "timestamp": "X-Collab-Timestamp",
    "nonce": NONCE_HEADER,
    "body_sha256": BODY_SHA256_HEADER,
    "signature": "X-Collab-Signature",
    "content_type": "Content-Type",
}


def _mutated_request_rejected(case: tuple[str, int, str | None]) -> None:
    """Any change to any signed part of a valid request gets a typed 4xx, nothing else."""
    part, position, replacement = case
    headers, method, path, body = dict(_BASE.headers), _BASE.method, _BASE.path_url, _BASE.body
    if part in _HEADER_OF:
        headers[_HEADER_OF[part]] = _mutate(headers[_HEADER_OF[part]], position, replacement)
    elif part == "body":
        body = _mutate(body.decode(), position, replacement).encode()
    elif part == "path":
        path = _mutate(path, position, replacement)
    else:
        method = _mutate(method, position, replacement)
    if (headers, method, path, body) == (dict(_BASE.headers), _BASE.method, _BASE.path_url, _BASE.body):
        return  # the mutation happened to be a no-op
    with pytest.raises(AuthRejected) as info:
        _FUZZ_ENV.verifier.verify(method=method, path_qs=path, headers=headers, body=body)
    assert info.value.status in (401, 403)


test_fuzz_mutated_signed_request_rejected, test_fuzz_mutated_signed_request_rejected_slow = fuzz(
    st.tuples(st.sampled_from(_MUTABLE), st.integers(0, 100_000), st.one_of(st.none(), _HEADER_TEXT))
)(_mutated_request_rejected)


def _relay_signature_header(header: str) -> None:
    with pytest.raises(RelaySignatureInvalid):
        verify_relay_signature(_FUZZ_ENV.relay_key.public, header, request_nonce="n" * 22, body=b"")


test_fuzz_relay_signature_header, test_fuzz_relay_signature_header_slow = fuzz(
    _HEADER_TEXT, examples=300, slow_examples=5000
)(_relay_signature_header)


# --- inputs that once crashed a decoder with a 500 (regressions) -------------------------------------
def test_regression_superscript_chunk_size() -> None:
    with pytest.raises(AuthRejected):
        ChunkDigests([CHUNK], {"collab_chunk_bytes": "\u00b2", "collab_chunk_sha256": ""})


def test_regression_superscript_timestamp() -> None:
    headers = _valid_headers(b"{}") | {TIMESTAMP_HEADER: "\u00b2"}
    with pytest.raises(AuthRejected):
        VERIFIER.verify(method="POST", path_qs="/api/progress", headers=headers, body=b"{}")
