"""A stalled event loop costs the relay time, never answers (issue 35).

* the relay's clock (:mod:`relay_server.core.loop_clock`) stops while its loop does not listen,
  so a task whose result waited unread in a socket during a stall still meets its deadline, and
  a wait past a deadline ends in ``task_timeout`` (the answer callers know), never a raise;
* stalls are reported in one warning line a minute (count, worst, total), on the fake clock;
* end to end: a DMoE run and a pipeline run through a real relay process whose loop blocks 3 s
  now and then (the test-only hook of :mod:`relay_server.api.stall_hook`): no failed expert call,
  no lease lost to a stall, no unhandled error in the relay log, and both runs stay exact.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
from pathlib import Path

import numpy as np
import pytest
import requests
import torch

from relay_server.api.stall_hook import ENV, parse, stall_middlewares
from relay_server.core.loop_clock import LoopClock, StallReport
from relay_server.core.typed import ConfigError
from relay_server.harness.process import RelayProcess
from relay_server.moe.feature import EXPERTS
from relay_server.tasks.broker import DONE, FAILED
from tests.support.clock import Clock
from tests.support.moe import MOE, Member, one_process_reference, overrides, train_with_two_hosts
from tests.support.pipeline import accepted_batches, pipeline_overrides, relative_difference, replay
from tests.support.pipeline_models import BYTE_SPEC
from tests.support.processes import merged, write_config
from tests.support.tasks import broker, run, submit
from tests.support.training import relay_params
from toolkit.client import RelayClient
from toolkit.errors import RelayRejected
from toolkit.models import build_model
from toolkit.optimizer import CollaborativeOptimizer
from toolkit.wire import payloads
from toolkit.wire.protocol import ModelSpec

STALL_S = 3.0


# --- the relay's clock ------------------------------------------------------------------------------
def test_the_relay_clock_stops_during_a_stall_and_never_goes_back() -> None:
    wall = Clock(100.0)
    clock = LoopClock(wall, grace_s=0.5)
    stalls: list[float] = []
    clock.on_stall.append(stalls.append)
    wall.now += 0.1
    assert clock.beat() == 0.0 and clock() == pytest.approx(100.1)  # listening: the monotonic clock
    wall.now += STALL_S  # no beat: the loop is blocked
    assert clock() == pytest.approx(100.6)  # read before the stall is noticed: already stopped
    assert clock.beat() == pytest.approx(STALL_S - 0.5) and stalls == [pytest.approx(STALL_S - 0.5)]
    assert clock() == pytest.approx(100.6)  # and it resumes from there, continuous
    wall.now += 0.1
    assert clock() == pytest.approx(100.7) and clock.stalled_s == pytest.approx(STALL_S - 0.5)


def test_a_result_that_waited_out_a_stall_meets_its_deadline(tmp_path: Path) -> None:
    """A 2 s task, a 3 s stall with its result unread: on the wall clock its deadline passed, on
    the relay's it did not; the tick after the stall fails nothing and the result is accepted."""

    async def scenario() -> None:
        wall = Clock(1000.0)
        b = broker(tmp_path, clock=LoopClock(wall))
        task = submit(b, "c1", timeout_s=2.0)
        waiter = asyncio.create_task(b.wait(task))
        assert await b.lease("host", ["e.0"], max_rows=64, wait_s=0) == [task]
        wall.now += STALL_S  # the host answered during the stall; the relay reads it after
        b.tick()  # timers fire before the socket is read
        assert task.state != FAILED
        b.complete("host", task.task_id, b"result")
        assert (await waiter).state == DONE and b.result(task) == b"result"

    run(scenario())


def test_a_wait_past_its_deadline_answers_task_timeout_and_never_raises(tmp_path: Path) -> None:
    async def scenario() -> None:
        wall = Clock(1000.0)
        b = broker(tmp_path, clock=wall)
        task = submit(b, "c1", timeout_s=0.01)
        waiter = asyncio.create_task(b.wait(task))
        await asyncio.sleep(0)
        wall.now += 1.0  # past the deadline, and no tick ran
        done = await asyncio.wait_for(waiter, 5)  # (a bound for a broken wait, not a timing claim)
        assert done.state == FAILED and done.error.code == "task_timeout" and done.error.status == 504

    run(scenario())


def test_stalls_are_reported_in_one_line_a_minute_with_their_count_and_the_worst(caplog) -> None:
    wall = Clock(0.0)
    clock = LoopClock(wall, grace_s=0.5, report=StallReport(wall, every_s=60.0))
    caplog.set_level(logging.WARNING, logger="relay_server.core.loop_clock")

    def listen(seconds: float) -> None:  # the loop listens: beats every 0.1 s
        for _ in range(round(seconds / 0.1)):
            wall.now += 0.1
            clock.beat()

    def stall(seconds: float) -> None:
        wall.now += seconds
        clock.beat()
        listen(1.0)

    stall(2.0)  # the first stall is reported at once
    for seconds in (1.5, 6.0, 1.0):
        stall(seconds)
    assert len(caplog.records) == 1 and "stalled 1 time " in caplog.records[0].getMessage()
    listen(60.0 - (wall.now - 2.0))  # a minute after the first line: one line for the three since
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "stalled 3 times" in lines[1] and "worst 6.0 s" in lines[1], lines
    listen(200.0)  # no stall since: no line
    assert len(caplog.records) == 2
    stall(2.0)  # reported at once (a minute since the last line) ...
    stall(4.0)
    assert len(caplog.records) == 3
    clock.report.flush(final=True)  # ... and the one since, when the relay stops
    assert len(caplog.records) == 4 and "stalled 1 time " in caplog.records[3].getMessage()
    assert "worst 4.0 s" in caplog.records[3].getMessage()


def test_the_stall_hook_is_off_unless_the_process_environment_sets_it() -> None:
    assert stall_middlewares({}) == []
    assert len(stall_middlewares({ENV: "seconds=3,every=40"})) == 1
    assert parse("seconds=3,every=40,times=2,path=/api/moe/").path == "/api/moe/"
    for bad, field in [
        ("seconds=3", "every"),
        ("seconds=x,every=2", "number"),
        ("speed=3,every=2", "speed"),
        ("seconds=0,every=2", "seconds"),
        ("seconds=1,every=2,path=(", "regular"),
    ]:
        with pytest.raises(ConfigError, match=field):
            parse(bad)


def test_a_call_past_its_deadline_is_answered_once_not_retried(serve_relay) -> None:
    """``task_timeout`` (504) is the relay's answer about that call: the trainer's client takes it
    at once (a failed expert). Asking again with the same call id finds the same failed task, so
    the 4 retries the client gave any 504 only added seconds of backoff to every timed-out call."""
    config = overrides(0)
    config["moe"] = {**MOE, "forward_timeout_s": 0.5}
    relay = serve_relay(config)
    host, trainer = Member(relay.url, "silent-host"), Member(relay.url, "trainer")
    client = RelayClient(relay.url)  # a trainer's retries
    try:
        host.request("POST", "moe_lease", params={"capacity": 8})  # leased, never answered
        with pytest.raises(RelayRejected) as refused:
            client.moe.call(
                trainer.peer_id,
                "ffn0.0.0",
                kind="forward",
                call_id="c1",
                body=payloads.call_body(np.zeros((2, 8), np.float32)),
            )
        assert (refused.value.status, refused.value.code) == (504, "task_timeout")
        assert relay.call(lambda: len(relay.app[EXPERTS].calls)) == 1  # calls the relay answered
    finally:
        client.close()
        host.close()
        trainer.close()


# --- end to end ---------------------------------------------------------------------------------------
def stalled_relay(tmp_path: Path, config: dict, stall: str) -> RelayProcess:
    """A real relay process whose event loop blocks as ``stall`` says (the test-only hook)."""
    path = write_config(tmp_path / "relay.toml", merged(config))
    return RelayProcess(path, tmp_path / "relay-data", tmp_path / "relay.log", env={ENV: stall}).start()


def check_log(relay: RelayProcess, stalls: int) -> None:
    text = relay.log_path.read_text()
    assert text.count("test hook: blocking the event loop") == stalls, text[-3000:]
    assert "unhandled error" not in text and "Traceback" not in text, text[-3000:]
    assert "event loop stalled" in text, text[-3000:]  # the report saw them


@pytest.mark.integration
def test_a_gradient_that_waited_out_a_stall_still_makes_its_round(tmp_path: Path) -> None:
    """A round with a 2 s window and the relay's loop blocked 3 s as the gradient arrives: on the
    wall clock the window closed before the upload was read; on the relay's clock it did not. The
    round closes because everyone arrived, with the gradient in it."""
    config = {
        "run": {"target_batch": 4, "max_staleness": 1},
        "rounds": {"deadline_floor_s": 2.0, "deadline_initial_s": 2.0, "peer_ttl_s": 30.0},
        "optimizer": {"name": "sgd", "lr": 0.01, "weight_decay": 0.0, "schedule": "constant"},
    }
    relay = stalled_relay(tmp_path, config, f"seconds={STALL_S},every=1,times=1,path=/gradient$")
    try:
        model = build_model(ModelSpec(factory="toolkit.models:MLP", kwargs={"sizes": [8, 16, 1]}))
        with CollaborativeOptimizer(model, relay.url, batch_size_per_step=4, report_interval_s=0.0) as opt:
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
            loss = model.loss(torch.cat([x, x.sum(1, keepdim=True).tanh()], dim=1))
            loss.backward()
            opt.step(loss=loss.item())  # reports, the round opens, the upload is stalled, then read
            assert opt.contributed_samples == 4 and opt.version == 1 and opt.last_error is None
        [first] = relay.status()["recent_rounds"][:1]
    finally:
        relay.stop()
    check_log(relay, stalls=1)
    assert first["step"] == 1 and first["finalized_by"] == "all_arrived", first


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_dmoe_run_through_a_stalling_relay_fails_no_call_and_stays_exact(tmp_path: Path) -> None:
    """Expert calls with 2 s deadlines, the relay's loop blocked 3 s in the middle of calls: on
    the wall clock every call in flight missed its deadline; on the relay's clock none did."""
    steps = 12
    config = overrides(steps)
    config["moe"] = {**MOE, "forward_timeout_s": 2.0, "backward_timeout_s": 2.0}
    relay = stalled_relay(tmp_path, config, f"seconds={STALL_S},every=50,times=3,path=/calls/")
    try:
        initial, _ = train_with_two_hosts(relay.url, steps, tmp_path)
        _, final = relay_params(relay.url, min_step=steps)
    finally:
        relay.stop()
    check_log(relay, stalls=3)
    reference, _ = one_process_reference(initial, steps)
    np.testing.assert_allclose(final, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_a_pipeline_run_through_a_stalling_relay_loses_no_lease_to_a_stall_and_stays_exact(
    tmp_path: Path, launch_stage_worker
) -> None:
    """Leases of 3 s (``max(floor, 1 x measured)``, and before a measurement: these tasks take milliseconds, a loaded test
    machine's a second or two), the loop blocked 5 s while workers hold leases: no lease expires
    for the stall (one that does shows an age of 5 s or more; a slow worker's lease expires at its
    3 s deadline plus a tick), no call ends in an unhandled error, the run is exact. No
    rebalancing: a move re-dispatches what the moved worker was leased, stall or not."""
    steps, microbatches, stall_s = 4, 4, 5.0
    config = pipeline_overrides(
        BYTE_SPEC,
        stages=2,
        microbatches=microbatches,
        lease_floor_s=3.0,
        lease_factor=1.0,
        initial_lease_s=3.0,
        rebalance_every_batches=0,
    )
    relay = stalled_relay(tmp_path, config, f"seconds={stall_s},every=12,times=3,path=/work$")
    try:
        _, initial = relay_params(relay.url)
        workers = [launch_stage_worker(relay.url, f"w{i}", seed=i, until_step=steps) for i in range(4)]
        for worker in workers:
            assert worker.wait(timeout_s=240) in (0, -signal.SIGKILL), worker.log_path.read_text()[-3000:]
        step, final = relay_params(relay.url, min_step=steps)
        pipeline = requests.get(relay.url + "/api/pipeline", timeout=10).json()
    finally:
        relay.stop()
    check_log(relay, stalls=3)
    ages = [float(age) for age in re.findall(r"expired after ([0-9.]+) s", relay.log_path.read_text())]
    assert all(age < stall_s for age in ages), f"leases expired by a stall (ages on the relay's clock): {ages}"
    assert pipeline["counted"][-steps:] == [[2 * microbatches] * 2] * steps
    reference = replay(BYTE_SPEC, initial, accepted_batches(workers), steps=step, microbatches=microbatches)
    assert relative_difference(final, reference) <= 1e-5
