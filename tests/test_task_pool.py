"""The task broker as the staged pipeline's micro-batch pool (no HTTP): 1F1B leasing order across
stages, affinity within a priority class, leases that last a factor of the measured task time,
first result wins, requeue and cancel, wake-ups per key, and the heaps and indexes checked against
a reference model under random operations. The pipeline through a real relay is
tests/test_pipeline.py's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from relay_server.core.errors import ApiError
from relay_server.tasks.broker import DONE, FAILED, LEASED, QUEUED, TaskBroker
from tests.support.clock import Clock
from tests.support.tasks import broker, run, submit


def micro(b: TaskBroker, call_id: str, kind: int, batch: int, mb: int, key: str = "stage.0", **kwargs):
    """A pipeline task: priority (0 backward / 1 forward, batch, microbatch), an empty payload
    (boundary tensors live in the coordinator's store), requeued when its worker is lost."""
    return b.submit(
        caller="coordinator",
        call_id=call_id,
        key=key,
        kind="backward" if kind == 0 else "forward",
        rows=1,
        payload=b"",
        timeout_s=kwargs.pop("timeout_s", 600.0),
        requeue_on_loss=True,
        priority=(kind, batch, mb),
        **kwargs,
    )


async def lease_one(b: TaskBroker, worker: str, keys=("stage.0", "stage.1")):
    got = await b.lease(worker, list(keys), max_rows=1, wait_s=0)
    return got[0] if got else None


def test_leasing_is_1f1b_backward_first_then_oldest_batch_across_keys(tmp_path: Path) -> None:
    async def scenario() -> None:
        b = broker(tmp_path)
        made = {
            (kind, batch, mb): micro(b, f"{kind}.{batch}.{mb}", kind, batch, mb, key=f"stage.{mb % 2}")
            for kind, batch, mb in [(1, 2, 0), (1, 1, 1), (0, 2, 1), (1, 1, 0), (0, 1, 0), (0, 2, 0), (1, 2, 1)]
        }
        order = [(await lease_one(b, "w")).priority for _ in made]
        assert order == sorted(made)  # backward before forward; within each, oldest batch then micro-batch
        assert await lease_one(b, "w") is None

    run(scenario())


def test_affinity_wins_only_within_the_priority_class_and_never_holds_a_task(tmp_path: Path) -> None:
    async def scenario() -> None:
        b = broker(tmp_path)
        theirs = micro(b, "bwd.1.0", 0, 1, 0)  # the oldest backward, nobody's preference
        mine = micro(b, "bwd.2.0", 0, 2, 0, prefer="alice")  # alice ran its forward: its input is cached
        my_fwd = micro(b, "fwd.3.0", 1, 3, 0, prefer="alice")
        assert await lease_one(b, "alice") is mine  # same class (backward): her own first, though younger
        assert await lease_one(b, "alice") is theirs  # a backward of anyone's beats her own forward
        assert await lease_one(b, "alice") is my_fwd

        gone = micro(b, "bwd.4.0", 0, 4, 0, prefer="carol")
        other = micro(b, "bwd.5.0", 0, 5, 0)
        assert await lease_one(b, "bob") is gone  # a preference is no hold: bob takes carol's, oldest first
        b.worker_left("carol")
        assert await lease_one(b, "bob") is other

        strict = broker(tmp_path / "strict", affinity_prefix=2)  # class = (kind, batch): affinity within a batch
        old = micro(strict, "bwd.1.0", 0, 1, 0)
        young = micro(strict, "bwd.2.0", 0, 2, 0, prefer="alice")
        same_batch = micro(strict, "bwd.1.1", 0, 1, 1, prefer="alice")
        assert [await lease_one(strict, "alice") for _ in range(3)] == [same_batch, old, young]

    run(scenario())


def test_a_lease_lasts_factor_times_the_measured_task_time_then_the_task_is_requeued(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = Clock(1000.0)
        b = broker(tmp_path, clock, initial_lease_s=30.0)  # defaults: floor 2 s, factor 4
        assert b.lease_deadline("stage.0") == 30.0 and b.timings() == {}
        for i in range(5):  # tasks that take ~1 s
            task = micro(b, f"m{i}", 1, 0, i)
            await lease_one(b, "fast")
            clock.now += 0.9 + 0.05 * i
            b.complete("fast", task.task_id, b"")
        assert b.timings()["stage.0"] == {
            "measured_s": pytest.approx(1.0),
            "samples": 5,
            "lease_deadline_s": pytest.approx(4.0),
        }
        assert b.lease_deadline("stage.0") == pytest.approx(4.0) and b.lease_deadline("stage.1") == 30.0

        stuck = micro(b, "stuck", 1, 1, 0)
        await lease_one(b, "sleepy")
        assert stuck.lease_expires_at == pytest.approx(clock.now + 4.0)
        clock.now += 3.9
        b.tick()
        assert stuck.state == LEASED and stuck.worker == "sleepy" and b.stats.lease_expired == 0
        clock.now += 0.1
        b.tick()
        assert stuck.state == QUEUED and stuck.previous_workers == ["sleepy"] and b.stats.lease_expired == 1
        assert await lease_one(b, "spare") is stuck and stuck.attempts == 2

        call = submit(b, "expert-call", key="stage.0", timeout_s=100)  # no requeue_on_loss: no lease deadline
        await b.lease("host", ["stage.0"], max_rows=64, wait_s=0)
        clock.now += 50
        b.tick()
        assert call.state == LEASED and call.lease_expires_at is None

        quick = broker(tmp_path / "quick", Clock(0.0))
        task = micro(quick, "q", 1, 0, 0)
        await lease_one(quick, "w")
        quick.clock.now += 0.1
        quick.complete("w", task.task_id, b"")
        assert quick.lease_deadline("stage.0") == 2.0  # the floor

    run(scenario())


def test_a_lease_taken_before_the_first_measurement_is_cut_to_the_measured_deadline(tmp_path: Path) -> None:
    """The first batch's leases are taken before any result of their key: a worker sitting on one
    must lose it at ``leased at + the measured deadline`` once a measurement exists, not after
    ``initial_lease_s``. Only that key's leases, never lengthened, and the cut one still expires
    through the tick's heap (a late result from its lessee still wins while it is not done)."""

    async def scenario() -> None:
        clock = Clock(1000.0)
        b = broker(tmp_path, clock, initial_lease_s=30.0)  # defaults: floor 2 s, factor 4
        hogged, early = micro(b, "m0", 1, 0, 0), micro(b, "m1", 1, 0, 1)
        answered, elsewhere = micro(b, "m2", 1, 0, 2), micro(b, "x0", 1, 0, 0, key="stage.1")
        assert await lease_one(b, "hog", ["stage.0"]) is hogged
        assert await lease_one(b, "hog", ["stage.1"]) is elsewhere
        clock.now += 0.5
        assert await lease_one(b, "slow", ["stage.0"]) is early
        assert await lease_one(b, "honest", ["stage.0"]) is answered
        assert hogged.lease_expires_at == 1030.0 and early.lease_expires_at == 1030.5
        clock.now += 1.0
        b.complete("honest", answered.task_id, b"")  # measured 1 s: leases of stage.0 last 4 s
        assert b.lease_deadline("stage.0") == pytest.approx(4.0)
        assert hogged.lease_expires_at == pytest.approx(1004.0) and early.lease_expires_at == pytest.approx(1004.5)
        assert elsewhere.lease_expires_at == 1030.0  # another key: no measurement, no cut

        clock.now = 1003.9
        b.tick()
        assert hogged.state == LEASED and b.stats.lease_expired == 0
        clock.now = 1004.0
        b.tick()
        assert hogged.state == QUEUED and hogged.lapsed_by == ["hog"] and b.stats.lease_expired == 1
        assert early.state == LEASED and elsewhere.state == LEASED

        slower = micro(b, "m3", 1, 0, 3)
        assert await lease_one(b, "honest", ["stage.0"]) is hogged
        assert await lease_one(b, "fast", ["stage.0"]) is slower
        clock.now += 3.0
        b.complete("fast", slower.task_id, b"")  # median of 1 s and 3 s: 8 s, longer: nothing is lengthened
        assert b.lease_deadline("stage.0") == pytest.approx(8.0) and early.lease_expires_at == pytest.approx(1004.5)
        b.complete("hog", hogged.task_id, b"late but first")  # first result wins, as before
        assert hogged.state == DONE and hogged.worker == "hog"
        b.tick()
        assert early.state == QUEUED and early.lapsed_by == ["slow"] and b.stats.lease_expired == 2

    run(scenario())


def test_first_result_wins_a_late_result_from_a_lapsed_lease_is_accepted_while_the_task_is_not_done(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        clock = Clock(1000.0)
        b = broker(tmp_path, clock, initial_lease_s=5.0)
        requeued = micro(b, "m1", 1, 0, 0)
        await lease_one(b, "sleepy")
        clock.now += 5
        b.tick()
        b.complete("sleepy", requeued.task_id, b"late but first")  # still queued: accepted, leaves the queue
        assert requeued.state == DONE and requeued.worker == "sleepy" and requeued.previous_workers == []
        assert b.queued_rows("stage.0") == 0 and await lease_one(b, "spare") is None

        released = micro(b, "m2", 1, 0, 1)
        await lease_one(b, "sleepy")
        clock.now += 5
        b.tick()
        assert await lease_one(b, "spare") is released
        b.complete("sleepy", released.task_id, b"first")  # re-leased to spare: sleepy's result still wins
        assert released.worker == "sleepy" and b.result(released) == b"first" and b.stats.late_accepted == 2
        with pytest.raises(ApiError) as second:
            b.complete("spare", released.task_id, b"second")
        assert (second.value.status, second.value.code) == (409, "task_done")
        assert released.previous_workers == ["spare"]

    run(scenario())


def test_a_task_is_never_leased_again_to_the_worker_that_let_its_lease_lapse(tmp_path: Path) -> None:
    """``skip_lapsed`` (the pipeline asks it while another worker serves the stage): the hog gets
    the next task instead, in 1F1B order, and the lapsed one keeps its place for the others."""

    async def scenario() -> None:
        clock = Clock(1000.0)
        b = broker(tmp_path, clock, initial_lease_s=5.0)
        first, second = micro(b, "m1", 1, 0, 0), micro(b, "m2", 1, 0, 1)
        assert await lease_one(b, "hog") is first
        clock.now += 5
        b.tick()
        assert first.lapsed_by == ["hog"]
        got = await b.lease("hog", ["stage.0"], max_rows=1, wait_s=0, skip_lapsed=True)
        assert got == [second]
        assert await b.lease("hog", ["stage.0"], max_rows=1, wait_s=0, skip_lapsed=True) == []
        assert await lease_one(b, "honest") is first  # still in its place for everyone else

    run(scenario())


def test_first_result_wins_a_late_result_after_the_new_lessee_answered_is_refused_task_done(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = Clock(1000.0)
        b = broker(tmp_path, clock, initial_lease_s=5.0)
        task = micro(b, "m1", 0, 0, 0)
        await lease_one(b, "sleepy")
        clock.now += 5
        b.tick()
        await lease_one(b, "spare")
        with pytest.raises(ApiError) as lapsed_failure:
            b.fail("sleepy", task.task_id, ApiError(422, "bad_result", "NaN"))  # must not end spare's work
        assert lapsed_failure.value.code == "not_your_task" and task.state == LEASED
        b.complete("spare", task.task_id, b"first")
        with pytest.raises(ApiError) as late:
            b.complete("sleepy", task.task_id, b"late")
        assert (late.value.status, late.value.code) == (409, "task_done") and b.result(task) == b"first"
        with pytest.raises(ApiError) as stranger:
            b.complete("mallory", task.task_id, b"x")
        assert stranger.value.code == "not_your_task"  # distinct from task_done: never leased to her

    run(scenario())


def test_requeue_puts_a_task_back_in_its_place_and_cancel_ends_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        b = broker(tmp_path)
        first, second = micro(b, "m1", 1, 0, 0), micro(b, "m2", 1, 0, 1)
        assert await lease_one(b, "w") is first
        assert b.requeue(first.task_id) is first and first.state == QUEUED and b.stats.requeued == 1
        assert await lease_one(b, "v") is first  # back ahead of the younger task
        assert b.cancel(second.task_id, ApiError(410, "superseded", "done elsewhere")).state == FAILED
        assert await lease_one(b, "v") is None and b.queued_rows("stage.0") == 0
        b.cancel(first.task_id, ApiError(410, "superseded", "done elsewhere"))
        for worker in ("w", "v"):  # its lessee and its previous lessee
            with pytest.raises(ApiError) as refused:
                b.complete(worker, first.task_id, b"x")
            assert refused.value.code == "task_done"
        assert b.cancel(first.task_id, ApiError(410, "again", "x")).error.code == "superseded"  # no-op once ended
        with pytest.raises(ApiError) as not_leased:
            b.requeue(first.task_id)
        assert (not_leased.value.status, not_leased.value.code) == (409, "task_not_leased")
        with pytest.raises(ApiError) as unknown:
            b.cancel("t999", ApiError(410, "x", "x"))
        assert (unknown.value.status, unknown.value.code) == (404, "unknown_task")

    run(scenario())


def test_a_new_task_wakes_only_the_lease_calls_waiting_on_its_key(tmp_path: Path) -> None:
    async def scenario() -> None:
        b = broker(tmp_path)
        on_a = [asyncio.create_task(b.lease(f"wa{i}", ["a"], max_rows=1, wait_s=60)) for i in range(2)]
        on_b = asyncio.create_task(b.lease("wb", ["b", "c"], max_rows=1, wait_s=60))
        for _ in range(3):
            await asyncio.sleep(0)  # each lease call finds nothing and waits
        task = submit(b, "c1", key="b")
        assert await asyncio.wait_for(on_b, 5) == [task]
        for _ in range(3):
            await asyncio.sleep(0)
        assert b.stats.wakeups == 1 and not any(t.done() for t in on_a)  # the calls on a slept through
        second = submit(b, "c2", key="a")
        done, waiting = await asyncio.wait(on_a, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        assert [t.result() for t in done] == [[second]] and b.stats.wakeups == 1 + 2  # both calls on a woke
        for t in waiting:  # the one that lost the race waits again
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)

    run(scenario())


def test_worker_left_touches_only_its_own_leases(tmp_path: Path) -> None:
    async def scenario() -> None:
        b = broker(tmp_path)
        tasks = [micro(b, f"m{i}", 1, 0, i) for i in range(6)]
        for i in range(6):
            await lease_one(b, f"w{i % 3}")
        b.worker_left("w1")
        assert [t.state for t in tasks] == [LEASED, QUEUED, LEASED, LEASED, QUEUED, LEASED]
        assert tasks[1].previous_workers == tasks[4].previous_workers == ["w1"]
        b.worker_left("w1")  # twice: nothing more
        assert b.stats.requeued == 2
        assert [await lease_one(b, "w0") for _ in range(2)] == [tasks[1], tasks[4]]

    run(scenario())


def _reference_pick(tasks, worker: str, keys, now: float, taken) -> object | None:
    """The leasing rule, by scanning: the smallest (priority, seq) among the live queued tasks of
    ``keys``, unless the smallest of those preferring ``worker`` is in the same class (priority[:1])."""
    queued = [t for t in tasks if t.state == QUEUED and t.key in keys and t.deadline > now and t not in taken]
    if not queued:
        return None
    best = min(queued, key=lambda t: (t.priority, t.seq))
    mine = [t for t in queued if t.prefer == worker]
    if mine and min(mine, key=lambda t: (t.priority, t.seq)).priority[:1] <= best.priority[:1]:
        return min(mine, key=lambda t: (t.priority, t.seq))
    return best


def _reference_refusal(b: TaskBroker, task, worker: str) -> str | None:
    if task.task_id not in b.tasks or task.state == FAILED and task.error.code == "task_timeout":
        return "task_expired"
    if worker != task.worker and worker not in task.previous_workers:
        return "not_your_task"
    if task.state == DONE or task.cancelled:
        return "task_done"
    return None if task.state in (LEASED, QUEUED) else "not_your_task"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_heaps_and_indexes_agree_with_a_reference_model_under_random_operations(tmp_path: Path, seed: int) -> None:
    """Submits, leases, results (from lessees, lapsed lessees and strangers), failures, departures,
    cancels, requeues, lease and task deadlines, group releases and failed keys, at random: every
    lease returns what the scanning reference picks, every result gets the reference's answer, and
    the per-key queued rows, the lease deadlines and the worker index stay exact."""
    import random

    async def scenario() -> None:
        rng = random.Random(seed)
        clock = Clock(0.0)
        b = broker(tmp_path, clock, initial_lease_s=3.0, lease_floor_s=1.0, retain_s=1e9)
        keys, workers, tasks = ["k0", "k1", "k2"], ["w0", "w1", "w2", "w3"], []

        for step in range(700):
            op = rng.random()
            if op < 0.3:
                kind, batch, mb = rng.randint(0, 1), rng.randint(0, 3), rng.randint(0, 3)
                tasks.append(
                    b.submit(
                        caller="c",
                        call_id=f"s{step}",
                        key=rng.choice(keys),
                        kind="x",
                        rows=rng.randint(1, 2),
                        payload=b"",
                        timeout_s=rng.uniform(2, 30),
                        group=rng.choice(["g0", "g1", ""]),
                        requeue_on_loss=rng.random() < 0.8,
                        priority=(kind, batch, mb),
                        prefer=rng.choice(workers + [None, None]),
                    )
                )
            elif op < 0.55:
                worker, asked = rng.choice(workers), rng.sample(keys, rng.randint(1, 3))
                max_rows, expected, rows = rng.randint(1, 3), [], 0
                while (pick := _reference_pick(tasks, worker, asked, clock.now, expected)) is not None:
                    if expected and rows + pick.rows > max_rows:
                        break
                    expected.append(pick)
                    rows += pick.rows
                got = await b.lease(worker, asked, max_rows=max_rows, wait_s=0)
                assert got == expected, f"step {step}: {[t.task_id for t in got]} != {[t.task_id for t in expected]}"
                for t in got:
                    assert t.worker == worker and t.leased_at == clock.now
                    if t.requeue_on_loss:
                        assert t.lease_expires_at == pytest.approx(clock.now + b.lease_deadline(t.key))
            elif op < 0.7 and tasks:
                task = rng.choice(tasks)
                worker = rng.choice([w for w in [task.worker, *task.previous_workers, rng.choice(workers)] if w])
                refusal = _reference_refusal(b, task, worker)
                try:
                    b.complete(worker, task.task_id, b"r")
                    assert refusal is None and task.state == DONE and task.worker == worker, f"step {step}"
                except ApiError as exc:
                    assert exc.code == refusal, f"step {step}"
            elif op < 0.75:
                leased = [t for t in tasks if t.state == LEASED]
                if leased:
                    task = rng.choice(leased)
                    b.fail(task.worker, task.task_id, ApiError(422, "bad_result", "x"))
                    assert task.state == FAILED
            elif op < 0.8:
                worker = rng.choice(workers)
                held = [t for t in tasks if t.state == LEASED and t.worker == worker]
                b.worker_left(worker)
                for t in held:
                    if t.requeue_on_loss and t.deadline > clock.now:
                        assert t.state == QUEUED and t.previous_workers[-1] == worker
                    else:
                        assert t.state == FAILED and t.error.code == "worker_gone"
            elif op < 0.85 and tasks:
                task = rng.choice(tasks)
                if rng.random() < 0.5 and task.task_id in b.tasks:
                    was_ended, before = task.ended, (task.state, task.cancelled)
                    b.cancel(task.task_id, ApiError(410, "superseded", "x"))
                    assert (task.state, task.cancelled) == (before if was_ended else (FAILED, True))
                elif task.state == LEASED:
                    holder = task.worker
                    b.requeue(task.task_id)
                    assert task.state == QUEUED and task.previous_workers[-1] == holder
            elif op < 0.95:
                clock.now += rng.uniform(0, 2)
                leased = [(t, t.worker, t.lease_expires_at) for t in tasks if t.state == LEASED]
                b.tick()
                assert all(t.ended for t in tasks if t.deadline <= clock.now)
                for t, holder, expires in leased:
                    if t.deadline <= clock.now:
                        continue
                    if expires is not None and expires <= clock.now:
                        assert t.state == QUEUED and t.previous_workers[-1] == holder, f"step {step}"
                    else:
                        assert t.state == LEASED and t.worker == holder, f"step {step}"
            elif op < 0.97:
                group = rng.choice(["g0", "g1"])
                members = [t for t in tasks if t.group == group and t.task_id in b.tasks]
                assert b.release_group(group) == len(members)
                assert all(t.ended and t.task_id not in b.tasks for t in members)
            else:
                key = rng.choice(keys)
                open_tasks = [t for t in tasks if t.key == key and not t.ended]
                assert b.fail_key(key, ApiError(410, "expert_gone", "x")) == len(open_tasks)
            for key in keys:
                assert b.queued_rows(key) == sum(t.rows for t in tasks if t.state == QUEUED and t.key == key)
            assert all((t.lease_expires_at is not None) == t.requeue_on_loss for t in tasks if t.state == LEASED)
            assert not any(t.lease_expires_at is not None for t in tasks if t.state != LEASED)

        b.tick()
        while (pick := _reference_pick(tasks, "w0", keys, clock.now, [])) is not None:  # drain in order
            assert await b.lease("w0", keys, max_rows=1, wait_s=0) == [pick]
        assert await b.lease("w0", keys, max_rows=1, wait_s=0) == [] and b.summary()["queued"] == 0
        assert b.stats.lease_expired > 0 and b.stats.late_accepted > 0 and b.timings()

    run(scenario())
