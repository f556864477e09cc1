"""Identity, access passes, signed requests and signed responses: one named test per attack.

Verifier-level tests build real ``requests`` prepared requests signed by the peer's
``SignedAuth`` and feed them to the relay's ``RequestVerifier`` under a fake clock
(``tests/support/auth.py``'s ``Env``). The same attacks through a real server are
``test_auth_server.py``'s; arbitrary inputs to these decoders, ``test_fuzz_auth.py``'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import stat
import time

import numpy as np
import pytest
import requests

from relay_server.auth.access import PassIssuer
from relay_server.auth.relay_key import KEY_FILE, RelayKey
from relay_server.auth.verify import (
    AuthRejected,
    ChunkDigests,
    NonceCache,
    RequestVerifier,
    VerifiedBodyStream,
    container_digests,
    read_container_head,
    sign_response,
)
from tests.support.auth import RELAY_URL, SKEW, Env, pass_for, raw_pass, signed_container
from tests.support.clock import Clock
from toolkit.errors import (
    RelayKeyChanged,
    RelayKeyError,
    RelaySignatureInvalid,
)
from toolkit.signing import (
    AccessPass,
    AccessPassHolder,
    PeerKey,
    RelayKeyPins,
)
from toolkit.wire.auth import (
    BODY_SHA256_HEADER,
    CONTAINER_TYPE,
    NONCE_HEADER,
    PASS_HEADER,
    PassClaims,
    b64u,
    container_body_sha256,
    decode_pass,
    digest_metadata,
    verify_relay_signature,
)
from toolkit.wire.tensor_container import AsyncContainerReader, encode_header


# --- verifier level: one test per attack ----------------------------------------------------------
def test_valid_signed_request_is_accepted(env: Env) -> None:
    claims = env.verify(env.signed())
    assert claims.username == "alice" and claims.peer_key == env.peer.public_raw
    assert env.verify(env.signed("GET", "/api/params?min_step=3&wait=0", body=None)).username == "alice"


def test_missing_auth_headers_rejected(env: Env) -> None:
    r = env.signed()
    del r.headers[NONCE_HEADER]
    error = env.rejected(r)
    assert (error.status, error.code) == (401, "missing_auth") and error.hint


def test_malformed_pass_rejected(env: Env) -> None:
    for bad in ["x", "!!!!", b64u(b"\x01" * 10), b64u(b"\x02" + b"\0" * 200), "A" * 600]:
        r = env.signed()
        r.headers[PASS_HEADER] = bad
        error = env.rejected(r)
        assert (error.status, error.code) == (401, "malformed_pass"), bad


def test_forged_pass_rejected(env: Env) -> None:
    """An attacker signs a pass claiming this relay's key id with a key of its own."""
    attacker = RelayKey.generate()
    claims = PassClaims(
        env.relay_key.key_id, int(env.clock()), int(env.clock()) + 600, int(env.clock()), env.peer.public_raw, "alice"
    )
    body = claims.encode_claims()
    forged = b64u(body + attacker.sign(PassClaims.signed_message(body)))
    error = env.rejected(env.signed(auth=env.auth_with(raw_pass(forged, env.relay_key))))
    assert (error.status, error.code) == (401, "forged_pass")


def test_tampered_pass_rejected(env: Env) -> None:
    """A genuine pass with its username edited ("alice" -> "admin") no longer verifies."""
    claims, body, signature = decode_pass(env.access.token)
    edited = b64u(body.replace(b"alice", b"admin") + signature)
    error = env.rejected(env.signed(auth=env.auth_with(raw_pass(edited, env.relay_key))))
    assert (error.status, error.code) == (401, "forged_pass")


def test_expired_pass_rejected(env: Env) -> None:
    r = env.signed()
    env.verify(r)
    env.clock.now += 601  # the request timestamps follow the clock: only the pass is too old
    error = env.rejected(env.signed())
    assert (error.status, error.code) == (401, "pass_expired")


def test_pass_from_another_relay_rejected(env: Env) -> None:
    other = PassIssuer(RelayKey.generate(), ttl_s=600, clock=env.clock).issue("alice", env.peer.public_raw)
    error = env.rejected(env.signed(auth=env.auth_with(pass_for(other, env.peer))))
    assert (error.status, error.code) == (401, "pass_wrong_relay")


def test_stolen_pass_with_another_key_rejected(env: Env) -> None:
    """Mallory replays alice's pass but can only sign with her own key."""
    error = env.rejected(env.signed(auth=env.auth_with(env.access, peer=PeerKey())))
    assert (error.status, error.code) == (401, "bad_signature")


def test_tampered_body_rejected(env: Env) -> None:
    r = env.signed(body=b'{"samples":32}')
    r.body = b'{"samples":3200}'
    error = env.rejected(r)
    assert (error.status, error.code) == (401, "body_mismatch")
    r.headers[BODY_SHA256_HEADER] = hashlib.sha256(r.body).hexdigest()  # and fix the claimed hash too
    error = env.rejected(r)
    assert (error.status, error.code) == (401, "bad_signature")


def test_tampered_path_method_or_content_type_rejected(env: Env) -> None:
    r = env.signed(path="/api/peers/p1/heartbeat")
    for attack in ("path", "method", "content_type"):
        forged = r.copy()
        if attack == "path":
            forged.prepare_url(RELAY_URL + "/api/peers/p2/heartbeat", None)
        elif attack == "method":
            forged.method = "PUT"
        else:
            forged.headers["Content-Type"] = CONTAINER_TYPE
        error = env.rejected(forged)
        assert (error.status, error.code) == (401, "bad_signature"), attack


def test_replayed_nonce_rejected(env: Env) -> None:
    r = env.signed()
    env.verify(r)
    error = env.rejected(r)
    assert (error.status, error.code) == (401, "replayed_nonce")
    env.clock.now += 2 * SKEW + 1  # once the nonce is forgotten, the timestamp is stale: never accepted
    assert env.rejected(r).code == "stale_timestamp"


def test_replay_after_relay_restart_rejected(env: Env) -> None:
    """A restart empties the nonce cache; requests signed before it are refused anyway."""
    r = env.signed()
    env.verify(r)
    env.clock.now += 5
    restarted = RequestVerifier(env.relay_key, max_skew_s=SKEW, clock=env.clock)
    with pytest.raises(AuthRejected) as info:
        restarted.verify(method=r.method, path_qs=r.path_url, headers=r.headers, body=r.body)
    assert info.value.code == "stale_timestamp"
    fresh = env.signed()
    assert restarted.verify(method=fresh.method, path_qs=fresh.path_url, headers=fresh.headers, body=fresh.body)


def test_stale_timestamp_rejected(env: Env) -> None:
    env.clock.now += 2 * SKEW  # the relay has been up a while: "55 s ago" is after its start
    for offset in (-SKEW - 5, SKEW + 5):
        late = env.auth_with(env.access, clock=lambda: env.clock() + offset)
        error = env.rejected(env.signed(auth=late))
        assert (error.status, error.code) == (401, "stale_timestamp")
    within = env.auth_with(env.access, clock=lambda: env.clock() - SKEW + 5)
    env.verify(env.signed(auth=within))


def test_banned_user_rejected(env: Env) -> None:
    env.verify(env.signed())
    env.banned.add("alice")  # a ban applies at once, to passes already issued
    error = env.rejected(env.signed())
    assert (error.status, error.code) == (403, "user_banned")


def test_nonce_cache_is_bounded_and_expires() -> None:
    cache = NonceCache(10.0, max_entries=3, max_per_user=2)
    cache.add("a", "alice", 0.0)
    cache.add("b", "alice", 1.0)
    with pytest.raises(AuthRejected) as info:
        cache.add("c", "alice", 2.0)
    assert info.value.status == 429
    cache.add("c", "bob", 2.0)
    with pytest.raises(AuthRejected) as info:
        cache.add("d", "carol", 3.0)
    assert (info.value.status, info.value.code) == (503, "nonce_cache_full")
    cache.add("d", "carol", 10.5)  # "a" expired at 10.0, freeing one slot
    assert len(cache) == 3
    with pytest.raises(AuthRejected):
        cache.add("b", "alice", 10.6)  # "b" is remembered until 11.0


# --- streamed bodies: container header hash + chunk digests ---------------------------------------
async def _read_verified(body: bytes, chunk_elems: int, used: list[np.ndarray]) -> None:
    stream = asyncio.StreamReader()
    stream.feed_data(body)
    stream.feed_eof()
    head = await read_container_head(stream)
    reader = AsyncContainerReader(VerifiedBodyStream(stream, head, container_digests(head)), 1 << 30)
    header = await reader.read_header()
    async for _, chunk in reader.iter_chunks(header.entry("grad"), chunk_elems):
        used.append(chunk.copy())


@pytest.mark.parametrize("chunk_elems", [1024, 700])  # aligned with the digests, and not
def test_chunk_digests_accept_an_intact_upload(chunk_elems: int) -> None:
    values = np.arange(3 * 1024 + 5, dtype=np.float32)
    tensors, metadata, body = signed_container(values, 4096)
    assert container_body_sha256(tensors, metadata) == hashlib.sha256(encode_header(tensors, metadata)).hexdigest()
    used: list[np.ndarray] = []
    asyncio.run(_read_verified(body, chunk_elems, used))
    np.testing.assert_array_equal(np.concatenate(used), values)


def test_bad_chunk_digest_detected_before_use() -> None:
    values = np.ones(3 * 1024, dtype=np.float32)
    _, _, body = signed_container(values, 4096)
    tampered = bytearray(body)
    tampered[len(body) - 2 * 4096 + 10] ^= 0xFF  # one byte in data chunk 1 (of 0, 1, 2)
    used: list[np.ndarray] = []
    with pytest.raises(AuthRejected) as info:
        asyncio.run(_read_verified(bytes(tampered), 1024, used))
    assert (info.value.status, info.value.code) == (401, "chunk_digest_mismatch")
    assert len(used) == 1 and np.all(used[0] == 1.0)  # chunk 0 was used; the bad chunk 1 never was


def test_chunk_digest_metadata_is_validated() -> None:
    sizes = [3 * 4096]
    good = digest_metadata([("grad", np.zeros(3 * 1024, np.float32))], 4096)
    ChunkDigests(sizes, good)
    for metadata, code in [
        ({}, "missing_chunk_digests"),
        ({**good, "collab_chunk_bytes": str(1 << 30)}, "bad_chunk_digests"),
        ({**good, "collab_chunk_bytes": "12"}, "bad_chunk_digests"),
        ({**good, "collab_chunk_sha256": good["collab_chunk_sha256"][:-43]}, "bad_chunk_digests"),
        ({**good, "collab_chunk_sha256": "%%"}, "bad_chunk_digests"),
    ]:
        with pytest.raises(AuthRejected) as info:
            ChunkDigests(sizes, metadata)
        assert info.value.code == code


# --- relay key, responses, pins, pass holder ----------------------------------------------------
def test_relay_key_created_0600_and_reloaded(tmp_path) -> None:
    first = RelayKey.load_or_create(tmp_path / "data")
    path = tmp_path / "data" / KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert RelayKey.load_or_create(tmp_path / "data").key_id == first.key_id
    assert "PRIVATE" not in repr(first) and first.key_id in repr(first)
    path.write_bytes(b"not a key")
    with pytest.raises(RelayKeyError):
        RelayKey.load_or_create(tmp_path / "data")


def test_derived_secrets_follow_the_relay_key(tmp_path) -> None:
    """The parameter-URL capabilities' secret (relay_server/api/params_cache.py): the same after a
    restart (the cache's copies stay hits), another per purpose, another with another key."""
    first = RelayKey.load_or_create(tmp_path / "data").derive_secret("params-url")
    assert RelayKey.load_or_create(tmp_path / "data").derive_secret("params-url") == first
    assert len(first) == 32 and RelayKey.load_or_create(tmp_path / "data").derive_secret("other") != first
    assert RelayKey.generate().derive_secret("params-url") != first


def test_relay_signature_binds_body_and_nonce() -> None:
    key = RelayKey.generate()
    header = sign_response(key, b'{"step":3}', request_nonce="n" * 22)
    verify_relay_signature(key.public, header, request_nonce="n" * 22, body=b'{"step":3}')
    for kwargs in [
        dict(request_nonce="n" * 22, body=b'{"step":4}'),  # altered answer
        dict(request_nonce="m" * 22, body=b'{"step":3}'),
    ]:  # replayed for another request
        with pytest.raises(RelaySignatureInvalid):
            verify_relay_signature(key.public, header, **kwargs)
    with pytest.raises(RelaySignatureInvalid):
        verify_relay_signature(RelayKey.generate().public, header, request_nonce="n" * 22, body=b'{"step":3}')
    with pytest.raises(RelaySignatureInvalid):
        verify_relay_signature(key.public, None, request_nonce="n" * 22, body=b"")


def test_relay_key_pin_detects_a_changed_key(tmp_path) -> None:
    a, b = RelayKey.generate(), RelayKey.generate()
    pins = RelayKeyPins(tmp_path / "pins.json")
    pins.check(RELAY_URL, a.public_b64)
    pins.check(RELAY_URL + "/", a.public_b64)
    with pytest.raises(RelayKeyChanged):
        RelayKeyPins(tmp_path / "pins.json").check(RELAY_URL, b.public_b64)  # survives a restart
    with pytest.raises(RelayKeyChanged):
        RelayKeyPins(expected={"http://other.test": a.key_id}).check("http://other.test", b.public_b64)


def test_access_pass_holder_refreshes_before_expiry(env: Env) -> None:
    mono = Clock(1000.0)
    calls: list[AccessPass | None] = []
    issued: list[AccessPass] = []
    failing = {"now": False}

    def obtain(previous: AccessPass | None) -> AccessPass:
        calls.append(previous)
        if failing["now"]:
            raise ConnectionError("relay restarting")
        # A pass's expiry counts from its receipt on the holder's clock (not the machine's uptime).
        issued.append(dataclasses.replace(env.access, received_mono=mono.now))  # lifetime 600 s
        return issued[-1]

    holder = AccessPassHolder(obtain, refresh_fraction=0.5, retry_s=5, clock=mono)
    holder.current()
    mono.now += 299
    holder.current()
    assert len(calls) == 1
    mono.now += 2  # past half-life: refresh, handing the previous pass to the callback
    assert holder.current() is issued[1]
    assert calls[-1] is issued[0] and len(calls) == 2
    failing["now"] = True
    mono.now += 301
    assert holder.current() is issued[1]  # still valid: keep going, retry later
    assert len(calls) == 3
    holder.current()
    assert len(calls) == 3  # retry_s not yet elapsed


# --- cost ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_per_request_sign_and_verify_cost(env: Env, capsys) -> None:
    """Peer sign + relay verify of a small JSON request, timed (a benchmark: slow, off the default
    run, whose machines are shared). Run with -s to see the numbers."""
    n = 300
    requests_ = [
        requests.Request(
            "POST",
            RELAY_URL + "/api/peers/p/heartbeat",
            data=b'{"samples":1}',
            headers={"Content-Type": "application/json"},
        ).prepare()
        for _ in range(n)
    ]
    t0 = time.perf_counter()
    for r in requests_:
        env.auth(r)
    t1 = time.perf_counter()
    for r in requests_:
        env.verify(r)
    t2 = time.perf_counter()
    sign_us, verify_us = (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6
    with capsys.disabled():
        print(f"\n[auth cost] sign {sign_us:.0f} us/request, verify {verify_us:.0f} us/request")
    assert sign_us + verify_us < 5000  # generous: a shared 2-core machine
