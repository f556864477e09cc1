"""Authentication wired through a real relay process: HF login against the local stand-in, signed
requests from a real peer process, and refusals that leave the collaboration untouched.

One relay process (and one identity stand-in) serves the module: each test adds what it checks to
that run (a peer that trains, logins that are refused), and every refusal is asserted against the
state just before it, not against a fresh relay."""

from __future__ import annotations

import numpy as np
import pytest
import requests

from relay_server.harness.hf_standin import HfStandin
from relay_server.harness.process import RelayProcess
from tests.support.processes import merged, write_config
from toolkit.client import RelayClient
from toolkit.errors import RelayRejected
from toolkit.wire.protocol import PROTOCOL_VERSION, Heartbeat, JoinRequest

# the module's relay is a process, started once on one worker (--dist loadgroup)
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("auth_relay")]

ALICE, MALLORY, BOB = "hf_alice_token_123456", "hf_mallory_token_1234", "hf_bob_token_12345678"


@pytest.fixture(scope="module")
def signed_relay(tmp_path_factory: pytest.TempPathFactory):
    """An hf-mode relay process (only alice allowlisted; mallory and bob are real users of the
    stand-in), shared by the module's tests."""
    directory = tmp_path_factory.mktemp("signed-relay")
    with HfStandin() as hub:
        for token, user in ((ALICE, "alice"), (MALLORY, "mallory"), (BOB, "bob")):
            hub.add_user(token, user)
        sections = {
            "auth": {"mode": "hf", "hf_endpoint": hub.url, "allow_users": ["alice"]},
            "run": {"target_batch": 24},
        }
        config = write_config(directory / "relay.toml", merged(sections))
        env = {  # what the hf_standin fixture gives a test's environment, for this process alone
            "HF_ENDPOINT": hub.url,
            "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "NO_PROXY": "127.0.0.1,localhost",
            "HF_TOKEN": "",
        }
        relay = RelayProcess(config, directory / "relay-data", directory / "relay.log", env=env).start()
        try:
            yield relay
        finally:
            relay.stop()


def test_allowlisted_peer_logs_in_signs_everything_and_trains(signed_relay, launch_peer, monkeypatch):
    monkeypatch.setenv("COLLAB_TEST_TOKEN", ALICE)
    peer = launch_peer(
        signed_relay.url, "alice-peer", seed=1, batch_size=4, steps=3, extra=("--hf-token-env", "COLLAB_TEST_TOKEN")
    )
    assert peer.wait() == 0, peer.log_path.read_text()[-3000:]
    status = signed_relay.status()
    assert status["step"] >= 3 and status["auth_mode"] == "hf"
    assert [e["username"] for e in status["leaderboard"]] == ["alice"]
    # Every version it loaded matched the hash the relay signed (the client checks on download).
    assert ALICE not in signed_relay.log_path.read_text()  # the token never reaches a log


def test_user_not_on_the_allowlist_is_refused_with_a_hint(signed_relay):
    before = signed_relay.status()["num_peers"]
    client = RelayClient(signed_relay.url, retries=0)
    with pytest.raises(RelayRejected) as refused:
        client.login(MALLORY)
    assert refused.value.status == 403 and refused.value.hint
    assert signed_relay.status()["num_peers"] == before


def test_unsigned_and_cross_user_requests_are_refused(signed_relay):
    url = signed_relay.url
    # No pass at all: every protected route answers 401, the public ones still work.
    for method, path, body in [
        ("POST", "/api/peers/join", {"peer_name": "x", "protocol": PROTOCOL_VERSION}),
        ("GET", "/api/progress", None),
        ("GET", "/api/params", None),
    ]:
        response = requests.request(method, url + path, json=body, timeout=10)
        assert response.status_code == 401 and response.json()["hint"], (path, response.text)
    assert requests.get(url + "/api/status", timeout=10).status_code == 200
    assert requests.get(url + "/api/run", timeout=10).json()["auth"] == "hf"

    alice = RelayClient(url, retries=0)
    alice.login(ALICE)
    joined = alice.join(JoinRequest(peer_name="a", protocol=PROTOCOL_VERSION))
    out = np.empty(joined.run.num_params, dtype=np.float32)
    step = signed_relay.status()["step"]  # the module's run: whatever the tests before it trained
    assert alice.params.download_params(out, peer_id=joined.peer_id) == step  # hash checked against the signed header

    # bob is allowlisted nowhere: refused at login; even with a pass he could not act as alice's peer.
    bob = RelayClient(url, retries=0)
    with pytest.raises(RelayRejected):
        bob.login(BOB)
    before = signed_relay.status()
    hb = Heartbeat(version=0, samples=5, samples_per_s=1.0)
    with pytest.raises(RelayRejected) as refused:
        RelayClient(url, retries=0).heartbeat(joined.peer_id, hb)
    assert refused.value.status == 401
    after = signed_relay.status()
    assert (before["samples_accumulated"], before["num_peers"]) == (after["samples_accumulated"], after["num_peers"])
