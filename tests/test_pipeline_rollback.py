"""A lie found after its batch was counted: every stage rolls back (docs/pipeline.md, "A lie
found after its batch was counted").

The integration test runs a real relay and real worker processes on 127.0.0.1: a patient liar
(``tests/stage_worker.py --corrupt scale-late``) on stage 0 and three honest workers. Nothing in
it depends on timing or on which worker the scheduler picks:

* ``probation_checks = 1``: only each worker's first checkable result is checked for sure; the
  liar's is honest. ``check_share = 1e-9``: past that, a result is checked with probability
  1e-9 -- never, in any run -- unless the monitors flag its worker.
* The liar triples one activation (its third), is honest for nine, then triples every one: its
  tripled activations are outliers to the monitors (whose reference formed on honest ones), two
  in a row make every result of it a check, and the relay's own computation of that first-stage
  task bans it. By then the batch holding its first unchecked result (its second activation)
  was counted: a worker serves at most four first-stage tasks of a batch.
* So every run bans it late, and every stage returns to the version before the first batch
  holding an unchecked result of it, and the undone batches are replayed: their first-stage
  tasks carry the data kept for them. The final parameters equal one process that trained on
  every batch counted once, each micro-batch id with the data first read for it -- an honest run,
  as if the liar's batches had been honest -- and no id was ever read twice with other data.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import requests
import torch

from relay_server.core.errors import ApiError
from relay_server.harness.process import wait_until
from relay_server.pipeline.kept_inputs import refuse_other_data, same_data
from relay_server.pipeline.rollback import ROLLED_BACK, TOO_LATE, PipelineRollback, RollbackDeps
from tests.support.pipeline import checked_pipeline, relative_difference, replay
from tests.support.pipeline_models import BYTE_SPEC
from tests.support.training import relay_params
from toolkit.errors import ProtocolError
from toolkit.pipeline.batch_data import carried_batch
from toolkit.wire import payloads

MICROBATCHES = 4
STEPS = 12
WINDOW = 16


def pipeline(relay) -> dict:
    return requests.get(relay.url + "/api/pipeline", timeout=10).json()


def peer_id(worker) -> str:
    return next(e["peer_id"] for e in worker.events() if e["event"] == "joined")


@pytest.mark.integration
def test_a_liar_caught_after_its_batches_counted_is_rolled_back_exactly(serve_relay, launch_stage_worker):
    relay = serve_relay(
        checked_pipeline(
            microbatches=MICROBATCHES,
            rebalance_every_batches=0,  # the liar stays on stage 0, where its lies are
            check_share=1e-9,
            probation_checks=1,
            rollback_batches=WINDOW,
        )
    )
    _, initial = relay_params(relay.url)
    liar = launch_stage_worker(relay.url, "liar", seed=100, until_step=STEPS, extra=("--corrupt", "scale-late"))
    wait_until(lambda: sum(len(s["workers"]) for s in pipeline(relay)["stages"]) >= 1, 120, "the liar placed")
    # the honest take their time, so the liar serves most of stage 0's tasks (and reaches its lies early)
    honest = [
        launch_stage_worker(relay.url, f"w{i}", seed=i, until_step=STEPS, extra=("--sleep-per-task", "0.3"))
        for i in range(1, 4)
    ]
    for worker in honest:
        assert worker.wait(timeout_s=400) == 0, worker.log_path.read_text()[-3000:]
    assert liar.wait(timeout_s=120) == 3, liar.log_path.read_text()[-3000:]  # told it is banned
    liar_id = peer_id(liar)
    assert [e for e in liar.events() if e["event"] == "corrupted"], liar.log_path.read_text()[-2000:]

    trust = pipeline(relay)["trust"]
    (ban,) = trust["bans"]  # the liar, and no honest worker
    assert ban["worker"] == liar_id, trust
    assert trust["rollback_batches"] == WINDOW, trust
    (rollback,) = trust["rollbacks"]
    assert rollback["worker"] == liar_id and rollback["outcome"] == ROLLED_BACK, rollback
    b0, at, published_as = rollback["to_version"], rollback["at_version"], rollback["published_as"]
    assert 0 <= b0 < at and published_as == at + 1 and rollback["batches_undone"] == at - b0, rollback

    # every undone committed batch is replayed (the window holds them all), with the batch in flight's read data
    assert rollback["batches_replayed"] == at - b0, rollback
    assert rollback["microbatches_replayed"] >= (at - b0) * MICROBATCHES, rollback

    step, final = relay_params(relay.url, min_step=STEPS)
    counted = step - (published_as - b0)  # batches 0 .. b0 - 1, then those after the rollback: ids b0 * d ..
    assert counted > b0, (step, rollback)  # some batches were counted after it: batch b0's ids, replayed
    reads = first_reads([*honest, liar])
    replayed = {
        e["microbatch"]
        for w in [*honest, liar]
        for e in w.events()
        if e["event"] == "leased" and e["kind"] == "first" and e.get("replay")
    }
    # the ids of batch b0 were committed before the ban and counted again after it: on the data kept for them
    assert set(range(b0 * MICROBATCHES, (b0 + 1) * MICROBATCHES)) <= replayed, sorted(replayed)
    assert replayed <= set(range(b0 * MICROBATCHES, (at + 1) * MICROBATCHES)), (sorted(replayed), rollback)
    assert all(len(reads[m]) >= 2 for m in range(b0 * MICROBATCHES, (b0 + 1) * MICROBATCHES)), rollback
    # an honest run: batches 0 .. counted - 1 once each, every id with the data first read for it
    batches = {m: data[0] for m, data in reads.items()}
    reference = replay(BYTE_SPEC, initial, batches, steps=counted, microbatches=MICROBATCHES)
    assert relative_difference(final, reference) <= 1e-5


def first_reads(workers) -> dict[int, list]:
    """micro-batch id -> the data of every accepted first-stage result of it, oldest first; the
    replay's reads of an id must carry the data first read for it (asserted here)."""
    found: dict[int, list[tuple[float, object]]] = {}
    for worker in workers:
        for event in worker.events():
            if event["event"] == "first":
                found.setdefault(event["microbatch"], []).append((event["t"], event["batch"]))
    reads = {m: [data for _, data in sorted(found[m], key=lambda read: read[0])] for m in found}
    for m, data in reads.items():
        assert all(d == data[0] for d in data), f"micro-batch {m} was read again with other data"
    return reads


class Stages:
    """What a rollback reaches, as plain figures: the published version and the kept files."""

    def __init__(self, step: int, kept_from: int) -> None:
        self.step, self.kept_from = step, kept_from
        self.restored: list[int] = []
        self.published: list[object] = []
        self.closed = 0
        self.first_id: int | None = None

    def deps(self) -> RollbackDeps:
        async def restore(b: int):
            self.restored.append(b)
            self.step += 1
            return _Published(self.step)

        async def publish(outcome) -> None:
            self.published.append(outcome)

        return RollbackDeps(
            step=lambda: self.step,
            holds=lambda b: b >= self.kept_from,
            restore=restore,
            publish=publish,
            batch_over=self.close,
            restart_from=lambda b: setattr(self, "first_id", b),
            resume=lambda: None,
        )

    def close(self) -> None:
        self.closed += 1


class _Published:
    def __init__(self, step: int) -> None:
        self.step = step


def test_a_ban_undoes_from_the_first_counted_unchecked_batch_within_the_window() -> None:
    async def run() -> None:
        stages = Stages(step=0, kept_from=0)
        rollback = PipelineRollback(4, stages.deps())
        for batch in range(6):  # w delivers unchecked results from batch 2 on; batch 5 restarts
            rollback.unchecked(batch, "honest")
            if batch >= 2:
                rollback.unchecked(batch, "w")
            if batch < 5:
                rollback.committed(batch)
                stages.step = batch + 1
        decision = rollback.banned("w", 5)
        assert (decision.to, decision.outcome) == (2, ROLLED_BACK) and rollback.rolling
        await rollback.running  # type: ignore[misc]
        assert stages.restored == [2] and stages.first_id == 2 and stages.closed == 1
        (outcome,) = stages.published
        assert outcome.finalized_by == "rollback" and outcome.samples == 0 and outcome.contributions == {}
        (record,) = rollback.history
        assert (record.to_version, record.at_version, record.published_as, record.batches_undone) == (2, 5, 6, 3)
        # the undone batches' unchecked results are gone with them; those before batch 2 stay
        assert rollback.first == {"honest": 0}

    asyncio.run(run())


def test_a_ban_later_than_the_window_undoes_nothing_and_says_too_late() -> None:
    async def run() -> None:
        stages = Stages(step=0, kept_from=0)
        rollback = PipelineRollback(2, stages.deps())
        rollback.unchecked(0, "w")
        for batch in range(4):
            rollback.committed(batch)
            stages.step = batch + 1
        decision = rollback.banned("w", 4)
        assert (decision.to, decision.outcome) == (None, TOO_LATE) and not rollback.rolling
        assert stages.restored == [] and rollback.history[-1].outcome == TOO_LATE
        # within the window but its file pruned: too late as well
        stages.kept_from = 3
        late = PipelineRollback(8, stages.deps())
        late.unchecked(2, "v")
        late.committed(2)
        assert late.decide("v").outcome == TOO_LATE
        # a worker whose every counted result was checked: nothing to undo
        assert late.decide("checked").to is None and late.decide("checked").outcome != TOO_LATE
        # a result of a batch that restarted was never counted
        late.unchecked(4, "u")
        late.restarted(4)
        late.committed(4)
        assert late.decide("u").to is None

    asyncio.run(run())


def data(*ids: int) -> dict[int, bytes]:
    """Micro-batch id -> a data container as the relay keeps it (a byte model's ``batch``)."""
    return {m: payloads.encode({"batch": np.full((2, 5), m, dtype=np.int64)}) for m in ids}


def test_the_kept_inputs_cover_the_window_and_a_rollback_replays_them() -> None:
    async def run() -> None:
        stages = Stages(step=0, kept_from=0)
        rollback = PipelineRollback(2, stages.deps())
        for batch in range(5):  # micro-batches 2b, 2b + 1; w's unchecked results from batch 3 on
            if batch >= 3:
                rollback.unchecked(batch, "w")
            rollback.committed(batch, data(2 * batch, 2 * batch + 1))
            stages.step = batch + 1
        # the window: a rollback reaches b0 >= step - 2, so batches 3 and 4 are kept, no older
        assert sorted(rollback.inputs.batches) == [3, 4] and rollback.inputs.carried(6) is None
        # a ban with nothing to undo restarts the batch in flight on fresh data: nothing replayed
        assert rollback.banned("clean", 5, data(10)).to is None and rollback.inputs.replaying == {}
        rollback.committed(5, {10: data(99)[99], **data(11)})  # committed on what it read after the restart
        stages.step = 6
        assert sorted(rollback.inputs.batches) == [4, 5] and rollback.inputs.batches[5][10] == data(99)[99]
        # batch 3 left the window: w's ban is too late, nothing replayed
        assert rollback.banned("w", 6, data(12)).outcome == TOO_LATE and rollback.inputs.replaying == {}

        rollback = PipelineRollback(4, stages.deps())
        for batch in range(6):
            if batch >= 4:
                rollback.unchecked(batch, "w")
            rollback.committed(batch, data(2 * batch, 2 * batch + 1))
            stages.step = batch + 1
        in_flight = data(12)  # batch 6: micro-batch 12 was read, 13 not yet
        assert rollback.banned("w", 6, in_flight).to == 4
        await rollback.running  # type: ignore[misc]
        record = rollback.history[-1]
        assert (record.batches_undone, record.batches_replayed, record.microbatches_replayed) == (2, 2, 5)
        # batches 4 and 5 (ids 8 .. 11) and the read id of the batch in flight carry their kept data
        assert {m: rollback.inputs.carried(m) for m in range(8, 14)} == {**data(8, 9, 10, 11, 12), 13: None}
        assert sorted(rollback.inputs.batches) == [2, 3]  # the undone batches' records went with them
        # batch 4's ids commit again (as the next batch after the rollback): their replay is over
        rollback.committed(7, data(8, 9))
        assert rollback.inputs.carried(8) is None and rollback.inputs.carried(10) == data(10)[10]
        assert sorted(rollback.inputs.batches) == [7]  # after batch 7 a rollback reaches b0 >= 4: 2 and 3 left

    asyncio.run(run())


def test_replayed_data_is_compared_and_validated() -> None:
    a, b = data(1)[1], data(2)[2]
    assert same_data(a, payloads.encode({"batch": np.full((2, 5), 1, dtype=np.int64)})) and not same_data(a, b)
    assert not same_data(a, payloads.encode({"batch.input_ids": np.full((2, 5), 1, dtype=np.int64)}))
    assert not same_data(a, payloads.encode({"batch": np.full((2, 5), 1, dtype=np.int32)}))
    refuse_other_data(1, a, None)  # a task that carried nothing: the worker's own data
    refuse_other_data(1, a, data(1)[1])  # the carried data, sent back
    with pytest.raises(ApiError) as refused:
        refuse_other_data(1, b, a)
    assert (refused.value.status, refused.value.code) == (422, "replay_mismatch")
    good = {"batch": np.zeros((2, 5), dtype=np.int64)}
    assert carried_batch(good, 2, torch.device("cpu")).shape == (2, 5)
    pair = {"batch.input_ids": np.zeros((2, 5), dtype=np.int64), "batch.labels": np.zeros((2, 5), dtype=np.int64)}
    assert set(carried_batch(pair, 2, torch.device("cpu"))) == {"input_ids", "labels"}
    for bad in (
        {},  # no data
        {"batch": np.zeros((3, 5), dtype=np.int64)},  # not the micro-batch's rows
        {"batch": np.zeros((2, 5), dtype=np.float32)},  # not token ids
        {"batch": np.full((2, 5), -101, dtype=np.int64)},  # ids below -100
        {"batch.Input": np.zeros((2, 5), dtype=np.int64)},  # a bad key
        {"batch.a": np.zeros((2, 5), dtype=np.int64), "batch.b": np.zeros((2, 4), dtype=np.int64)},
        {**good, "x": np.zeros((2, 5), dtype=np.float32)},  # more than the data
    ):
        with pytest.raises(ProtocolError):
            carried_batch(bad, 2, torch.device("cpu"))
