"""Parameter downloads through a standard HTTP cache: a real nginx (``proxy_cache``, configured by
``examples/nginx_params_cache.conf`` as written: ``relay_server/harness/nginx.py``) in front of a
real relay.

The relay names each version's immutable body URL in a small signed answer that is never cached;
nginx fans the body out; peers check what it gave them against the relay's hash and, when the
cache lies or is down, download the version from the relay itself.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests

from relay_server.api.moderation import ADMIN_PREFIX
from relay_server.cli import main as cli_main
from relay_server.core.config import ConfigError, load_config
from relay_server.harness.hf_standin import HfStandin
from relay_server.harness.nginx import cache_http_block
from tests.support.processes import REPO, merged, write_config
from toolkit.client import RelayClient
from toolkit.wire.compression import get_codec
from toolkit.wire.protocol import (
    BLOB_CACHE_CONTROL,
    PARAMS_REF_TYPE,
    PROTOCOL_VERSION,
    ROUTES,
    GradientMeta,
    Heartbeat,
    JoinRequest,
)

PEERS = 8


@pytest.fixture
def cached_relay(serve_relay, start_nginx, tmp_path: Path):
    """``cached_relay(overrides)`` -> (relay, nginx): a relay whose ``public_params_url`` is the
    nginx in front of it. nginx's port is known only once it is picked, so the relay is started
    for that port (again, should nginx have to pick another one)."""

    def start(overrides: dict | None = None) -> tuple:
        relays = []

        def block(port: int) -> str:
            server = {**(overrides or {}).get("server", {}), "public_params_url": f"http://127.0.0.1:{port}"}
            relays.append(serve_relay({**(overrides or {}), "server": server}, name=f"relay-{len(relays)}"))
            return cache_http_block(port, relays[-1].port, tmp_path / f"cache-{len(relays)}")

        nginx = start_nginx(block)
        return relays[-1], nginx

    return start


def download(url: str) -> tuple[int, np.ndarray, int]:
    """One peer's download of the current version: (step, parameters, cache failures it counted)."""
    client = RelayClient(url)
    try:
        out = np.empty(client.get_run().num_params, dtype=np.float32)
        step = client.params.download_params(out, min_step=0, wait_s=30)
        return step, out, client.params.cache_failures
    finally:
        client.close()


def published_sha(relay) -> str:
    return requests.get(relay.url + ROUTES["state"], timeout=10).json()["sha256"]


def egress(relay) -> dict:
    """The relay's own parameter bytes: the organizer's report, read with the admin token."""
    report = relay.admin("GET", ROUTES["params_egress"].removeprefix(ADMIN_PREFIX))
    assert report.status_code == 200, report.text
    return report.json()


def test_eight_peers_download_one_version_and_the_relay_sends_its_bytes_once(cached_relay, capsys) -> None:
    relay, nginx = cached_relay()
    with ThreadPoolExecutor(PEERS) as pool:
        results = list(pool.map(download, [relay.url] * PEERS))
    sha = published_sha(relay)
    for step, params, failures in results:
        assert step == 0 and failures == 0
        assert hashlib.sha256(params.tobytes()).hexdigest() == sha
    sent = egress(relay)
    body_url = f"/api/params/v/0/{sha}/full"
    size = int(requests.head(nginx.url + body_url, timeout=10).headers["Content-Length"])
    assert size > params.nbytes  # the container: a header, then the float32 parameters
    assert sent["refs"] == PEERS and sent["direct"] == 0
    assert sent["immutable_requests"] == 1 and sent["immutable"] == size == sent["by_url"][body_url]
    capsys.readouterr()  # the organizer's CLI reads the same report with the admin token
    assert cli_main(["admin", "--url", relay.url, "--data-dir", str(relay.data_dir), "--json", "egress"]) == 0
    assert json.loads(capsys.readouterr().out) == sent
    assert cli_main(["admin", "--url", relay.url, "--data-dir", str(relay.data_dir), "egress"]) == 0
    assert f"{size} B to the cache (1 request(s)); {PEERS} refs" in capsys.readouterr().out
    # the cache answers with the relay's validators, byte ranges from its own copy
    cached = requests.get(nginx.url + body_url, headers={"Range": "bytes=100-199"}, timeout=10)
    assert cached.status_code == 206 and len(cached.content) == 100
    assert cached.headers["ETag"] == f'"{sha}"' and cached.headers["X-Cache-Status"] == "HIT"
    assert egress(relay)["immutable_requests"] == 1


def test_a_cache_serving_tampered_bytes_is_caught_and_the_relay_serves_the_version(cached_relay) -> None:
    relay, nginx = cached_relay()
    step, honest, failures = download(relay.url)  # fills the cache
    assert failures == 0
    cached = [p for p in nginx.directory.parent.rglob("cache-*/**/*") if p.is_file()]
    assert len(cached) == 1, cached
    data = bytearray(cached[0].read_bytes())
    data[-3] ^= 0x40  # one bit of the last parameter, in nginx's own cache file
    cached[0].write_bytes(bytes(data))
    sha = published_sha(relay)
    served = requests.get(f"{nginx.url}/api/params/v/0/{sha}/full", timeout=10)
    assert served.headers["X-Cache-Status"] == "HIT" and served.content[-3] != honest.tobytes()[-3]

    step, params, failures = download(relay.url)
    assert step == 0 and failures == 1  # counted (and logged) by the peer
    assert hashlib.sha256(params.tobytes()).hexdigest() == sha
    np.testing.assert_array_equal(params, honest)
    assert egress(relay)["direct"] == len(served.content)  # the relay sent the version itself, once


def test_a_signed_int8_run_gets_its_deltas_through_the_cache(cached_relay, hf_standin: HfStandin) -> None:
    """``auth = "hf"``: the ref is signed by the relay (the client checks), the body URL needs no
    pass (nginx fills itself unsigned) but is a capability the ref alone hands out, and a peer one
    version behind gets the int8 delta. Whoever knows only the sha256 gets a 403 from the cache
    (which does not keep it) as from the relay."""
    hf_standin.add_user("hf_alice_cache_token_01", "alice")
    relay, nginx = cached_relay(
        {
            "auth": {"mode": "hf", "hf_endpoint": hf_standin.url, "allow_users": ["alice"]},
            "run": {"compression": "int8", "target_batch": 8},
        }
    )
    alice = RelayClient(relay.url)
    alice.login("hf_alice_cache_token_01")
    joined = alice.join(JoinRequest(peer_name="a", protocol=PROTOCOL_VERSION))
    codec, peer = get_codec("int8"), joined.peer_id
    public = np.empty(joined.run.num_params, dtype=np.float32)
    assert alice.params.download_params(public, codec=codec, peer_id=peer) == 0
    first = hashlib.sha256(public.tobytes()).hexdigest()
    alice.heartbeat(peer, Heartbeat(version=0, samples=8, samples_per_s=10.0))
    relay.wait_for(lambda s: s["round"] is not None and s["round"]["expected_peers"] == 1, what="the round")
    gradient = np.random.default_rng(0).standard_normal(public.size).astype(np.float32)
    alice.upload_gradient(
        codec.encode(gradient), GradientMeta(peer_id=peer, step=0, version=0, samples=8, loss_sum=1.0), "int8"
    )
    assert alice.params.download_params(public, have=0, codec=codec, min_step=1, wait_s=30, peer_id=peer) == 1
    state = alice.get_state()
    assert state.step == 1 and hashlib.sha256(public.tobytes()).hexdigest() == state.sha256
    sent = egress(relay)
    assert alice.params.cache_failures == 0 and sent["direct"] == 0 and sent["refs"] == 2
    full, delta = sorted(sent["by_url"], key=lambda path: path.split("/")[4])  # by step: 0, then 1
    assert re.fullmatch(r"/api/params/v/0/[0-9a-f]{64}/full", full) and first not in full
    assert re.fullmatch(r"/api/params/v/1/[0-9a-f]{64}/delta", delta) and state.sha256 not in delta
    body = requests.get(nginx.url + delta, timeout=10)
    assert body.headers["X-Cache-Status"] == "HIT" and b'"kind":"delta"' in body.content[:400]
    for _ in range(2):  # the cache passes the refusal on, and keeps none
        for base in (nginx.url, relay.url):
            refused = requests.get(f"{base}/api/params/v/1/{state.sha256}/delta", timeout=10)
            assert (refused.status_code, refused.json()["error"]) == (403, "params_url_not_issued")
            assert refused.json()["hint"] and refused.headers.get("X-Cache-Status") in (None, "MISS")
    alice.close()


def test_a_cache_that_is_down_costs_a_fallback_to_the_relay(serve_relay, closed_url: str) -> None:
    relay = serve_relay({"server": {"public_params_url": closed_url}})
    step, params, failures = download(relay.url)
    assert step == 0 and failures == 1
    assert hashlib.sha256(params.tobytes()).hexdigest() == published_sha(relay)


def test_immutable_urls_carry_strong_validators_and_the_current_version_is_never_cached(
    serve_relay, closed_url: str
) -> None:
    relay = serve_relay({"server": {"public_params_url": closed_url + "/"}})
    ref = requests.get(relay.url + ROUTES["params"], params={"ref": 1}, timeout=10)
    assert ref.headers["Content-Type"].startswith(PARAMS_REF_TYPE) and ref.headers["Cache-Control"] == "no-store"
    body = ref.json()
    sha = published_sha(relay)
    assert (
        body["sha256"] == sha and body["kind"] == "full" and body["url"] == f"{closed_url}/api/params/v/0/{sha}/full"
    )
    path = relay.url + f"/api/params/v/0/{sha}/full"
    whole = requests.get(path, timeout=10)
    assert whole.status_code == 200 and whole.headers["ETag"] == f'"{sha}"'
    assert whole.headers["Cache-Control"] == BLOB_CACHE_CONTROL and whole.headers["Accept-Ranges"] == "bytes"
    size = len(whole.content)
    part = requests.get(path, headers={"Range": "bytes=10-19"}, timeout=10)
    assert part.status_code == 206 and part.content == whole.content[10:20]
    assert part.headers["Content-Range"] == f"bytes 10-19/{size}"
    tail = requests.get(path, headers={"Range": "bytes=-7"}, timeout=10)
    assert tail.status_code == 206 and tail.content == whole.content[-7:]
    stale = requests.get(path, headers={"Range": "bytes=0-9", "If-Range": '"other"'}, timeout=10)
    assert stale.status_code == 200 and stale.content == whole.content
    assert requests.get(path, headers={"Range": f"bytes={size}-"}, timeout=10).status_code == 416
    for held in (f'"{sha}"', f'"x", W/"{sha}"', "*"):
        not_modified = requests.get(path, headers={"If-None-Match": held}, timeout=10)
        assert not_modified.status_code == 304 and not not_modified.content
        assert not_modified.headers["ETag"] == f'"{sha}"'
    assert requests.get(path, headers={"If-None-Match": '"x"'}, timeout=10).status_code == 200
    assert requests.get(path, headers={"Range": "bytes=9-3"}, timeout=10).status_code == 200  # invalid: ignored
    huge = "9" * 5000  # more digits than int() converts: a 500 once
    past = requests.get(path, headers={"Range": f"bytes={huge}-"}, timeout=10)
    assert past.status_code == 416 and past.headers["Content-Range"] == f"bytes */{size}" and past.json()["hint"]
    for value in (f"bytes=-{huge}", f"bytes=0-{huge}"):  # past the end: to the end (RFC 9110 14.1.2)
        assert requests.get(path, headers={"Range": value}, timeout=10).content == whole.content
    for unknown in (f"/api/params/v/1/{sha}/full", f"/api/params/v/0/{'0' * 64}/full", f"/api/params/v/0/{sha}/delta"):
        missing = requests.get(relay.url + unknown, timeout=10)
        assert missing.status_code == 404 and "public" not in missing.headers.get("Cache-Control", "")
    # the body bytes are the same the relay sends directly
    direct = requests.get(relay.url + ROUTES["params"], timeout=10)
    assert direct.content == whole.content and direct.headers["Cache-Control"] == "no-store"


def test_without_a_cache_there_is_no_immutable_url(serve_relay) -> None:
    relay = serve_relay()
    direct = requests.get(relay.url + ROUTES["params"], params={"ref": 1}, timeout=10)
    assert direct.headers["Content-Type"] == "application/octet-stream"  # ref=1 is a request, not an order
    sha = published_sha(relay)
    refused = requests.get(relay.url + f"/api/params/v/0/{sha}/full", timeout=10)
    assert refused.status_code == 404 and refused.json()["error"] == "no_params_cache"


@pytest.mark.parametrize(
    "url", ["cache.example.org", "ftp://cache.example.org", "https://c.example.org/?x=1", "https://c.example.org/#f"]
)
def test_a_bad_cache_url_is_one_line_naming_the_field(tmp_path: Path, url: str) -> None:
    config = merged({"server": {"public_params_url": url}})
    with pytest.raises(ConfigError) as refused:
        load_config(write_config(tmp_path / "run.toml", config))
    message = str(refused.value)
    assert "server.public_params_url" in message and "\n" not in message


@pytest.mark.integration
@pytest.mark.slow
def test_the_egress_benchmark_runs_tiny_and_the_cache_cuts_the_relays_bytes() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/egress.py",
            "--peers",
            "2,4",
            "--steps",
            "1",
            "--numel",
            "20000",
            "--processes",
            "2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["cache_failures"] == 0
    # 4 peers: the relay sends each body once (plus four small refs) instead of four times
    assert 0.25 <= result["relay_bytes_per_step_ratio"] < 0.3
