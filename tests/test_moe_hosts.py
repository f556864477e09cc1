"""Expert hosts as Learning@home's runtime runs them, through a real relay and real host processes:

* batching: the calls queued for an expert run as one forward or one backward (one optimizer
  step on the summed gradient), each caller's answer exactly its call's;
* recovery: a host cut off past the peer TTL, or whose relay restarts, comes back and serves
  without a restart, its panel line saying what it waits for meanwhile;
* the batching benchmark's figure (slow).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from relay_server.harness.process import wait_until
from tests.support.moe import KWARGS, LR, Member, directory, latest_checkpoint, overrides, start_host, stop
from tests.support.processes import REPO
from toolkit.models import DMoEMLP
from toolkit.moe.calls import ExpertFailed
from toolkit.moe.remote import RelayExpertCaller


def test_a_host_runs_queued_calls_as_one_batch_and_each_call_gets_its_own_exact_answer(
    serve_relay, tmp_path: Path
) -> None:
    """Calls queued for one expert while its host is paused (SIGSTOP) reach it in one lease: 8
    forwards from 4 callers run as ONE forward, then 6 backwards as ONE backward and ONE SGD step
    on the summed gradient. Each call's answer equals that call computed alone at the parameters
    the batch ran at, and the expert's next checkpoint is one step on the sum of the per-call
    parameter gradients (to 1e-5)."""
    from relay_server.moe.feature import EXPERTS

    uid = "ffn0.1.0"
    relay = serve_relay({**overrides(0), "rounds": {"peer_ttl_s": 120.0}})  # paused hosts stay registered
    host = start_host(relay.url, "host", 8, tmp_path / "host.log")
    members = [Member(relay.url, f"trainer{i}") for i in range(4)]
    callers = [RelayExpertCaller(m.client, m.peer_id) for m in members]
    broker = relay.app[EXPERTS].broker

    def no_poll_for(seconds: float):
        """True once the host has had no poll waiting for ``seconds``: a poll it sent just before
        SIGSTOP may reach the relay after one empty look, and would take the calls queued next."""
        since: list[float | None] = [None]

        def check() -> bool:
            if relay.call(lambda: broker._waiters.waiting(uid)) != 0:
                since[0] = None
                return False
            since[0] = since[0] if since[0] is not None else time.monotonic()
            return time.monotonic() - since[0] >= seconds

        return check

    def queued_while_paused(send) -> list:
        """Pause the host, wait until its long poll ended, queue the calls, then let it go."""
        host.send_signal(signal.SIGSTOP)
        try:
            wait_until(no_poll_for(0.5), 30, "the host's poll to end")
            futures = send()
            rows = sum(int(f[1].shape[0]) for f in futures)
            wait_until(lambda: relay.call(lambda: broker.queued_rows(uid)) == rows, 30, "every call queued")
        finally:
            host.send_signal(signal.SIGCONT)
        return futures

    try:
        wait_until(lambda: len(callers[0].live()) == 8, 60, "the host's experts")
        gen = torch.Generator().manual_seed(3)
        expert = DMoEMLP(**KWARGS).make_expert(uid)
        forwards = queued_while_paused(
            lambda: [
                (callers[i % 4].forward(uid, x), x)
                for i, x in enumerate(torch.randn(i + 1, 8, generator=gen) for i in range(8))
            ]
        )
        for future, x in forwards:
            torch.testing.assert_close(future.result(timeout=60), expert(x).detach(), rtol=1e-5, atol=1e-6)

        calls = [(torch.randn(i + 2, 8, generator=gen), torch.randn(i + 2, 8, generator=gen)) for i in range(6)]
        backwards = queued_while_paused(
            lambda: [(callers[i % 4].backward(uid, x, g), x, g) for i, (x, g) in enumerate(calls)]
        )
        summed = {name: torch.zeros_like(p) for name, p in expert.named_parameters()}
        for future, x, g in backwards:  # each call alone at the parameters the batch ran at
            expert.zero_grad()
            x_alone = x.clone().requires_grad_(True)
            expert(x_alone).backward(g)
            torch.testing.assert_close(future.result(timeout=60), x_alone.grad, rtol=1e-5, atol=1e-6)
            for name, p in expert.named_parameters():
                summed[name] += p.grad
    finally:
        for caller, member in zip(callers, members):
            caller.close()
            member.close()
        stop([host])  # its final checkpoint
    stored = latest_checkpoint(relay.data_dir, uid)
    for name, p in expert.named_parameters():  # one SGD step on the summed gradient
        np.testing.assert_allclose(
            stored[f"p.{name}"], (p - LR * summed[name]).detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=name
        )
    log = (tmp_path / "host.log").read_text()
    assert f"ran 8 forward calls of {uid} (36 rows) as one batch" in log, log[-3000:]
    assert f"ran 6 backward calls of {uid} (27 rows) as one batch" in log, log[-3000:]


def test_a_host_cut_off_for_twice_the_ttl_comes_back_and_serves_without_a_restart(serve_relay, tmp_path: Path) -> None:
    """The host reaches the relay through a proxy that cuts it off until the relay has expired it
    and a second TTL has passed: its experts are orphaned and their calls fail meanwhile. When the
    link is back the same host process (never restarted, never exiting) is re-admitted under its
    peer id, leases its experts again, keeps the copies it holds (no host trained them since)
    and answers calls exactly."""
    from tests.support.blip import BlipProxy

    relay = serve_relay(overrides(0))
    ttl = relay.config.rounds.peer_ttl_s
    proxy = BlipProxy(relay.port)
    host = start_host(proxy.url, "host", 8, tmp_path / "host.log")
    trainer = Member(relay.url, "trainer")
    caller = RelayExpertCaller(trainer.client, trainer.peer_id, refresh_s=0.0)
    expert = DMoEMLP(**KWARGS).make_expert("ffn1.1.0")
    x = torch.randn(5, 8)
    try:
        wait_until(lambda: len(caller.live()) == 8, 60, "the host's experts")
        torch.testing.assert_close(caller.forward("ffn1.1.0", x).result(timeout=30), expert(x).detach())
        proxy.drop()
        wait_until(lambda: caller.live() == frozenset(), 30, "the relay to expire the cut-off host")
        with pytest.raises(ExpertFailed):
            caller.forward("ffn1.1.0", x).result(timeout=30)  # its expert has no host now
        wait_until(lambda: "host" not in {p["name"] for p in relay.status()["peers"]}, 30, "the host to leave")
        threading.Event().wait(ttl)  # cut off for a second TTL (not an assertion: the blip's length)
        assert host.poll() is None, "the host exited during the blip"
        proxy.restore()
        wait_until(lambda: len(caller.live()) == 8, 60, "the same host to lease its experts again")
        torch.testing.assert_close(caller.forward("ffn1.1.0", x).result(timeout=30), expert(x).detach())
        assert host.poll() is None
        assert [p["name"] for p in relay.status()["peers"]].count("host") == 1
    finally:
        caller.close()
        trainer.close()
        proxy.restore()
        stop([host])
        proxy.close()
    log = (tmp_path / "host.log").read_text()
    # the lease that follows the blip or the poll's 409 no_lease, whichever comes first, re-leases
    assert "ffn1.1.0 leased again; kept this host's copy" in log, log[-3000:]


@pytest.mark.slow  # 34 s; re-admission after a blip is the default test above
def test_hosts_outlive_a_relay_restart_each_taking_back_its_own_experts(start_relay, tmp_path: Path) -> None:
    """The relay is SIGKILLed and started again on its port and data dir while host0 is paused:
    host1, back first, leases again and takes back its own 4 experts (not host0's, the first in
    the relay's order), then host0 its own; each keeps its copies, nothing is dropped, calls are
    answered exactly, no host restarts. Then again with the data dir gone: the relay does not
    know the peer ids (404 unknown_peer) and the hosts join again."""
    relay = start_relay({**overrides(0), "rounds": {"peer_ttl_s": 15.0}})  # what expires is the relay, not a host
    logs = [tmp_path / "host0.log", tmp_path / "host1.log"]
    hosts = [start_host(relay.url, "host0", 4, logs[0])]
    wait_until(lambda: len(directory(relay.url)["live"]) == 4, 60, "host0's experts")
    hosts.append(start_host(relay.url, "host1", 4, logs[1]))
    wait_until(lambda: len(directory(relay.url)["live"]) == 8, 60, "host1's experts")
    x = torch.randn(3, 8)

    def hosting(log: Path) -> list[set[str]]:
        return [
            set(line.split(": ")[-1].split()) for line in log.read_text().splitlines() if "hosting 4 experts" in line
        ]

    def answers_exactly() -> None:
        trainer = Member(relay.url, "trainer")
        caller = RelayExpertCaller(trainer.client, trainer.peer_id)
        try:
            for uid in (min(hosting(logs[0])[0]), min(hosting(logs[1])[0])):
                expert = DMoEMLP(**KWARGS).make_expert(uid)
                torch.testing.assert_close(caller.forward(uid, x).result(timeout=30), expert(x).detach())
        finally:
            caller.close()
            trainer.close()

    try:
        wait_until(lambda: all(hosting(log) for log in logs), 30, "both hosts to log their experts")
        answers_exactly()
        first = [hosting(log)[0] for log in logs]
        hosts[0].send_signal(signal.SIGSTOP)
        relay.kill()
        relay.start()
        wait_until(lambda: len(directory(relay.url)["live"]) == 4, 60, "host1 to lease again")
        hosts[0].send_signal(signal.SIGCONT)
        wait_until(lambda: all(len(hosting(log)) == 2 for log in logs), 60, "host0 to lease again")
        assert [hosting(log)[-1] for log in logs] == first  # each took back its own experts
        answers_exactly()

        relay.kill()  # a relay that lost its data dir: it never knew these peer ids
        shutil.rmtree(relay.data_dir)
        relay.start()
        wait_until(lambda: len(directory(relay.url)["live"]) == 8, 60, "the hosts to join and lease again")
        answers_exactly()
        assert all(host.poll() is None for host in hosts), "a host exited"
    finally:
        hosts[0].send_signal(signal.SIGCONT)
        stop(hosts)
    for log in logs:
        text = log.read_text()
        assert "no longer leased here" not in text and "leased again; kept this host's copy" in text, text[-3000:]
        assert "the relay no longer knows this host; joining again" in text, text[-3000:]


def test_a_host_panel_says_what_it_waits_for_and_when_it_serves_again(serve_relay) -> None:
    """describe() (the panel's "you host" line) names what the host waits for while the relay
    is out of reach, and drops it once the host serves again."""
    from tests.support.blip import BlipProxy
    from toolkit.moe.host import ExpertHost

    relay = serve_relay(overrides(0))
    proxy = BlipProxy(relay.port)
    host = ExpertHost(proxy.url, capacity=2, name="panel-host", device="cpu")
    lines: list[str] = []
    worker = threading.Thread(target=host.run, kwargs={"on_progress": lambda h: lines.append(h.describe())})
    worker.start()
    try:
        wait_until(lambda: len(directory(relay.url)["live"]) == 2, 60, "the host's 2 experts")
        proxy.drop()
        wait_until(
            lambda: any("waiting for the relay (unreachable" in line for line in lines),
            60,
            "the panel to say the host waits for the relay",
        )
        seen = len(lines)
        proxy.restore()
        wait_until(
            lambda: any(
                "waiting" not in line and "retrying" not in line and "leasing" not in line for line in lines[seen:]
            ),
            60,
            "the panel to show the host serving again",
        )
        assert worker.is_alive()
    finally:
        proxy.restore()
        host.stop()
        worker.join(60)
        proxy.close()
    assert lines[-1].startswith("2 experts ("), lines[-1]


@pytest.mark.integration
@pytest.mark.slow
def test_host_batching_benchmark_reports_its_gain() -> None:
    """benchmarks/moe_batching.py (shortened): its last line is the JSON docs/benchmarks.md quotes, and
    batching serves more tasks per second than one call at a time with 8 callers."""
    done = subprocess.run(
        [sys.executable, "benchmarks/moe_batching.py", "--seconds", "6", "--warmup", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figure = json.loads(done.stdout.strip().splitlines()[-1])
    assert figure["callers"] == 8 and figure["failed"] == {"unbatched": 0, "batched": 0}, figure
    assert figure["calls_per_batch"] > 1 and figure["ratio"] > 1, figure
