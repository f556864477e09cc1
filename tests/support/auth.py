"""What the authentication tests share: a relay verifier and an honest peer under one fake clock
(:class:`Env`), access passes built around any token, forgeries included, and a gradient upload
carrying the chunk digests a signed upload has (:func:`signed_container`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import requests

from relay_server.auth.access import PassIssuer
from relay_server.auth.relay_key import RelayKey
from relay_server.auth.verify import AuthRejected, RequestVerifier
from tests.support.clock import Clock
from toolkit.signing import AccessPass, AccessPassHolder, PeerKey, RelayKeyPins, SignedAuth
from toolkit.wire.auth import PassClaims, decode_pass, digest_metadata
from toolkit.wire.protocol import LoginResponse
from toolkit.wire.tensor_container import iter_encoded

RELAY_URL = "http://relay.test"
SKEW = 60.0


def pass_for(response: LoginResponse, peer: PeerKey, url: str = RELAY_URL) -> AccessPass:
    return AccessPass.from_login(response, peer_key=peer, relay_url=url, pins=RelayKeyPins())


def raw_pass(token: str, relay_key: RelayKey, lifetime_s: float = 600) -> AccessPass:
    """An AccessPass around any token (forgeries included), skipping the peer's own checks."""
    claims, _, _ = decode_pass(token)
    return AccessPass(
        token=token,
        claims=claims,
        relay_public=relay_key.public,
        clock_offset_s=0.0,
        received_mono=time.monotonic(),
        lifetime_s=lifetime_s,
    )


@dataclass
class Env:
    """A relay verifier and an honest peer 'alice', sharing one fake wall clock."""

    clock: Clock = field(default_factory=lambda: Clock(float(int(time.time()))))
    relay_key: RelayKey = field(default_factory=RelayKey.generate)
    peer: PeerKey = field(default_factory=PeerKey)
    banned: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.verifier = RequestVerifier(
            self.relay_key, max_skew_s=SKEW, is_banned=self.banned.__contains__, clock=self.clock
        )
        self.issuer = PassIssuer(self.relay_key, ttl_s=600, clock=self.clock)
        self.access = pass_for(self.issuer.issue("alice", self.peer.public_raw), self.peer)
        self.access = AccessPass(
            token=self.access.token,
            claims=self.access.claims,
            relay_public=self.access.relay_public,
            clock_offset_s=0.0,
            received_mono=self.access.received_mono,
            lifetime_s=self.access.lifetime_s,
        )
        self.auth = self.auth_with(self.access)

    def auth_with(self, access: AccessPass, peer: PeerKey | None = None, clock=None) -> SignedAuth:
        return SignedAuth(peer or self.peer, AccessPassHolder(lambda previous: access), clock=clock or self.clock)

    def signed(
        self,
        method: str = "POST",
        path: str = "/api/peers/p1/heartbeat",
        body: bytes | None = b'{"a":1}',
        auth: SignedAuth | None = None,
        content_type: str = "application/json",
    ) -> requests.PreparedRequest:
        headers = {"Content-Type": content_type} if body is not None else {}
        prepared = requests.Request(method, RELAY_URL + path, data=body, headers=headers).prepare()
        return (auth or self.auth)(prepared)

    def verify(self, r: requests.PreparedRequest) -> PassClaims:
        return self.verifier.verify(method=r.method, path_qs=r.path_url, headers=r.headers, body=r.body or b"")

    def rejected(self, r: requests.PreparedRequest) -> AuthRejected:
        with pytest.raises(AuthRejected) as info:
            self.verify(r)
        return info.value


def signed_container(values: np.ndarray, chunk_bytes: int) -> tuple[list, dict[str, str], bytes]:
    """A gradient upload's container with the chunk digests a signed upload carries."""
    tensors = [("grad", values)]
    metadata = {"collab": "{}", **digest_metadata(tensors, chunk_bytes)}
    return tensors, metadata, b"".join(bytes(p) for p in iter_encoded(tensors, metadata))
