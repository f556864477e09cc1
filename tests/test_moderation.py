"""Moderation and rate limits.

In-process: the admin token (0600, constant-time check), the token buckets (fake clock), which
bucket each route draws from, and the middlewares in a real aiohttp app (TestServer): a flood
from one address gets 429 + Retry-After while its other buckets and the admin API are untouched,
and an address that keeps failing authentication is refused before any signature is checked.

End to end, through a real hf-mode relay, a real peer process and the real ``relay-server admin``
CLI: contributions per Hugging Face username, checkpoints, a rollback (the new version holds step
k's stored parameters and optimizer state exactly, the step counter continues at N + 1, and the
running peer resyncs and keeps training), and ban / bans / unban.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request
from safetensors.numpy import load_file

from relay_server.api.app import create_app
from relay_server.api.moderation import TOKEN_FILE, AdminToken
from relay_server.api.ratelimit import ClientKeys, Rate, TokenBuckets, route_kind
from relay_server.auth.verify import IDENTITY_KEY
from relay_server.cli import main as cli_main
from relay_server.core.config import load_config
from relay_server.core.errors import ApiError
from relay_server.harness import zygote
from tests.support.clock import Clock
from tests.support.peers import TOKENS, SignedPeer, hf_relay, standin
from tests.support.processes import REPO, merged
from toolkit.wire.protocol import PROTOCOL_VERSION, ROUTES


# --- the admin token -------------------------------------------------------------------------------
def test_admin_token_is_created_0600_reused_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "data" / TOKEN_FILE
    token = AdminToken.load_or_create(path)
    secret = path.read_text().strip()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(secret) >= 40
    assert secret not in repr(token)
    AdminToken.load_or_create(path).check(f"Bearer {secret}")  # reloaded, not regenerated
    assert path.read_text().strip() == secret
    for header, code in [
        (None, "admin_auth_required"),
        ("", "admin_auth_required"),
        (secret, "admin_auth_required"),
        (f"Basic {secret}", "admin_auth_required"),
        (f"Bearer {secret[:-1]}", "bad_admin_token"),
        (f"Bearer {secret}x", "bad_admin_token"),
        ("Bearer \udcff", "bad_admin_token"),
    ]:
        with pytest.raises(ApiError) as refused:
            token.check(header)
        assert (refused.value.status, refused.value.code) == (401, code) and refused.value.hint
    os.chmod(path, 0o644)
    AdminToken.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # a loosened file is tightened again


# --- token buckets ----------------------------------------------------------------------------------
def test_token_bucket_allows_a_burst_then_the_rate() -> None:
    clock = Clock(1000.0)
    buckets = TokenBuckets({"poll": Rate(per_s=2.0, burst=5.0)}, clock=clock)
    assert [buckets.take("poll", "a") for _ in range(5)] == [0.0] * 5
    assert buckets.take("poll", "a") == pytest.approx(0.5)  # one token comes back every 0.5 s
    assert buckets.take("poll", "b") == 0.0  # another key has its own bucket
    clock.now += 0.5
    assert buckets.take("poll", "a") == 0.0 and buckets.take("poll", "a") > 0
    clock.now += 3600
    assert [buckets.take("poll", "a") for _ in range(6)].count(0.0) == 5  # refills to the burst, no further
    assert buckets.peek("poll", "a") > 0 and buckets.peek("poll", "never-seen") == 0.0


def test_token_buckets_stay_bounded_under_an_address_flood() -> None:
    clock = Clock(1000.0)
    buckets = TokenBuckets({"observe": Rate(per_s=1.0, burst=1.0)}, clock=clock, max_keys=100)
    buckets.take("observe", "flooding")
    for i in range(10_000):
        buckets.take("observe", f"addr-{i}")
        assert len(buckets) <= 100
    assert buckets.take("observe", "addr-9999") > 0  # the newest keys are never the ones forgotten


def _resolved(app: web.Application, method: str, path: str, headers: dict | None = None, peer: tuple | None = None):
    async def resolve():
        transport = mock.Mock()
        transport.get_extra_info.side_effect = lambda name, default=None: peer if name == "peername" else default
        request = make_mocked_request(method, path, headers=headers, app=app, transport=transport)
        request._match_info = await app.router.resolve(request)  # what the server does before middlewares
        return request

    return asyncio.run(resolve())


def test_every_route_draws_from_the_right_bucket(tmp_path: Path) -> None:
    app = create_app(
        _config(tmp_path, auth={"mode": "hf", "allow_users": ["alice"], "hf_endpoint": "http://127.0.0.1:9"})
    )
    kinds = {
        ("POST", ROUTES["heartbeat"].format(peer_id="p")): "poll",
        ("GET", ROUTES["progress"]): "poll",
        ("GET", ROUTES["state"]): "poll",
        ("POST", ROUTES["leave"].format(peer_id="p")): "poll",
        ("PUT", ROUTES["gradient"].format(step=3)): "transfer",
        ("GET", ROUTES["params"]): "transfer",
        ("POST", ROUTES["join"]): "join",
        ("GET", ROUTES["status"]): "observe",
        ("GET", ROUTES["run"]): "observe",
        ("GET", "/"): "observe",
        ("GET", "/no/such/route"): "observe",
        ("GET", "/favicon.ico"): "observe",
        ("GET", ROUTES["shards"]): "observe",
        ("POST", ROUTES["shard_lease"].format(peer_id="p")): "poll",
        ("POST", ROUTES["login"]): "login",
        ("POST", ROUTES["refresh"]): "login",
        ("GET", "/api/admin/contributions"): None,
        ("POST", "/api/admin/rollback"): None,
    }
    for (method, path), kind in kinds.items():
        assert route_kind(_resolved(app, method, path)) == kind, (method, path)


def test_client_keys_user_then_address() -> None:
    app = web.Application()
    keys = ClientKeys(exempt_loopback=True)
    assert keys.key(_resolved(app, "GET", "/x")) == "addr:unknown"  # a mocked request has no peer address
    signed = _resolved(app, "GET", "/x")
    with warnings.catch_warnings():  # the auth middleware's plain-string key, as set in production
        warnings.simplefilter("ignore")
        signed[IDENTITY_KEY] = {"username": "Alice", "peer_key": "k"}
    assert keys.key(signed) == "user:alice"
    header = {"X-Forwarded-For": "6.6.6.6, 10.0.0.7"}
    proxied = _resolved(app, "GET", "/x", header, peer=("127.0.0.1", 4000))
    assert keys.key(proxied) == "addr:10.0.0.7"  # through a local proxy: the hop it added, not the client's claim
    assert keys.key(_resolved(app, "GET", "/x", peer=("127.0.0.1", 4000))) is None  # local, unproxied: exempt
    assert ClientKeys(exempt_loopback=False).key(_resolved(app, "GET", "/x", peer=("::1", 4000, 0, 0))) == "addr:::1"
    direct = _resolved(app, "GET", "/x", header, peer=("203.0.113.9", 4000))
    assert keys.key(direct) == "addr:203.0.113.9"  # only a proxy on this host may name the client
    assert ClientKeys(trust_forwarded_for=False).key(proxied) is None


# --- the middlewares in a real app --------------------------------------------------------------------
def _config(tmp_path: Path, **sections):
    base = merged({"server": {"data_dir": str(tmp_path / "data"), "port": 0}, **sections})
    base["run"]["precision"] = ""  # the embedded default pins fp32; these joins state no policy
    return load_config(None, overrides=base)


def _serve(config, scenario) -> None:
    async def main() -> None:
        async with TestClient(TestServer(create_app(config))) as client:
            await scenario(client, Path(config.server.data_dir))

    asyncio.run(main())


@pytest.mark.integration
def test_a_flood_from_one_address_gets_429_and_nothing_else_does(tmp_path: Path) -> None:
    limits = {"exempt_loopback": False, "observe_per_s": 1.0, "observe_burst": 5.0}

    async def scenario(client: TestClient, data_dir: Path) -> None:
        answers = [await client.get("/api/status") for _ in range(8)]
        assert [a.status for a in answers] == [200] * 5 + [429] * 3
        body = await answers[-1].json()
        assert body["error"] == "rate_limited" and body["message"] and body["hint"]
        assert int(answers[-1].headers["Retry-After"]) >= 1
        token = (data_dir / TOKEN_FILE).read_text().strip()
        for _ in range(20):  # the organizer is never limited
            answer = await client.get("/api/admin/contributions", headers={"Authorization": f"Bearer {token}"})
            assert answer.status == 200
        joined = await client.post("/api/peers/join", json={"peer_name": "p", "protocol": PROTOCOL_VERSION})
        assert joined.status == 200  # other kinds of route have their own buckets

    _serve(_config(tmp_path, limits=limits), scenario)


@pytest.mark.integration
def test_behind_a_local_proxy_each_client_has_its_own_bucket(tmp_path: Path) -> None:
    """Default settings, as in docs/organizer.md's Caddy/nginx setup: every request arrives from
    loopback, the proxy's X-Forwarded-For names the client."""

    async def scenario(client: TestClient, data_dir: Path) -> None:
        flood = {"X-Forwarded-For": "198.51.100.7"}
        assert [(await client.get("/api/status", headers=flood)).status for _ in range(7)] == [200] * 5 + [429] * 2
        other = {"X-Forwarded-For": "spoofed, 203.0.113.5"}  # only the proxy's own (last) hop counts
        assert (await client.get("/api/status", headers=other)).status == 200
        assert {(await client.get("/api/status")).status for _ in range(10)} == {200}  # local, unproxied

    _serve(_config(tmp_path, limits={"observe_per_s": 0.01, "observe_burst": 5.0}), scenario)


@pytest.mark.integration
def test_an_address_that_keeps_failing_auth_is_refused_before_verification(tmp_path: Path) -> None:
    limits = {"exempt_loopback": False, "auth_failures_per_s": 0.01, "auth_failures_burst": 3.0}
    auth = {"mode": "hf", "allow_users": ["alice"], "hf_endpoint": "http://127.0.0.1:9"}
    headers = {
        "X-Collab-Pass": "AAAA",
        "X-Collab-Timestamp": "1",
        "X-Collab-Nonce": "n" * 22,
        "X-Collab-Body-Sha256": "0" * 64,
        "X-Collab-Signature": "AAAA",
    }

    async def scenario(client: TestClient, data_dir: Path) -> None:
        codes = [(await (await client.get("/api/progress", headers=headers)).json())["error"] for _ in range(5)]
        assert codes == ["malformed_pass"] * 3 + ["rate_limited"] * 2
        answer = await client.get("/api/progress", headers=headers)
        assert answer.status == 429 and "refused signed" in (await answer.json())["message"]
        assert int(answer.headers["Retry-After"]) >= 100
        unsigned = await client.get("/api/progress")  # costs no verification: not held back, just refused
        assert (await unsigned.json())["error"] == "missing_auth"
        assert (await client.get("/api/status")).status == 200  # public reads are another bucket

    _serve(_config(tmp_path, limits=limits, auth=auth), scenario)


@pytest.mark.integration
def test_limits_can_be_turned_off(tmp_path: Path) -> None:
    async def scenario(client: TestClient, data_dir: Path) -> None:
        assert {(await client.get("/api/status")).status for _ in range(30)} == {200}

    _serve(_config(tmp_path, limits={"enabled": False, "exempt_loopback": False, "observe_burst": 1.0}), scenario)


# --- end to end: a real relay, a real peer, the real CLI ------------------------------------------------
class AdminCli:
    """``relay-server admin --url URL --data-dir DIR ...``: in this process (the CLI's own
    ``main``; a Python start per call would dominate the test), or as a real process."""

    def __init__(self, relay, capsys) -> None:
        self.relay, self.capsys = relay, capsys

    def __call__(self, *args: str) -> tuple[int, str]:
        self.capsys.readouterr()
        where = [] if "--token-file" in args else ["--data-dir", str(self.relay.data_dir)]
        code = cli_main(["admin", "--url", self.relay.url, *where, *args])
        out = self.capsys.readouterr()
        return code, out.out + out.err

    def process(self, *args: str) -> tuple[int, str]:
        done = zygote.run(
            [sys.executable, "-m", "relay_server.cli", "admin", "--url", self.relay.url, *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        return done.returncode, done.stdout + done.stderr


def test_cli_contributions_rollback_and_ban_end_to_end(tmp_path: Path, launch_peer, monkeypatch, capsys) -> None:
    hub = standin()
    relay = None
    try:
        relay = hf_relay(
            tmp_path,
            hub,
            {
                "run": {"target_batch": 24, "max_staleness": 0},
                "rounds": merged(None)["rounds"],
                "optimizer": merged(None)["optimizer"],
            },
        )
        admin_cli = AdminCli(relay, capsys)
        monkeypatch.setenv("COLLAB_TEST_TOKEN", TOKENS["alice"])
        peer = launch_peer(
            relay.url,
            "alice-peer",
            seed=1,
            batch_size=4,
            steps=10**6,  # until we stop it
            extra=("--hf-token-env", "COLLAB_TEST_TOKEN", "--sleep-per-batch", "0.02"),
        )
        relay.wait_for(lambda s: s["step"] >= 4, what="four steps")

        # rollback while the peer trains: version N + 1 holds step 2's stored state exactly
        code, out = admin_cli("--json", "checkpoints")
        assert code == 0 and 2 in [c["step"] for c in json.loads(out)["checkpoints"]], out
        code, out = admin_cli.process("--data-dir", str(relay.data_dir), "--json", "rollback", "2")  # the real CLI
        assert code == 0, out
        new_step = json.loads(out)["step"]
        state = relay.data_dir / "state"
        previous, restored, source = (
            load_file(str(state / f"step-{s:08d}.safetensors")) for s in (new_step - 1, new_step, 2)
        )
        assert new_step - 1 >= 4 and set(restored) == set(source)
        for name in source:  # parameters and optimizer state, bit for bit
            assert np.array_equal(restored[name], source[name]), name
        assert not np.array_equal(previous["params"], source["params"])  # it really went back
        rounds = {r["step"]: r for r in relay.status()["recent_rounds"]}
        assert rounds[new_step]["finalized_by"] == "rollback"
        relay.wait_for(lambda s: s["step"] >= new_step + 3, what="training to go on after the rollback")
        peer.proc.terminate()  # like closing the notebook: the worker leaves cleanly
        assert peer.wait() == 0, peer.log_path.read_text()[-3000:]
        after = {r["step"]: r for r in relay.status()["recent_rounds"]}
        assert all(after[s]["contributors"] == 1 for s in range(new_step + 1, new_step + 4))
        assert max(e["step"] for e in peer.events() if e["event"] == "round") > new_step  # the same peer resynced

        # contributions: per HF username, the leaderboard's numbers
        code, out = admin_cli("--json", "contributions")
        assert code == 0, out
        users = {u["username"]: u for u in json.loads(out)["users"]}
        board = {e["username"]: e["samples"] for e in relay.status()["leaderboard"]}
        assert users["alice"]["samples"] == board["alice"] >= (new_step + 3 - 1) * 24
        assert users["alice"]["peers"] == 1 and users["alice"]["peers_online"] == 0 and not users["alice"]["banned"]

        # ban: immediate, visible in bans and contributions; unban lifts it
        bob = SignedPeer.login(relay, "bob").join("bob-notebook")
        code, out = admin_cli("ban", "bob", "--reason", "sent x1000 gradients")
        assert code == 0 and "banned bob (1 peer(s) dropped)" in out, out
        response = bob.send(bob.prepared("GET", "/api/progress"))
        assert (response.status_code, response.json()["error"]) == (403, "user_banned")
        code, out = admin_cli("bans")
        assert code == 0 and "bob" in out and "sent x1000 gradients" in out
        code, out = admin_cli("--json", "contributions")
        assert {u["username"]: u["banned"] for u in json.loads(out)["users"]}["bob"] is True
        code, out = admin_cli("unban", "bob")
        assert code == 0 and out.strip() == "unbanned bob"
        assert bob.send(bob.prepared("GET", "/api/progress")).status_code == 200

        # refusals come back as the relay's message and hint, with a non-zero exit code
        code, out = admin_cli("rollback", "99999")
        assert code == 1 and "[no_checkpoint]" in out and "hint:" in out
        (tmp_path / "wrong-token").write_text("A" * 43)
        code, out = AdminCli(relay, capsys)("--token-file", str(tmp_path / "wrong-token"), "bans")
        assert code == 1 and "[bad_admin_token]" in out
        code, out = AdminCli(relay, capsys)("--token-file", str(tmp_path / "relay.toml"), "bans")
        assert code == 2 and "no admin token" in out
        assert (relay.data_dir / TOKEN_FILE).read_text().strip() not in relay.log_path.read_text()
    finally:
        if relay is not None:
            relay.stop()
        hub.stop()
