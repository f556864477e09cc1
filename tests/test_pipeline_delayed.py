"""Delayed parameter updates (``run.max_staleness = 1``) on a staged pipeline, end to end: a real
relay process and real stage-worker processes on 127.0.0.1.

Batch ``b`` computes on version ``max(b - 1, 0)`` -- on every stage, whichever worker runs it,
however the round before it is timed -- and its gradient makes version ``b + 1`` from version
``b``; batch ``b + 1`` starts as soon as version ``b`` is published, alongside batch ``b``'s last tasks and
round. So the run is exactly one process
that applies the gradient of batch ``b``, computed at the parameters of step ``b - 1``, to those
of step ``b`` (relative difference <= 1e-5), and measurably not the undelayed run.
"""

from __future__ import annotations

import pytest
import requests

from tests.support.pipeline import (
    accepted_batches,
    layers_per_stage,
    pipeline_overrides,
    relative_difference,
    replay,
)
from tests.support.pipeline_models import BYTE_SPEC, GPT2_DROPOUT_SPEC
from tests.support.training import relay_params

MICROBATCHES = 4
STEPS = 5


def events_of(workers, event: str) -> list[dict]:
    return [e for w in workers for e in w.events() if e["event"] == event]


@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "spec,stages",
    [
        (BYTE_SPEC, 2),
        (BYTE_SPEC, 3),
        pytest.param(GPT2_DROPOUT_SPEC, 2, marks=pytest.mark.slow),
    ],
)
def test_delayed_updates_equal_one_process_with_the_same_delay(serve_relay, launch_stage_worker, spec, stages):
    """K stages, 2 workers each, staleness 1, 5 steps: the parameters equal one process that
    applies batch b's gradient (computed at step b - 1's parameters) to step b's; every task of
    batch b computed on version max(b - 1, 0); some batch b + 1 task was leased while round b was
    still open (the overlap the delay buys); every round counted exactly the batch per stage."""
    overrides = pipeline_overrides(spec, stages=stages, microbatches=MICROBATCHES)
    overrides["run"]["max_staleness"] = 1
    relay = serve_relay(overrides)
    _, initial = relay_params(relay.url)
    workers = [launch_stage_worker(relay.url, f"w{i}", seed=i, until_step=STEPS) for i in range(2 * stages)]
    for worker in workers:
        assert worker.wait(timeout_s=300) == 0, worker.log_path.read_text()[-3000:]
    step, final = relay_params(relay.url, min_step=STEPS)
    batches, layers = accepted_batches(workers), layers_per_stage(relay.url)

    def reference(delay: int):
        return replay(spec, initial, batches, steps=step, microbatches=MICROBATCHES, layers=layers, delay=delay)

    difference = relative_difference(final, reference(1))
    assert difference <= 1e-5, difference
    assert relative_difference(final, reference(0)) > 100 * max(difference, 1e-7)  # the delay is real

    leased = events_of(workers, "leased")
    assert leased and all(e["version"] == max(e["batch"] - 1, 0) for e in leased), [
        (e["batch"], e["version"]) for e in leased if e["version"] != max(e["batch"] - 1, 0)
    ]
    uploads = events_of(workers, "uploaded")
    round_ends = {s: max(e["t"] for e in uploads if e["step"] == s) for s in {e["step"] for e in uploads}}
    overlapped = {e["batch"] for e in leased if e["batch"] - 1 in round_ends and e["t"] < round_ends[e["batch"] - 1]}
    assert overlapped, "no task of a batch was leased while the round before it was open"
    counted = serve_counted(relay.url)
    assert counted[:step] == [[2 * MICROBATCHES] * stages] * step


def serve_counted(url: str) -> list[list[int]]:
    """The samples each stage's parameter server counted, per round."""
    return requests.get(url + "/api/pipeline", timeout=10).json()["counted"]
