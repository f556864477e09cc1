"""Dishonest expert hosts against the relay's spot checks and monitor (``[moe] check_share``).

First the checks' decisions in this process, on the relay's real DMoE state and the hosts' real
expert code (which calls are checked, a check at a version the relay holds or waiting for its
checkpoint, a lie answered by the relay and its host banned, the monitor making a host a
suspect); then a real relay, real host processes (``toolkit.moe.host``; the liar is ``tests/lying_expert_host.py``,
the same host whose runtime answers wrong), expert calls made through the relay as a trainer
makes them.

* ``identity``: the liar returns every call's input unchanged. At ``check_share = 0.25`` a call
  is checked at random, and the monitor makes every call of the liar a check once two of its
  answers were outliers of its layer: the liar is banned within :data:`IDENTITY_ROUNDS` rounds
  (a round calls each of the 8 experts once: 2 of them the liar's).
* ``scale``: the liar multiplies its forward outputs by 1.3 from the expert's first update on,
  so the check needs the host's checkpoint of that version (computed on the relay then, or as
  soon as that checkpoint comes): banned within :data:`SCALE_SECONDS`, and its experts then
  answer from another host exactly as an honest host trains them.
* an honest run (two hosts, a trainer for 20 steps, every call checked) bans nobody, has no
  disagreement and still equals one process to 1e-5.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import torch

from relay_server.core.config import ConfigError, load_config
from relay_server.core.errors import ApiError
from relay_server.harness.process import wait_until
from relay_server.moe.feature import EXPERTS
from relay_server.moe.moe_config import MoeSection
from relay_server.moe.state import Experts
from relay_server.trust.expert_checks import build_trust
from tests.support.moe import (
    KWARGS,
    LR,
    UIDS,
    Member,
    directory,
    latest_checkpoint,
    one_process_reference,
    overrides,
    start_host,
    stop,
    train_with_two_hosts,
)
from tests.support.processes import REPO
from tests.support.training import relay_params
from toolkit.models import DMoEMLP
from toolkit.moe.calls import ExpertFailed, LoopbackCaller
from toolkit.moe.experts import build_expert, checkpoint_of, make_optimizer
from toolkit.moe.remote import RelayExpertCaller
from toolkit.wire import payloads
from toolkit.wire.compression import get_codec

IDENTITY_ROUNDS = 6
"""Rounds by which the identity liar is banned: the layer's monitor warms up over 8 answers (two
rounds), two outliers make the liar a suspect (one more round: each round brings one answer of
the liar per layer), its next call is then checked; a random check (1 in 4) comes sooner."""
SCALE_SECONDS = 10.0
"""The scale liar's first lie is checked when the host's next checkpoint (every 0.5 s) of that
version reaches the relay, or at once if it is there already."""


def trust(relay) -> dict:
    """The relay's expert checks now (what ``GET /api/status`` shows under ``experts.trust``, the
    Experts panel's data, at most a second later)."""
    return relay.call(lambda: relay.app[EXPERTS].review.status())


def observed(relay) -> dict:
    return requests.get(relay.url + "/api/status", timeout=10).json()["experts"]["trust"]


def start_liar(url: str, capacity: int, lie: str, log: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "tests/lying_expert_host.py", url, str(capacity), lie, *extra],
        cwd=REPO,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )


def liar_and_honest_host(relay, tmp_path: Path, lie: str, *extra: str):
    """The liar leases 2 experts first (one per layer: a minority of each layer's calls, as a
    monitor needs), then an honest host the other 6 (and, later, the liar's orphans)."""
    liar = start_liar(relay.url, 2, lie, tmp_path / "liar.log", *extra)
    wait_until(lambda: len(directory(relay.url)["live"]) == 2, 60, "the liar to lease 2 experts")
    hosting = relay.status()["experts"]["experts_per_host"]
    assert list(hosting.values()) == [2], hosting
    liar_id = next(iter(hosting))
    honest = start_host(relay.url, "honest", 8, tmp_path / "honest.log")
    wait_until(lambda: len(directory(relay.url)["live"]) == 8, 60, "the honest host to lease the other 6")
    liar_uids = sorted(
        uid for uid in UIDS if relay.call(lambda u=uid: relay.app[EXPERTS].directory.host_of(u)) == liar_id
    )
    return liar, honest, liar_id, liar_uids


MOE_SECTION = {
    "enabled": True,
    "layers": 2,
    "grid": [2, 2],
    "expert": {"kind": "ffn", "d": 8, "hidden": 16},
    "optimizer": {"name": "sgd", "lr": LR},
}


class Host:
    """One expert as a host holds it (the toolkit's runtime: forward under no_grad, backward then
    one SGD step) and the result bodies it sends, tagged with the version it computed them on."""

    def __init__(self, uid: str, lie: float = 1.0, codec: str = "none") -> None:
        self.uid, self.lie, self.version, self.codec = uid, lie, 0, get_codec(codec)
        module = build_expert(MOE_SECTION["expert"], uid)
        self.optimizer = make_optimizer(MOE_SECTION["optimizer"], module)
        self.runtime = LoopbackCaller({uid: module}, optimizer_factory=lambda m: self.optimizer)

    def forward(self, x: np.ndarray) -> bytes:
        y = self.runtime.forward(self.uid, torch.from_numpy(x)).result().numpy() * self.lie
        return payloads.encode(payloads.encode_rows("y", y, self.codec), {payloads.RESULT_VERSION: str(self.version)})

    def backward(self, x: np.ndarray, g: np.ndarray) -> bytes:
        out = self.runtime.backward(self.uid, torch.from_numpy(x), torch.from_numpy(g)).result().numpy()
        body = payloads.encode(
            payloads.encode_rows("g", out, self.codec), {payloads.RESULT_VERSION: str(self.version)}
        )
        self.version += 1
        return body

    def checkpoint(self) -> bytes:
        return checkpoint_of(self.runtime.experts[self.uid], self.optimizer, self.version)


def state(tmp_path: Path, share: float, codec: str = "none"):
    """The relay's DMoE state of :data:`MOE_SECTION` with its checks, and the bans they make."""
    experts = Experts.create(MoeSection(**MOE_SECTION, check_share=share, codec=codec), tmp_path)
    bans: list[tuple[str, str]] = []
    experts.review = build_trust(experts, lambda host, reason: bans.append((host, reason)))
    return experts, experts.review, bans


async def stored(experts, review, uid: str, body: bytes, host: str = "host") -> None:
    """What the checkpoint route does with a host's checkpoint: store it, settle the checks it can."""
    updates, tensors = payloads.read_checkpoint(body, experts.shapes)
    experts.checkpoints.save(uid, body)
    review.checkpointed(uid, updates, tensors, host)
    await asyncio.gather(*review.settling)


def rows(seed: int, n: int = 4) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 8)).astype(np.float32)


def test_which_calls_are_checked_follows_the_share_and_the_relays_secret(tmp_path: Path) -> None:
    _, review, _ = state(tmp_path / "a", 0.1)
    _, other, _ = state(tmp_path / "b", 0.1)
    ids = [f"t{i}" for i in range(20000)]
    chosen = {t for t in ids if review.chosen(t, "host")}
    assert 0.09 <= len(chosen) / len(ids) <= 0.11
    overlap = len(chosen & {t for t in ids if other.chosen(t, "host")}) / len(ids)
    assert overlap < 0.02  # another relay's secret checks other calls (independent: about 0.01)


def test_checks_agree_at_held_versions_and_wait_for_the_checkpoint_of_the_others(tmp_path: Path) -> None:
    async def run() -> None:
        experts, review, bans = state(tmp_path, 1.0)
        uid, host = "ffn0.1.0", Host("ffn0.1.0")
        await review.review("t1", uid, "forward", "host", rows(1), None, host.forward(rows(1)))
        await review.review("t2", uid, "backward", "host", rows(2), rows(3), host.backward(rows(2), rows(3)))
        assert review.status()["agreed"] == 2 and review.status()["deferred"] == 0  # version 0: the seed's
        await review.review("t3", uid, "forward", "host", rows(4), None, host.forward(rows(4)))  # version 1
        assert review.status()["pending"] == 1 and review.status()["deferred"] == 1
        await stored(experts, review, uid, host.checkpoint())  # the host's checkpoint of version 1
        assert review.status()["agreed"] == 3 and review.status()["pending"] == 0
        await review.review("t4", uid, "forward", "host", rows(5), None, host.forward(rows(5)))
        assert review.status()["agreed"] == 4 and review.status()["deferred"] == 1  # held now: at once
        host.backward(rows(6), rows(7))
        await review.review("t5", uid, "forward", "host", rows(8), None, host.forward(rows(8)))  # version 2
        host.backward(rows(9), rows(10))
        await stored(experts, review, uid, host.checkpoint())  # version 3 came first: 2 is never held
        status = review.status()
        assert status["unverifiable"] == 1 and status["pending"] == 0 and status["disagreed"] == 0, status
        assert 0.0 <= status["max_agreeing_distance"] <= 1e-6 and bans == [], status

    asyncio.run(run())


def test_a_lie_is_answered_by_the_relay_and_its_host_banned_or_found_at_its_checkpoint(tmp_path: Path) -> None:
    """A lie at a version the relay holds: its caller gets the relay's answer, which is an honest
    host's (the expert's true result), and the liar's later answers are refused (502)."""

    async def run() -> None:
        experts, review, bans = state(tmp_path, 1.0)
        assert experts.directory.lease("liar", 2) == ["ffn0.0.0", "ffn1.0.0"]
        liar, honest = Host("ffn0.0.0", lie=1.3), Host("ffn0.0.0")
        # version 0 is the relay's: checked before the caller sees it
        corrected = await review.review("t1", "ffn0.0.0", "forward", "liar", rows(1), None, liar.forward(rows(1)))
        assert corrected is not None, "the caller would have got the lie"
        metadata, tensors = payloads.decode(corrected, len(corrected))
        body = honest.forward(rows(1))
        want_metadata, want = payloads.decode(body, len(body))
        assert metadata == want_metadata and set(tensors) == set(want)
        for name in want:
            np.testing.assert_allclose(tensors[name], want[name], rtol=1e-6, atol=1e-7)
        assert review.status()["answered_by_relay"] == 1
        assert [h for h, _ in bans] == ["liar"] and "0.23" in bans[0][1]
        with pytest.raises(ApiError) as withheld:  # an answer of the banned host still on its way
            await review.review("t1b", "ffn0.0.0", "forward", "liar", rows(2), None, liar.forward(rows(2)))
        assert withheld.value.status == 502 and withheld.value.code == "bad_result"
        assert experts.directory.hosted_by("liar") == []  # its experts are orphans: the next host takes them
        with pytest.raises(ApiError) as refused:
            review.admit("liar")
        assert refused.value.status == 403 and refused.value.code == "banned"
        late = Host("ffn1.0.0", lie=1.3)  # a second liar, lying at a version the relay does not hold yet
        late.backward(rows(2), rows(3))
        await review.review("t2", "ffn1.0.0", "forward", "late", rows(4), None, late.forward(rows(4)))
        assert [h for h, _ in bans] == ["liar"]  # answered: its check waits for the checkpoint
        await stored(experts, review, "ffn1.0.0", late.checkpoint(), "late")
        assert [h for h, _ in bans] == ["liar", "late"] and "version 1" in bans[1][1]
        assert review.status()["disagreed"] == 2 and len(review.status()["bans"]) == 2

    asyncio.run(run())


def test_the_monitor_makes_a_host_returning_its_input_a_suspect_whose_calls_are_all_checked(tmp_path: Path) -> None:
    """``check_share = 0``: no call is checked at random; the monitor alone makes the liar (a
    quarter of the layer's answers) a suspect, its next call is checked, and that check bans it.
    Honest hosts' answers are never outliers enough to be suspects."""

    async def run() -> None:
        _, review, bans = state(tmp_path, 0.0)
        honest = {uid: Host(uid) for uid in ("ffn0.0.1", "ffn0.1.0", "ffn0.1.1")}
        calls = 0
        for i in range(12):
            for uid, host in honest.items():
                x = rows(100 * i + len(uid))
                await review.review(f"h{i}{uid}", uid, "forward", f"honest-{uid}", x, None, host.forward(x))
            x = rows(100 * i)
            identity = payloads.encode(payloads.encode_rows("y", x), {payloads.RESULT_VERSION: "0"})
            calls += 1
            if await review.review(f"l{i}", "ffn0.0.0", "forward", "liar", x, None, identity) is not None:
                break  # checked, caught, answered by the relay
        status = review.status()
        assert [h for h, _ in bans] == ["liar"] and status["checks"] == 1, status  # the suspect's first call
        assert calls <= 5, calls  # warm-up (8 answers: 2 rounds), then two outliers make a suspect
        assert not any(s.startswith("honest") for s in status["suspects"]), status

    asyncio.run(run())


@pytest.mark.parametrize("codec", ["none", "float16", "int8"])
def test_the_tolerance_of_the_runs_codec_passes_honest_answers_and_bans_a_scale(tmp_path: Path, codec: str) -> None:
    """Answers travel in the run's activation codec: an honest host's rounded answers (forward and
    backward) agree within fp32's tolerance plus the codec's; outputs scaled by 1.3 do not."""

    async def run() -> None:
        experts, review, bans = state(tmp_path, 1.0, codec)
        honest, liar = Host("ffn0.0.1", codec=codec), Host("ffn0.0.0", lie=1.3, codec=codec)
        for i in range(8):
            x, g = rows(2 * i, 16), rows(2 * i + 1, 16)
            await review.review(f"f{i}", "ffn0.0.1", "forward", "honest", x, None, honest.forward(x))
            await review.review(f"b{i}", "ffn0.0.1", "backward", "honest", x, g, honest.backward(x, g))
            await stored(experts, review, "ffn0.0.1", honest.checkpoint(), "honest")
        status = review.status()
        assert status["agreed"] == 16 and status["disagreed"] == 0 and bans == [], status
        assert status["max_agreeing_distance"] <= status["tolerance"] / 2, status  # a margin, measured
        assert await review.review("s", "ffn0.0.0", "forward", "liar", rows(99, 16), None, liar.forward(rows(99, 16)))
        assert [h for h, _ in bans] == ["liar"]

    asyncio.run(run())


def test_a_result_naming_a_version_older_than_its_hosts_last_checkpoint_is_stale(tmp_path: Path) -> None:
    """Every call, checked or not: a host answering from an old copy of the expert and naming the
    old version (where the relay would check it against that version's parameters) is banned once
    it took the call after storing a checkpoint of a later version; a result of a call it took
    before (its upload raced the checkpoint) is not stale."""

    async def run() -> None:
        experts, review, bans = state(tmp_path, 0.0)
        uid, trained, old = "ffn0.1.0", Host("ffn0.1.0"), Host("ffn0.1.0")
        trained.backward(rows(1), rows(2))
        before = experts.broker.clock()
        await stored(experts, review, uid, trained.checkpoint(), "host")  # version 1
        await review.review("t1", uid, "forward", "host", rows(3), None, old.forward(rows(3)), before)
        await review.review("t2", uid, "forward", "other", rows(3), None, old.forward(rows(3)), experts.broker.clock())
        assert bans == [] and review.status()["stale"] == 0
        with pytest.raises(ApiError) as withheld:
            await review.review(
                "t3", uid, "forward", "host", rows(4), None, old.forward(rows(4)), experts.broker.clock()
            )
        assert withheld.value.code == "bad_result"
        assert [h for h, _ in bans] == ["host"] and "stale copy" in bans[0][1] and review.status()["stale"] == 1

    asyncio.run(run())


@pytest.mark.parametrize("share", [1.5, -0.1, float("nan")])
def test_a_bad_check_share_is_refused_in_one_line_naming_the_field(share: float) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(None, env={}, overrides={**overrides(0), "moe": {**overrides(0)["moe"], "check_share": share}})
    assert "moe.check_share must be 0..1" in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.integration
def test_a_host_that_returns_its_input_is_banned_and_its_experts_answer_from_another_host(
    serve_relay, tmp_path: Path
) -> None:
    relay = serve_relay({**overrides(0), "moe": {**overrides(0)["moe"], "check_share": 0.25}})
    liar, honest, liar_id, liar_uids = liar_and_honest_host(relay, tmp_path, "identity")
    trainer = Member(relay.url, "trainer")
    caller = RelayExpertCaller(trainer.client, trainer.peer_id, refresh_s=0.0)
    reference = DMoEMLP(**KWARGS)
    gen = torch.Generator().manual_seed(0)
    lies_received = 0
    try:
        banned_at = None
        for round_ in range(IDENTITY_ROUNDS + 4):
            for uid in UIDS:
                x = torch.randn(4, 8, generator=gen)
                try:
                    y = caller.forward(uid, x).result(timeout=30)
                except ExpertFailed:
                    assert uid in liar_uids, f"a call to the honest host's {uid} failed"
                    continue
                expected = reference.make_expert(uid)(x).detach()
                if torch.allclose(y, x):
                    lies_received += 1
                else:
                    torch.testing.assert_close(y, expected)  # no forward trains: the fresh expert
            if trust(relay)["bans"]:
                banned_at = round_
                break
        status = trust(relay)
        assert banned_at is not None and banned_at < IDENTITY_ROUNDS, status
        assert [b["host"] for b in status["bans"]] == [liar_id], status
        assert "from the relay's own computation" in status["bans"][0]["reason"]
        assert status["disagreed"] == 1, status
        assert liar_id in status["suspects"] or status["bans"][0]["checks"] == 1, status  # the monitor, or luck
        # the checked lie reached its caller as the relay's answer: the expert's true result above
        assert status["answered_by_relay"] >= 1, status
        assert lies_received <= 2 * banned_at + 1, lies_received  # unchecked calls before the checked one
        # consequences: the liar is refused and stops; the honest host takes its experts over
        assert liar.wait(timeout=60) == 0
        assert "banned" in (tmp_path / "liar.log").read_text()
        wait_until(lambda: len(directory(relay.url)["live"]) == 8, 60, "the honest host to take the orphans")
        for uid in liar_uids:
            x = torch.randn(3, 8, generator=gen)
            torch.testing.assert_close(
                caller.forward(uid, x).result(timeout=30), reference.make_expert(uid)(x).detach()
            )
        # the honest host's checked calls agree: which calls are checked is the relay's secret, so
        # before the ban it may have had none; calls go on until one was (0.75 ** 96 odds of none)
        for _ in range(12):
            if trust(relay)["agreed"] >= 1:
                break
            for uid in UIDS:
                x = torch.randn(3, 8, generator=gen)
                torch.testing.assert_close(
                    caller.forward(uid, x).result(timeout=30), reference.make_expert(uid)(x).detach()
                )
        after = trust(relay)
        assert after["agreed"] >= 1 and after["disagreed"] == 1, after
        assert after["bans"] == status["bans"]  # the honest host is never banned
        wait_until(lambda: observed(relay)["bans"] == status["bans"], 10, "GET /api/status to show the ban")
    finally:
        caller.close()
        trainer.close()
        stop([liar, honest])


@pytest.mark.integration
def test_a_host_that_scales_its_outputs_after_training_is_caught_from_its_checkpoint(
    serve_relay, tmp_path: Path
) -> None:
    relay = serve_relay({**overrides(0), "moe": {**overrides(0)["moe"], "check_share": 1.0}})
    liar, honest, liar_id, liar_uids = liar_and_honest_host(relay, tmp_path, "scale", "--from-version", "1")
    trainer = Member(relay.url, "trainer")
    caller = RelayExpertCaller(trainer.client, trainer.peer_id, refresh_s=0.0)
    experts = {uid: DMoEMLP(**KWARGS).make_expert(uid) for uid in UIDS}
    gen = torch.Generator().manual_seed(1)
    try:
        with LoopbackCaller(experts, optimizer_factory=lambda m: torch.optim.SGD(m.parameters(), lr=LR)) as local:
            for uid in UIDS:  # version 0: every host honest; one backward: every expert one SGD step
                x, g = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
                torch.testing.assert_close(caller.forward(uid, x).result(timeout=30), local.forward(uid, x).result())
                torch.testing.assert_close(
                    caller.backward(uid, x, g).result(timeout=30), local.backward(uid, x, g).result()
                )
            assert trust(relay)["disagreed"] == 0
            started, lies = time.monotonic(), 0
            while not trust(relay)["bans"] and time.monotonic() - started < SCALE_SECONDS:
                for uid in liar_uids:  # version 1: the liar scales every output now
                    x = torch.randn(4, 8, generator=gen)
                    try:
                        y = caller.forward(uid, x).result(timeout=30)
                    except ExpertFailed:
                        continue  # an open call of the liar's when it was banned
                    truth = local.forward(uid, x).result()
                    if torch.allclose(y, truth):  # checked at once (the checkpoint was there): the relay's
                        continue
                    torch.testing.assert_close(y, 1.3 * truth)
                    lies += 1
                time.sleep(0.2)
            status = trust(relay)
            assert [b["host"] for b in status["bans"]] == [liar_id], status
            assert "version 1" in status["bans"][0]["reason"], status
            assert status["disagreed"] >= 1 and status["agreed"] >= 16, status  # the 16 calls at version 0
            assert liar.wait(timeout=60) == 0
            # its experts resume on the honest host from their last checkpoint, as after a host that
            # died (at most one checkpoint period of training lost): the liar trained honestly, so
            # that checkpoint is the expert after its step, or before it when the ban came first
            wait_until(lambda: len(directory(relay.url)["live"]) == 8, 60, "the honest host to take the orphans")
            for uid in liar_uids:
                stored = latest_checkpoint(relay.data_dir, uid)
                resumed = DMoEMLP(**KWARGS).make_expert(uid)
                with torch.no_grad():
                    for name, p in resumed.named_parameters():
                        p.copy_(torch.from_numpy(stored[f"p.{name}"]))
                versions = [
                    dict(experts[uid].named_parameters()),
                    dict(DMoEMLP(**KWARGS).make_expert(uid).named_parameters()),
                ]
                assert any(
                    all(torch.allclose(p, v[name]) for name, p in resumed.named_parameters()) for v in versions
                ), uid
                x = torch.randn(3, 8, generator=gen)
                torch.testing.assert_close(caller.forward(uid, x).result(timeout=30), resumed(x).detach())
        assert trust(relay)["bans"] == status["bans"]
    finally:
        caller.close()
        trainer.close()
        stop([liar, honest])


@pytest.mark.integration
def test_an_honest_run_with_every_call_checked_bans_nobody_and_equals_one_process(serve_relay, tmp_path: Path) -> None:
    steps = 12
    relay = serve_relay({**overrides(steps), "moe": {**overrides(steps)["moe"], "check_share": 1.0}})
    initial, _ = train_with_two_hosts(relay.url, steps, tmp_path)
    status = trust(relay)
    assert status["bans"] == [] and status["disagreed"] == 0, status
    assert status["checks"] > 0 and status["agreed"] > 0, status
    assert status["max_agreeing_distance"] <= status["tolerance"], status
    assert status["monitored"] >= status["checks"], status
    reference, _ = one_process_reference(initial, steps)
    _, final = relay_params(relay.url, min_step=steps)
    np.testing.assert_allclose(final, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.integration
def test_a_hand_written_liar_on_a_login_run_is_refused_unversioned_results_and_its_user_banned(
    serve_relay, hf_standin
) -> None:
    """hf mode, every call checked: a host's result that names no version is refused (422
    ``no_version``: it could never be checked) and its call fails; a lie at version 0 reaches the
    trainer as the relay's own answer (the expert's true result) and puts the host's user on the
    relay's ban list, where an organizer sees it (``GET /api/admin/bans``): every peer of the user leaves, and its next request is refused."""
    from relay_server.api.moderation import TOKEN_FILE
    from toolkit.errors import RelayRejected

    BINARY = {"Content-Type": "application/octet-stream"}  # a signed run's tensor bodies say what they are
    hf_standin.add_user("hf_liar_token_1234567", "lying-volunteer")
    hf_standin.add_user("hf_trainer_token_12345", "training-volunteer")
    relay = serve_relay(
        {
            **overrides(0),
            "moe": {**overrides(0)["moe"], "check_share": 1.0},
            "auth": {
                "mode": "hf",
                "hf_endpoint": hf_standin.url,
                "allow_users": ["lying-volunteer", "training-volunteer"],
            },
        }
    )
    mallory = Member(relay.url, "mallory", token="hf_liar_token_1234567")
    alice = Member(relay.url, "alice", token="hf_trainer_token_12345")
    caller = RelayExpertCaller(alice.client, alice.peer_id)
    try:
        assert len(mallory.request("POST", "moe_lease", params={"capacity": 8}).json()["uids"]) == 8
        x = torch.randn(3, 8)

        def next_task():
            for _ in range(50):
                response = mallory.request("GET", "moe_tasks", params={"wait": 1})
                if response.status_code == 200:
                    return payloads.read_task_batch(response.content, 1 << 20, 8)[0][0]
            raise TimeoutError("no task reached the host")

        call = caller.forward("ffn0.0.0", x)
        with pytest.raises(RelayRejected) as unversioned:
            mallory.request(
                "PUT",
                "moe_result",
                task_id=next_task().task_id,
                data=payloads.encode({"y": x.numpy()}),
                headers=BINARY,
            )
        assert (unversioned.value.status, unversioned.value.code) == (422, "no_version")
        with pytest.raises(ExpertFailed):
            call.result(timeout=30)
        assert trust(relay)["checks"] == 0 and trust(relay)["bans"] == []

        call = caller.forward("ffn0.0.0", x)
        identity = payloads.encode({"y": x.numpy()}, {payloads.RESULT_VERSION: "0"})
        mallory.request(
            "PUT", "moe_result", task_id=next_task().task_id, data=identity, headers=BINARY
        )  # acked like any
        answered = call.result(timeout=30)  # the relay's answer: the fresh expert's, not the input back
        torch.testing.assert_close(answered, DMoEMLP(**KWARGS).make_expert("ffn0.0.0")(x).detach())
        assert not torch.allclose(answered, x)
        status = trust(relay)
        assert [b["host"] for b in status["bans"]] == [mallory.peer_id] and status["disagreed"] == 1, status
        admin = (relay.data_dir / TOKEN_FILE).read_text().strip()
        bans = requests.get(
            relay.url + "/api/admin/bans", headers={"Authorization": f"Bearer {admin}"}, timeout=10
        ).json()["bans"]
        assert [b["username"] for b in bans] == ["lying-volunteer"] and "spot check" in bans[0]["reason"]
        assert "mallory" not in {p["name"] for p in relay.status()["peers"]}
        with pytest.raises(RelayRejected) as refused:
            mallory.request("GET", "moe_tasks", params={"wait": 0})
        assert refused.value.status in (401, 403), refused.value
    finally:
        caller.close()
        for member in (mallory, alice):
            member.close()
