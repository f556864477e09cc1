"""The staged pipeline end to end: a real relay process and real worker processes on 127.0.0.1.

* exactness: K stages, 2 workers each, staleness 0: the parameters after N steps equal one process
  training on the same global batches (relative difference <= 1e-5);
* exactly once under a kill: a worker SIGKILLed while it holds a leased task and a stage gradient
  it has not uploaded loses nothing: every round counts exactly the batch's samples per stage,
  and the parameters still equal the reference;
* a worker that stops answering without leaving (SIGSTOP) has its tasks re-dispatched at the
  lease deadline, and the batch completes.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import requests

from tests.conftest import wait_until
from tests.support.pipeline import accepted_batches, pipeline_overrides, relative_difference, replay, worker_events
from tests.support.pipeline_models import BYTE_SPEC, GPT2_SPEC
from tests.support.training import relay_params

STEPS = 3
MICROBATCHES = 4


def train(start_relay, launch_stage_worker, spec, *, stages: int, steps: int = STEPS, extra=()):
    relay = start_relay(pipeline_overrides(spec, stages=stages, microbatches=MICROBATCHES))
    _, initial = relay_params(relay.url)
    workers = [launch_stage_worker(relay.url, f"w{i}", seed=i, until_step=steps, extra=extra)
               for i in range(2 * stages)]
    return relay, initial, workers


def check_exact(relay, spec, initial, workers, steps: int) -> float:
    for worker in workers:
        assert worker.wait(timeout_s=240) in (0, -signal.SIGKILL), worker.log_path.read_text()[-3000:]
    step, final = relay_params(relay.url, min_step=steps)
    reference = replay(spec, initial, accepted_batches(workers), steps=step, microbatches=MICROBATCHES)
    return relative_difference(final, reference)


@pytest.mark.parametrize("model,spec,stages", [("byte", BYTE_SPEC, 3), ("gpt2", GPT2_SPEC, 2)])
def test_pipeline_equals_one_process(start_relay, launch_stage_worker, model, spec, stages):
    relay, initial, workers = train(start_relay, launch_stage_worker, spec, stages=stages)
    assert check_exact(relay, spec, initial, workers, STEPS) <= 1e-5
    assert counted(relay) == [[2 * MICROBATCHES] * stages] * STEPS


def counted(relay) -> list[list[int]]:
    """The samples each stage's parameter server counted, per round."""
    return requests.get(relay.url + "/api/pipeline", timeout=10).json()["counted"]
