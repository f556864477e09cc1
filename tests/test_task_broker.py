"""The relay's task broker on its own (no HTTP): what DMoE's expert calls and the staged pipeline's
micro-batch pool both rely on. The HTTP routes over it are tested through a real relay in
tests/test_moe_relay.py; the micro-batch pool's leasing rules in tests/test_task_pool.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from relay_server.core.errors import ApiError
from relay_server.tasks.broker import DONE, FAILED, LEASED, QUEUED, WAITING
from tests.support.clock import Clock
from tests.support.tasks import broker, run, submit


def test_a_call_goes_to_a_worker_and_its_result_back_to_the_caller(tmp_path: Path) -> None:
    async def scenario() -> None:
        b = broker(tmp_path)
        task = submit(b, "c1")
        waiter = asyncio.create_task(b.wait(task))
        [leased] = await b.lease("host", ["e.0"], max_rows=64, wait_s=1)
        assert leased is task and task.state == LEASED and b.payload(task) == b"c1c1c1"
        b.complete("host", task.task_id, b"result")
        assert (await waiter).state == DONE and b.result(task) == b"result"

    run(scenario())


def test_a_worker_long_polls_until_a_task_arrives(tmp_path: Path) -> None:
    async def scenario() -> None:
        b = broker(tmp_path)
        polling = asyncio.create_task(b.lease("host", ["e.0"], max_rows=64, wait_s=5))
        await asyncio.sleep(0.05)
        assert not polling.done()
        task = submit(b, "c1")
        assert await asyncio.wait_for(polling, 2) == [task]
        assert await b.lease("host", ["e.1"], max_rows=64, wait_s=0) == []  # other keys: nothing

    run(scenario())


def test_a_retried_call_id_finds_the_same_task_and_a_reused_one_is_refused(tmp_path: Path) -> None:
    async def scenario() -> None:
        b = broker(tmp_path)
        first = submit(b, "c1")
        assert submit(b, "c1") is first  # the caller's connection broke: same task, computed once
        assert submit(b, "c1", caller="bob") is not first  # call ids are per caller
        with pytest.raises(ApiError) as reused:
            submit(b, "c1", key="e.9")
        assert reused.value.code == "call_id_reused" and reused.value.status == 409

    run(scenario())


def test_a_full_key_refuses_at_once_with_429(tmp_path: Path) -> None:
    async def scenario() -> None:
        b = broker(tmp_path, max_queued_rows=8)
        submit(b, "c1", rows=4)
        submit(b, "c2", rows=4)
        with pytest.raises(ApiError) as busy:
            submit(b, "c3", rows=1)
        assert (busy.value.status, busy.value.code) == (429, "queue_busy")
        submit(b, "c4", key="e.1", rows=8)  # another key has its own budget
        await b.lease("host", ["e.0"], max_rows=4, wait_s=0)
        submit(b, "c5", rows=4)  # leased rows left the queue

    run(scenario())


def test_lease_takes_oldest_first_up_to_max_rows(tmp_path: Path) -> None:
    async def scenario() -> None:
        b = broker(tmp_path)
        tasks = [submit(b, f"c{i}", key=f"e.{i % 2}", rows=3) for i in range(5)]
        got = await b.lease("host", ["e.0", "e.1"], max_rows=7, wait_s=0)
        assert got == tasks[:2]  # 3 + 3 rows; a third would pass 7
        got = await b.lease("host", ["e.0", "e.1"], max_rows=1, wait_s=0)
        assert got == [tasks[2]]  # always at least one task, even above max_rows

    run(scenario())


def test_deadlines_fail_tasks_and_late_results_are_refused(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = Clock(1000.0)
        b = broker(tmp_path, clock)
        queued, leased = submit(b, "c1", timeout_s=1), submit(b, "c2", key="e.1", timeout_s=1)
        await b.lease("host", ["e.1"], max_rows=64, wait_s=0)
        clock.now += 2
        b.tick()
        for task in (queued, leased):
            assert task.state == FAILED and task.error.code == "task_timeout" and task.error.status == 504
        with pytest.raises(ApiError) as late:
            b.complete("host", leased.task_id, b"late")
        assert late.value.code == "task_expired"
        assert b.queued_rows("e.0") == 0

    run(scenario())


def test_only_the_leaseholder_completes_a_task(tmp_path: Path) -> None:
    async def scenario() -> None:
        b = broker(tmp_path)
        task = submit(b, "c1")
        with pytest.raises(ApiError) as unleased:
            b.complete("host", task.task_id, b"x")
        assert unleased.value.code == "not_your_task"
        await b.lease("host", ["e.0"], max_rows=64, wait_s=0)
        with pytest.raises(ApiError) as other:
            b.complete("mallory", task.task_id, b"x")
        assert other.value.code == "not_your_task" and task.state == LEASED
        b.complete("host", task.task_id, b"x")
        with pytest.raises(ApiError):
            b.complete("host", task.task_id, b"again")  # no second result
        with pytest.raises(ApiError) as unknown:
            b.complete("host", "t999", b"x")
        assert unknown.value.code == "task_expired"

    run(scenario())


def test_a_worker_that_leaves_fails_expert_calls_and_requeues_pipeline_tasks(tmp_path: Path) -> None:
    async def scenario() -> None:
        b = broker(tmp_path)
        call = submit(b, "c1")
        micro = submit(b, "c2", requeue_on_loss=True)
        await b.lease("host", ["e.0"], max_rows=64, wait_s=0)
        b.worker_left("host")
        assert call.state == FAILED and call.error.code == "worker_gone"
        assert micro.state == QUEUED and b.stats.requeued == 1
        assert await b.lease("spare", ["e.0"], max_rows=64, wait_s=0) == [micro]  # re-dispatched

    run(scenario())


def test_dependencies_hold_a_task_until_they_are_done_and_fail_it_if_one_fails(tmp_path: Path) -> None:
    async def scenario() -> None:
        b = broker(tmp_path)
        fwd = submit(b, "fwd", key="stage.0", group="round-1")
        bwd = submit(b, "bwd", key="stage.1", after=[fwd.task_id], group="round-1")
        assert bwd.state == WAITING and await b.lease("w", ["stage.1"], max_rows=64, wait_s=0) == []
        await b.lease("w", ["stage.0"], max_rows=64, wait_s=0)
        b.complete("w", fwd.task_id, b"activations")
        assert bwd.state == QUEUED
        assert await b.lease("w", ["stage.1"], max_rows=64, wait_s=0) == [bwd]
        b.forget(fwd)
        assert b.result(fwd) == b"activations"  # a group's bytes live until the group is released

        other = submit(b, "fwd2", key="stage.0", group="round-2")
        after_other = submit(b, "bwd2", key="stage.1", after=[other.task_id], group="round-2")
        await b.lease("w", ["stage.0"], max_rows=64, wait_s=0)
        b.fail("w", other.task_id, ApiError(422, "bad_result", "NaN"))
        assert after_other.state == FAILED and after_other.error.code == "dependency_failed"
        assert b.release_group("round-1") == 2 and fwd.task_id not in b.tasks
        assert bwd.state == FAILED and bwd.error.code == "group_released"

    run(scenario())


def test_payloads_past_the_budget_spill_to_disk_and_every_byte_is_freed(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = Clock(1000.0)
        b = broker(tmp_path, clock, budget=100, retain_s=1)
        tasks = [submit(b, f"c{i}", payload=bytes([i]) * 40) for i in range(4)]
        assert b.store.memory_bytes == 80 and b.store.spilled_bytes == 80
        assert len(list((tmp_path / "spill").iterdir())) == 2
        got = await b.lease("host", ["e.0"], max_rows=64, wait_s=0)
        assert [b.payload(t) for t in got] == [bytes([i]) * 40 for i in range(4)]  # spilled ones read back
        for t in tasks:
            b.complete("host", t.task_id, b"r" * 10)
            b.forget(t)
        clock.now += 2
        b.tick()
        assert b.tasks == {} and b.store.memory_bytes == 0 and b.store.spilled_bytes == 0
        assert list((tmp_path / "spill").iterdir()) == []

    run(scenario())


def test_expert_routes_draw_from_their_own_rate_limit_bucket() -> None:
    """A DMoE trainer makes k x layers x 2 calls per micro-batch: those must not eat the bucket its
    heartbeats live on (and a flood of them is still limited)."""
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from relay_server.api.app import ROUTE_TABLE
    from relay_server.api.ratelimit import route_kind
    from toolkit.wire.protocol import ROUTES

    app = web.Application()
    for method, path, handler in ROUTE_TABLE:
        app.router.add_route(method, path, handler)

    def kind(method: str, path: str) -> str | None:
        request = make_mocked_request(method, path, app=app)
        match = asyncio.run(app.router.resolve(request))
        request._match_info = match
        return route_kind(request)

    assert kind("PUT", "/api/moe/peers/p1/calls/ffn0.1.0") == "tasks"
    assert kind("GET", "/api/moe/hosts/p1/tasks") == "tasks"
    assert kind("PUT", "/api/moe/hosts/p1/tasks/t9") == "tasks"
    assert kind("GET", ROUTES["moe_directory"]) == kind("POST", "/api/peers/p1/heartbeat") == "poll"
