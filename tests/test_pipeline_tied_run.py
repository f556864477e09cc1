"""Tied input/output embeddings on a pipeline run, end to end: a real relay and real stage-worker
processes on 127.0.0.1.

GPT-2 with its default config (tied embeddings, dropout 0.1; small sizes): stage 0's parameter
server owns the tied matrix, the last stage's workers download its copy with each version their
tasks compute on and upload the head's gradient of it with their stage's own (one ticketed
upload), and the relay adds its mean into stage 0's before the step
(:mod:`relay_server.pipeline.tied`). The parameters after the run equal one process training the
tied model on the same batches with the same dropout masks (relative difference <= 1e-5), at
K = 2 and 3 and with delayed parameter updates; every stage's every round counted exactly the
batch. Without the head's term the tied matrix's gradient is off by more than 1e-2
(tests/test_pipeline_tied.py), so exactness here is the fold's proof.
"""

from __future__ import annotations

import pytest
import requests

from tests.support.pipeline import accepted_batches, layers_per_stage, pipeline_overrides, relative_difference, replay
from tests.support.pipeline_models import DEFAULT_GPT2_SPEC, LLAMA_SPEC, tied
from tests.support.training import relay_params
from toolkit.pipeline import units_of

pytestmark = pytest.mark.integration
MICROBATCHES = 4
STEPS = 4


def counted(url: str) -> list[list[int]]:
    """The samples each stage's parameter server counted, per round."""
    return requests.get(url + "/api/pipeline", timeout=10).json()["counted"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "name,spec,stages,staleness",
    [
        ("gpt2-default", DEFAULT_GPT2_SPEC, 2, 0),
        ("gpt2-default-delayed", DEFAULT_GPT2_SPEC, 2, 1),
        pytest.param("gpt2-default", DEFAULT_GPT2_SPEC, 3, 0, marks=pytest.mark.slow),
        pytest.param("llama-tied", tied(LLAMA_SPEC), 2, 0, marks=pytest.mark.slow),
    ],
)
def test_a_tied_run_equals_one_process(serve_relay, launch_stage_worker, name, spec, stages, staleness):
    overrides = pipeline_overrides(spec, stages=stages, microbatches=MICROBATCHES)
    overrides["run"]["max_staleness"] = staleness
    relay = serve_relay(overrides)
    _, initial = relay_params(relay.url)
    workers = [launch_stage_worker(relay.url, f"w{i}", seed=i, until_step=STEPS) for i in range(2 * stages)]
    for worker in workers:
        assert worker.wait(timeout_s=300) == 0, worker.log_path.read_text()[-3000:]
    step, final = relay_params(relay.url, min_step=STEPS)
    units = units_of(spec)
    assert units.tied is not None and final.size == initial.size == units.total  # the matrix held once
    reference = replay(
        spec,
        initial,
        accepted_batches(workers),
        steps=step,
        microbatches=MICROBATCHES,
        layers=layers_per_stage(relay.url),
        delay=staleness,
    )
    difference = relative_difference(final, reference)
    assert difference <= 1e-5, difference
    assert relative_difference(final, initial) > 1e-4  # it did train
    assert counted(relay.url)[:step] == [[2 * MICROBATCHES] * stages] * step
