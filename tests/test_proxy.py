"""The relay behind the TLS proxy of docs/organizer.md: per-address caps and rate limits see the volunteer.

A real nginx (Debian's, started by the test on 127.0.0.1 with docs/organizer.md's ``server`` block, TLS
with a certificate made here) in front of a real relay (served in this process: real HTTP on its
own port, as ``relay-server serve`` serves it). Every proxied request reaches
the relay from loopback; the relay must key its caps and buckets by the address nginx puts last
in X-Forwarded-For, and never exempt a public client because its proxy is local.

The test's volunteers all run on this machine, so to come from different addresses they pass
through nginx's realip module first: ``set_real_ip_from 127.0.0.0/8; real_ip_header
X-Test-Client-Address`` (outside the page's block, which is used as written) makes nginx see
each request as coming from the address the test names, exactly as it sees a volunteer on the
internet. What a client writes into X-Forwarded-For itself stays its own word: the tests send a
forged first hop and the relay must ignore it.
"""

from __future__ import annotations

import datetime
import ipaddress
import re
import select
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import requests

from relay_server.harness.nginx import NginxProcess
from relay_server.harness.process import wait_until
from tests.support.processes import REPO
from toolkit.client import RelayClient
from toolkit.wire.auth import b64u
from toolkit.wire.compression import get_codec
from toolkit.wire.protocol import PROTOCOL_VERSION, ROUTES, GradientMeta, Heartbeat, JoinRequest
from toolkit.wire.tensor_container import iter_encoded

CLIENT = "X-Test-Client-Address"  # the test's stand-in for "this volunteer's address", read by nginx only
FORWARDED_LINE = "proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;"
ALICE, ALICE_TOKEN = "alice", "hf_alice_proxy_token_0001"


def readme_nginx_block() -> str:
    """docs/organizer.md's nginx snippet, verbatim."""
    blocks = re.findall(r"```nginx\n(.*?)```", (REPO / "docs" / "organizer.md").read_text(), re.S)
    assert len(blocks) == 1, "docs/organizer.md should hold exactly one nginx snippet"
    return blocks[0]


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (and its key), as the organizer's Let's Encrypt pair stands in."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "fullchain.pem", directory / "privkey.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def nginx_http_block(port: int, upstream: int, cert: Path, key: Path) -> str:
    """What goes in nginx.conf's ``http { }``: docs/organizer.md's server block with this machine's
    port, certificate and relay, after the realip lines that let the test name each client."""
    block = readme_nginx_block()
    for old, new in (
        ("listen 443 ssl;", f"listen 127.0.0.1:{port} ssl;"),
        ("/etc/letsencrypt/live/relay.example.org/fullchain.pem", str(cert)),
        ("/etc/letsencrypt/live/relay.example.org/privkey.pem", str(key)),
        ("proxy_pass http://127.0.0.1:8750;", f"proxy_pass http://127.0.0.1:{upstream};"),
    ):
        assert old in block, f"docs/organizer.md's nginx snippet no longer has {old!r}: update this test with it"
        block = block.replace(old, new)
    return f"    set_real_ip_from 127.0.0.0/8;\n    real_ip_header {CLIENT};\n{block}"


@dataclass
class Nginx:
    process: NginxProcess
    cert: Path

    @property
    def port(self) -> int:
        return self.process.port

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def request(self, method: str, path: str, client: str | None = None, **kwargs) -> requests.Response:
        """``method path`` through the proxy, as a volunteer at ``client`` (None: from this host)."""
        headers = dict(kwargs.pop("headers", {}))
        if client is not None:
            headers[CLIENT] = client
        return requests.request(
            method,
            self.url + path,
            headers=headers,
            verify=str(self.cert),
            timeout=kwargs.pop("timeout", 30),
            **kwargs,
        )


@pytest.fixture
def behind_nginx(serve_relay, start_nginx, tmp_path: Path) -> Iterator:
    """``behind_nginx(overrides)`` -> (relay, nginx): a relay and docs/organizer.md's proxy before it."""
    certs = tmp_path / "certs"
    certs.mkdir()
    cert, key = self_signed(certs)

    def start(overrides: dict) -> tuple:
        relay = serve_relay(overrides)
        return relay, Nginx(start_nginx(lambda port: nginx_http_block(port, relay.port, cert, key)), cert)

    yield start


def test_the_readme_snippet_forwards_the_client_address() -> None:
    assert FORWARDED_LINE in readme_nginx_block()


def login(proxy: Nginx, client: str | None, **kwargs) -> int:
    body = {"hf_token": ALICE_TOKEN, "peer_public_key": b64u(b"k" * 32)}
    return proxy.request("POST", ROUTES["login"], client, json=body, **kwargs).status_code


def test_login_buckets_are_keyed_by_the_forwarded_address(behind_nginx, hf_standin) -> None:
    """Two volunteers behind the proxy have a bucket each; the one who spent theirs is refused
    while the other logs in, and a forged first hop buys nothing."""
    hf_standin.add_user(ALICE_TOKEN, ALICE)
    relay, proxy = behind_nginx(
        {
            "auth": {"mode": "hf", "hf_endpoint": hf_standin.url, "allow_users": [ALICE]},
            "limits": {"login_per_s": 0.001, "login_burst": 2.0},
        }
    )
    assert [login(proxy, "203.0.113.1") for _ in range(3)] == [200, 200, 429]
    assert login(proxy, "203.0.113.1", headers={"X-Forwarded-For": "198.51.100.9"}) == 429  # the client's word
    assert [login(proxy, "203.0.113.2") for _ in range(3)] == [200, 200, 429]
    assert login(proxy, "2001:db8::7") == 200  # IPv6 volunteers too
    refused = proxy.request(
        "POST", ROUTES["login"], "203.0.113.1", json={"hf_token": ALICE_TOKEN, "peer_public_key": b64u(b"k" * 32)}
    )
    assert "203.0.113.1" in refused.json()["message"] and int(refused.headers["Retry-After"]) >= 1
    # From this host, no volunteer named: the client is loopback. Logins are limited there too
    # (limits.exempt_loopback_logins = false), in a bucket of its own.
    assert [login(proxy, None) for _ in range(3)] == [200, 200, 429]


class held_request:
    """A request through the proxy, sent as raw bytes over TLS and left in progress until the
    ``with`` block ends, which closes the connection (as a closed notebook tab does)."""

    def __init__(self, proxy: Nginx, head: str, client: str, body: bytes = b"") -> None:
        self.proxy, self.head, self.client, self.body = proxy, head, client, body

    def __enter__(self) -> ssl.SSLSocket:
        context = ssl.create_default_context(cafile=str(self.proxy.cert))
        raw = socket.create_connection(("127.0.0.1", self.proxy.port), timeout=30)
        self.sock = context.wrap_socket(raw, server_hostname="127.0.0.1")
        self.sock.sendall(
            f"{self.head} HTTP/1.1\r\nHost: 127.0.0.1\r\n{CLIENT}: {self.client}\r\n".encode() + self.body
        )
        return self.sock

    def __exit__(self, *exc) -> None:
        self.sock.close()


def long_poll(proxy: Nginx, client: str) -> held_request:
    """A parameter long-poll: a request in progress at the relay for up to 60 s."""
    return held_request(proxy, f"GET {ROUTES['params']}?min_step=1000&wait=60", client, b"\r\n")


def answered(sock: ssl.SSLSocket) -> bool:
    """Whether anything came back on a held request yet (it must not have: it is in progress)."""
    return bool(sock.pending()) or bool(select.select([sock], [], [], 0)[0])


def test_connection_and_upload_caps_are_per_forwarded_address(behind_nginx) -> None:
    """``connections.max_per_address`` behind the proxy: a volunteer with that many requests in
    progress gets 503 + Retry-After for the next, while another volunteer and the organizer on
    this host are served; closing the held requests frees the address. Upload bytes in flight
    are capped per forwarded address the same way."""
    relay, proxy = behind_nginx(
        {
            "connections": {
                "max_per_address": 2,
                "max_upload_bytes_per_address": 2_500_000,
                "body_idle_timeout_s": 60.0,
            },
            "model": {"factory": "toolkit.models:MLP", "kwargs": {"sizes": [8, 40_000, 1]}},
        }
    )
    volunteer = "203.0.113.1"

    def status(client: str | None) -> requests.Response:
        return proxy.request("GET", ROUTES["status"], client)

    with long_poll(proxy, volunteer) as first, long_poll(proxy, volunteer) as second:
        [refused] = wait_until(
            lambda: [a for a in [status(volunteer)] if a.status_code == 503],
            60,
            f"{volunteer}'s third request in progress to be refused",
        )  # a 503 Response is falsy
        assert refused.json()["error"] == "relay_busy" and volunteer in refused.json()["message"]
        assert refused.headers["Retry-After"] == "2"
        assert status("203.0.113.2").status_code == 200  # another volunteer
        assert status(None).status_code == 200  # the organizer on this host: loopback, exempt
        assert status(volunteer).status_code == 503
        assert not answered(first) and not answered(second), "a held long-poll ended: the refusal proved nothing"
    # Closing the volunteer's connections to nginx ends the relay's requests: the address is free.
    wait_until(lambda: status(volunteer).status_code == 200, 60, f"{volunteer} to be served again")

    # Declared upload bytes: one address's gradient upload in flight (1.6 MB, its body stalling
    # near the end) leaves no room for a second of the same address under a 2.5 MB cap, but does
    # for another address's.
    client = RelayClient(relay.url)
    peer = client.join(JoinRequest(peer_name="uplink", protocol=PROTOCOL_VERSION)).peer_id
    assert client.heartbeat(peer, Heartbeat(version=0, samples=48, samples_per_s=10.0)).round is not None
    body = gradient_body(client.get_run().num_params, peer)
    assert len(body) > 1_300_000
    gradient = ROUTES["gradient"].format(step=0) + f"?peer_id={peer}"
    with held_request(
        proxy,
        f"PUT {gradient}",
        "203.0.113.3",
        f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:-100],
    ) as stalled:

        def busy() -> list[requests.Response]:
            answer = proxy.request("PUT", gradient, "203.0.113.3", data=body)
            return [answer] if answer.status_code == 503 else []

        [refused] = wait_until(busy, 60, "203.0.113.3's second upload to be refused")
        assert "upload bytes" in refused.json()["message"], refused.text
        other = proxy.request("PUT", gradient, "203.0.113.4", data=body)  # its peer's second upload: 409
        assert other.status_code == 409 and other.json()["error"] == "duplicate_upload", other.text
        assert not answered(stalled)
    client.close()


def gradient_body(num_params: int, peer_id: str) -> bytes:
    """A whole gradient upload for round 0, as a peer's worker encodes it."""
    meta = GradientMeta(peer_id=peer_id, step=0, version=0, samples=48, loss_sum=1.0)
    tensors = get_codec("none").encode(np.ones(num_params, dtype=np.float32))
    return b"".join(
        bytes(piece) for piece in iter_encoded(tensors, {"collab": meta.dumps().decode(), "codec": "none"})
    )


def test_without_trust_every_proxied_volunteer_is_the_proxy(behind_nginx, hf_standin) -> None:
    """``limits.trust_forwarded_for = false``: the header is ignored, by the caps as by the
    buckets: every volunteer is the loopback proxy, one login bucket for all."""
    hf_standin.add_user(ALICE_TOKEN, ALICE)
    relay, proxy = behind_nginx(
        {
            "auth": {"mode": "hf", "hf_endpoint": hf_standin.url, "allow_users": [ALICE]},
            "limits": {"login_per_s": 0.001, "login_burst": 2.0, "trust_forwarded_for": False},
        }
    )
    assert [login(proxy, "203.0.113.1"), login(proxy, "203.0.113.2"), login(proxy, "203.0.113.3")] == [200, 200, 429]


@pytest.mark.parametrize(
    "direct, header, client",
    [
        ("127.0.0.1", "203.0.113.7", "203.0.113.7"),
        ("127.0.0.1", "198.51.100.1, 203.0.113.7", "203.0.113.7"),  # earlier hops are the client's word
        ("127.0.0.1", "203.0.113.7:51234", "203.0.113.7"),  # a proxy that appends the port
        ("::1", "[2001:db8::1]:443", "2001:db8::1"),
        ("127.0.0.1", "::ffff:203.0.113.7", "203.0.113.7"),  # one spelling per address
        ("127.0.0.1", "unknown", "unknown"),  # no address: kept as text, never loopback
        ("127.0.0.1", "", "127.0.0.1"),  # no header value: the socket
        ("198.51.100.2", "203.0.113.7", "198.51.100.2"),  # a remote host cannot name itself anything else
    ],
)
def test_the_client_address_rule(direct: str, header: str, client: str) -> None:
    from relay_server.core.client_address import client_address, is_loopback

    assert client_address(direct, {"X-Forwarded-For": header}) == client
    assert client_address(direct, {"X-Forwarded-For": header}, trust_forwarded_for=False) == direct
    assert not is_loopback("unknown") and is_loopback("127.0.0.2") and is_loopback("::1%lo")
