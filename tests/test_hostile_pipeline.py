"""A hostile worker against the pipeline (issue 41): a real relay and real worker processes on
127.0.0.1, one worker misbehaving on purpose (``tests/stage_worker.py --hostile``), the others
honest. Each run must finish its batches, count every stage's every round exactly once, and equal
one process replaying the batches that were counted.

* ``hoard`` holds the stage gradients the relay accepted from it, heartbeats and polls, and never
  asks for a ticket: the round would wait forever without a deadline on held gradients;
* ``reuse`` asks for a second ticket naming other micro-batches (refused, its micro-batches
  recomputed), then uploads with its first ticket: counted twice, or a round closed with its redo
  tasks still queued and their boundaries dropped (honest workers got ``internal_error``);
* ``hog`` polls from four connections and never answers: without a cap and a no-re-lease rule it
  takes every task again as its lease lapses;
* ``trickle`` uploads its stage gradient up to its last bytes, then one byte every 2 s: never
  silent long enough to be cut as idle, and an upload in flight is never recomputed;
* ``liar`` claims 1e12 samples/s and never asks for work: placed by self-reports, every honest
  joiner went to the other stage and its own was never served.

"3x the honest batch time" is asserted as counts, not seconds: each hostile worker may cost at
most one lease or hold deadline per batch it is let in (strikes bench it for 1, 2, 4, .. batches),
so the recomputes and lapses it causes are bounded by the batches run.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import requests

from relay_server.harness.process import wait_until
from tests.support.pipeline import accepted_batches, pipeline_overrides, relative_difference, replay
from tests.support.pipeline_models import BYTE_SPEC
from tests.support.training import relay_params
from toolkit.wire import payloads
from toolkit.wire.protocol import PROTOCOL_VERSION, ROUTES, PipelineResult

MICROBATCHES = 4
STEPS = 3


def pipeline(relay) -> dict:
    return requests.get(relay.url + "/api/pipeline", timeout=10).json()


def placed(relay) -> int:
    return sum(len(s["workers"]) for s in pipeline(relay)["stages"])


def hostile_run(serve_relay, launch_stage_worker, kinds: list[str]):
    """K = 2, the hostile workers (first, so that the liar is placed on an empty pipeline), then
    four honest ones: the relay's pipeline status after the run, checked exact, and the hostile
    and honest workers."""
    relay = serve_relay(
        {
            **pipeline_overrides(
                BYTE_SPEC, stages=2, microbatches=MICROBATCHES, initial_lease_s=5.0, lease_floor_s=1.0
            ),
            "rounds": {"heartbeat_interval_s": 0.3, "peer_ttl_s": 600.0},
        }
    )
    _, initial = relay_params(relay.url)
    hostile = [
        launch_stage_worker(
            relay.url,
            f"hostile-{kind}",
            seed=100 + i,
            until_step=STEPS,
            extra=("--hostile", kind, "--sleep-per-task", "0.1"),
        )
        for i, kind in enumerate(kinds)
    ]
    wait_until(lambda: placed(relay) >= len(hostile), 120, "the hostile workers placed")
    honest = [
        launch_stage_worker(relay.url, f"w{i}", seed=i, until_step=STEPS, extra=("--sleep-per-task", "0.1"))
        for i in range(4)
    ]
    for worker in honest:
        assert worker.wait(timeout_s=300) == 0, worker.log_path.read_text()[-3000:]
    step, final = relay_params(relay.url, min_step=STEPS)
    workers = honest + hostile
    reference = replay(BYTE_SPEC, initial, accepted_batches(workers), steps=step, microbatches=MICROBATCHES)
    assert relative_difference(final, reference) <= 1e-5
    status = pipeline(relay)
    assert status["counted"] == [[2 * MICROBATCHES] * 2] * step, status
    return status, hostile, honest


def test_a_hoarder_of_stage_gradients_is_recomputed_at_the_hold_deadline(serve_relay, launch_stage_worker):
    status, (hoarder,), _ = hostile_run(serve_relay, launch_stage_worker, ["hoard"])
    hoarded = [e for e in hoarder.events() if e["event"] == "hoarding"]
    assert hoarded, hoarder.log_path.read_text()[-2000:]  # it did hold gradients into a round
    # each batch it is let in costs at most one hold deadline; strikes bench it for 1, 2, .. batches
    assert 1 <= status["expired_holds"] <= STEPS, status
    assert all(s > 0 for s in status["hold_deadline_s"]), status


def test_a_reused_ticket_is_void_once_its_microbatches_are_recomputed(serve_relay, launch_stage_worker):
    status, (reuser,), honest = hostile_run(serve_relay, launch_stage_worker, ["reuse"])
    events = reuser.events()
    refused = [e for e in events if e["event"] == "second_ticket_refused"]
    assert refused and all(e["code"] == "wrong_microbatches" for e in refused), reuser.log_path.read_text()[-2000:]
    assert not [e for e in events if e["event"] == "uploaded" and e["microbatches"]] or status["redone"] >= 1
    for worker in honest:
        assert "internal_error" not in worker.log_path.read_text()


def test_a_trickled_stage_gradient_upload_is_cut_at_its_deadline(serve_relay, launch_stage_worker):
    status, (trickler,), _ = hostile_run(serve_relay, launch_stage_worker, ["trickle"])
    assert [e for e in trickler.events() if e["event"] == "trickling"], trickler.log_path.read_text()[-2000:]
    # each batch it is let in costs at most one upload deadline; strikes bench it for 1, 2, .. batches
    assert 1 <= status["cut_uploads"] <= STEPS, status


def test_a_lease_hog_holds_at_most_two_tasks_and_never_the_same_one_twice(serve_relay, launch_stage_worker):
    status, (hog,), honest = hostile_run(serve_relay, launch_stage_worker, ["hog"])
    check_hog(hog, honest)
    assert status["lapsed_leases"] >= 1, status


def check_hog(hog, honest) -> None:
    """From the moment an honest worker serves the hog's stage (alone, its stage's tasks are its
    own to sit on): no task leased to it twice, at most two per batch it is let in."""
    stage = next(e["stage"] for e in hog.events() if e["event"] == "hogged")
    served = min(e["t"] for w in honest for e in w.events() if e["event"] == "leased" and e["stage"] == stage)
    hogged = [e["task"] for e in hog.events() if e["event"] == "hogged" and e["t"] > served]
    assert len(hogged) == len(set(hogged)), (hogged, served)  # never again to the worker that let it lapse
    # two at a time, then benched after its lapses for the rest of the batch, then 2, 4, .. batches
    assert len(hogged) <= 2 * (STEPS + 1), (hogged, served)


def test_a_worker_claiming_any_speed_draws_no_joiner_from_its_stage(serve_relay, launch_stage_worker):
    status, (liar,), honest = hostile_run(serve_relay, launch_stage_worker, ["liar"])
    stages = [next(e["stage"] for e in w.events() if e["event"] == "done") for w in honest]
    assert stages.count(0) >= 1 and stages.count(1) >= 1, stages


@pytest.mark.slow  # one run with every kind at once; each kind alone runs by default above
def test_every_kind_of_hostile_worker_at_once(serve_relay, launch_stage_worker):
    kinds = ["liar", "hoard", "reuse", "hog"]
    status, hostile, honest = hostile_run(serve_relay, launch_stage_worker, kinds)
    assert status["expired_holds"] <= 2 * STEPS, status  # the hoarder's and the reuser's, once per batch at most
    check_hog(hostile[kinds.index("hog")], honest)


def test_a_first_stage_result_whose_rows_do_not_match_its_data_is_refused(serve_relay, launch_stage_worker):
    """Micro-batch 2 x 8 tokens = 16 rows: a boundary of 15 rows (or 17) is refused 422 and
    nothing of it is kept; honest workers then train the batch exactly."""
    relay = serve_relay(pipeline_overrides(BYTE_SPEC, stages=2, microbatches=MICROBATCHES, initial_lease_s=2.0))
    _, initial = relay_params(relay.url)
    hostile = requests.post(
        relay.url + ROUTES["join"], json={"peer_name": "mallory", "protocol": PROTOCOL_VERSION}, timeout=10
    ).json()["peer_id"]
    assert (
        requests.post(relay.url + ROUTES["pipeline_stage"].format(peer_id=hostile), json={}, timeout=10).json()[
            "stage"
        ]
        == 0
    )
    work = requests.get(relay.url + ROUTES["pipeline_work"].format(peer_id=hostile), params={"wait": 5}, timeout=30)
    metadata, _ = payloads.decode(work.content, len(work.content))
    task = json.loads(metadata["work"])["tasks"][0]
    seq, width = BYTE_SPEC.kwargs["seq_len"], BYTE_SPEC.kwargs["d_model"]
    tokens = np.zeros((2, seq + 1), dtype=np.int64)
    for rows in (2 * seq - 1, 2 * seq + 1, seq):
        body = payloads.encode(
            {"y": np.zeros((rows, width), dtype=np.float32), "batch": tokens},
            {"result": PipelineResult(task_id=task["task_id"]).dumps().decode()},
        )
        response = requests.put(
            relay.url + ROUTES["pipeline_result"].format(peer_id=hostile, task_id=task["task_id"]),
            data=body,
            timeout=10,
        )
        assert response.status_code == 422 and response.json()["error"] == "bad_tensor", response.text
        assert str(2 * seq) in response.json()["message"], response.text  # it says what was expected
    status = pipeline(relay)
    assert status["finished"] == 0 and status["boundary_memory_bytes"] == 0, status
    requests.post(relay.url + ROUTES["leave"].format(peer_id=hostile), timeout=10)
    workers = [launch_stage_worker(relay.url, f"w{i}", seed=i, until_step=1) for i in range(2)]
    for worker in workers:
        assert worker.wait(timeout_s=240) == 0, worker.log_path.read_text()[-3000:]
    step, final = relay_params(relay.url, min_step=1)
    reference = replay(BYTE_SPEC, initial, accepted_batches(workers), steps=step, microbatches=MICROBATCHES)
    assert relative_difference(final, reference) <= 1e-5
