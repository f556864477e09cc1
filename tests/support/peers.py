"""Peers driven by hand, for tests that send what the toolkit never would: :class:`RawPeer` speaks the
wire protocol unsigned (an open-mode relay), :func:`raw_http` writes HTTP bytes itself, and
:class:`SignedPeer` is the toolkit's own signed client in hf mode (logged in through the local
Hugging Face stand-in that :func:`standin` starts) that can also hand-craft signed requests to
tamper with them. :func:`hf_relay` starts the relay process they talk to."""

from __future__ import annotations

import hashlib
import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import requests

from relay_server.harness.hf_standin import HfStandin
from relay_server.harness.process import RelayProcess
from tests.support.processes import merged, write_config
from toolkit.client import RelayClient
from toolkit.signing import SignedAuth
from toolkit.wire.auth import BODY_SHA256_HEADER, CONTAINER_TYPE, container_body_sha256, digest_metadata
from toolkit.wire.compression import get_codec
from toolkit.wire.protocol import PROTOCOL_VERSION, GradientMeta, Heartbeat, JoinRequest
from toolkit.wire.tensor_container import encode_header

TOKENS = {
    "alice": "hf_alice_attack_token_01",
    "bob": "hf_bob_attack_token_0001",
    "eve": "hf_eve_attack_token_0001",
    "mallory": "hf_mallory_attack_token1",
}

ALLOWED = ["alice", "bob", "eve"]  # mallory is a real HF user, just not on this run's allowlist

SAMPLES = 10

FLOOD_LIMITS = {"poll_per_s": 30.0, "poll_burst": 60.0}  # low, so the flood test trips within a second

OVERRIDES = {  # SGD, lr 1: the applied step is exactly -(mean gradient), checkable bit for bit
    "optimizer": {"name": "sgd", "lr": 1.0, "weight_decay": 0.0, "momentum": 0.0},
    "run": {"target_batch": SAMPLES, "max_staleness": 0},
    "rounds": {
        "heartbeat_interval_s": 1.0,
        "peer_ttl_s": 600.0,
        "deadline_initial_s": 600.0,
        "deadline_floor_s": 600.0,
        "deadline_ceiling_s": 600.0,
    },
    "limits": FLOOD_LIMITS,
}


def hf_relay(directory: Path, hub: HfStandin, overrides: dict | None = None, name: str = "relay") -> RelayProcess:
    """A relay process in hf mode whose identity provider is the local stand-in."""
    config = merged(
        {**OVERRIDES, **(overrides or {}), "auth": {"mode": "hf", "hf_endpoint": hub.url, "allow_users": ALLOWED}}
    )
    path = write_config(directory / f"{name}.toml", config)
    env = {
        "HF_ENDPOINT": hub.url,
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "NO_PROXY": "127.0.0.1,localhost",
        "HF_TOKEN": "",
    }
    return RelayProcess(path, directory / f"{name}-data", directory / f"{name}.log", env=env).start()


def standin() -> HfStandin:
    hub = HfStandin().start()
    for user, token in TOKENS.items():
        hub.add_user(token, user)
    return hub


@dataclass
class SignedPeer:
    """A logged-in client that can also hand-craft signed requests (to tamper with them)."""

    relay: RelayProcess
    client: RelayClient
    peer_id: str = ""

    @classmethod
    def login(cls, relay: RelayProcess, user: str) -> "SignedPeer":
        client = RelayClient(relay.url, retries=0)
        client.login(TOKENS[user])
        return cls(relay, client)

    @property
    def auth(self) -> SignedAuth:
        return self.client.session.auth  # type: ignore[return-value]

    def join(self, name: str) -> "SignedPeer":
        self.peer_id = self.client.join(JoinRequest(peer_name=name, protocol=PROTOCOL_VERSION)).peer_id
        return self

    def heartbeat_body(self, samples: int = SAMPLES) -> bytes:
        return Heartbeat(version=0, samples=samples, samples_per_s=10.0).dumps()

    def prepared(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        auth: Any = None,
        content_type: str = "application/json",
    ) -> requests.PreparedRequest:
        headers = {"Content-Type": content_type} if body is not None else {}
        request = requests.Request(method, self.relay.url + path, data=body, headers=headers).prepare()
        return (auth or self.auth)(request)

    def send(self, prepared: requests.PreparedRequest) -> requests.Response:
        return self.client.session.send(prepared, timeout=30)

    def upload(self, grad: np.ndarray, codec: str = "none", **meta_changes: Any) -> requests.Response:
        """A correctly signed upload (chunk digests and all) of ``grad``, encoded with ``codec``
        (the toolkit's own encoder): whatever the relay refuses here, it refuses on content, not
        on the signature or the codec's format."""
        fields = dict(peer_id=self.peer_id, step=0, version=0, samples=SAMPLES, loss_sum=1.0) | meta_changes
        tensors = [("payload", grad)] if codec == "none" else get_codec(codec).encode(grad)
        metadata = {"collab": GradientMeta(**fields).dumps().decode(), "codec": codec, **digest_metadata(tensors)}
        body = encode_header(tensors, metadata) + b"".join(t.tobytes() for _, t in tensors)
        headers = {"Content-Type": CONTAINER_TYPE, BODY_SHA256_HEADER: container_body_sha256(tensors, metadata)}
        request = requests.Request(
            "PUT",
            f"{self.relay.url}/api/rounds/{fields['step']}/gradient",
            params={"peer_id": self.peer_id},
            data=iter([body]),
            headers=headers,
        ).prepare()
        request.headers["Content-Length"] = str(len(body))
        request.headers.pop("Transfer-Encoding", None)
        return self.send(self.auth(request))


def signed_container(
    peer: SignedPeer, head: bytes, body: bytes, path: str, method: str = "PUT"
) -> requests.PreparedRequest:
    """A request signed the way uploads are: over the container head's hash (streamed body)."""
    request = requests.Request(
        method,
        peer.relay.url + path,
        data=iter([body]),
        headers={"Content-Type": CONTAINER_TYPE, BODY_SHA256_HEADER: hashlib.sha256(head).hexdigest()},
    ).prepare()
    request.headers["Content-Length"] = str(len(body))
    request.headers.pop("Transfer-Encoding", None)
    return peer.auth(request)


@dataclass
class RawPeer:
    """Speaks the wire protocol by hand, so a test can send what the toolkit never would."""

    relay: RelayProcess
    peer_id: str = ""

    def join(self, name: str) -> "RawPeer":
        body = {"peer_name": name, "protocol": PROTOCOL_VERSION}
        self.peer_id = requests.post(self.relay.url + "/api/peers/join", json=body, timeout=10).json()["peer_id"]
        return self

    def heartbeat(self, samples: int, version: int = 0, **fields: Any) -> requests.Response:
        """``fields``: more of the heartbeat (a local SGD peer's ``inner_steps``, ``busy_fraction``)."""
        return requests.post(
            f"{self.relay.url}/api/peers/{self.peer_id}/heartbeat",
            timeout=10,
            json={"version": version, "samples": samples, "samples_per_s": 10.0, **fields},
        )

    def meta(self, **changes) -> GradientMeta:
        fields = dict(peer_id=self.peer_id, step=0, version=0, samples=10, loss_sum=1.0) | changes
        return GradientMeta(**fields)

    def container(self, grad: np.ndarray, meta: GradientMeta | None = None, name: str = "payload") -> bytes:
        metadata = {"collab": (meta or self.meta()).dumps().decode()}
        return encode_header([(name, grad)], metadata) + grad.tobytes()

    def upload(self, body: bytes | object, step: int = 0, peer_id: str | None = None) -> requests.Response:
        return requests.put(
            f"{self.relay.url}/api/rounds/{step}/gradient",
            data=body,
            timeout=30,
            params={"peer_id": self.peer_id if peer_id is None else peer_id},
        )


def raw_http(port: int, head: str, body: bytes = b"", *, close_after_send: bool = False) -> tuple[int, dict]:
    """Send hand-written HTTP; return (status, JSON body), or (0, {}) when we hang up first."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n" + body)
        if close_after_send:
            return 0, {}
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < _content_length(reply):
            piece = sock.recv(65536)
            if not piece:
                break
            reply += piece
    status = int(reply.split(b" ", 2)[1])
    return status, json.loads(reply.split(b"\r\n\r\n", 1)[1] or b"{}")


def _content_length(reply: bytes) -> int:
    for line in reply.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def round_state(relay: RelayProcess) -> tuple:
    """Everything about the open round a bad request must not change."""
    s = relay.status()
    r = s["round"]
    return (
        s["step"],
        s["samples_accumulated"],
        s["num_peers"],
        r and (r["step"], r["round_id"], r["expected_peers"], r["received_peers"]),
    )
