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

import dataclasses
import json
import os
import signal

import numpy as np
import pytest
import requests

from relay_server.core.config import ConfigError, load_config
from relay_server.harness.process import wait_until
from tests.support.peers import TOKENS, hf_relay, standin
from tests.support.pipeline import (
    accepted_batches,
    layers_per_stage,
    pipeline_overrides,
    relative_difference,
    replay,
)
from tests.support.pipeline_models import BYTE_SPEC, GPT2_DROPOUT_SPEC, GPT2_SPEC, LLAMA_SPEC, NEOX_SPEC, QWEN2_SPEC
from tests.support.processes import merged, write_config
from tests.support.training import relay_params
from toolkit.client import RelayClient
from toolkit.wire import payloads
from toolkit.wire.protocol import PROTOCOL_VERSION, ROUTES, PipelineResult

STEPS = 3
EXACT_STEPS = 5
WIDE_BYTE_SPEC = dataclasses.replace(BYTE_SPEC, kwargs={**BYTE_SPEC.kwargs, "d_model": 128, "d_ff": 128})
MICROBATCHES = 4


def train(serve_relay, launch_stage_worker, spec, *, stages: int, steps: int = STEPS, extra=(), precision: str = ""):
    overrides = pipeline_overrides(spec, stages=stages, microbatches=MICROBATCHES)
    if precision:
        overrides["run"]["precision"] = precision
    relay = serve_relay(overrides)
    _, initial = relay_params(relay.url)
    workers = [
        launch_stage_worker(relay.url, f"w{i}", seed=i, until_step=steps, extra=extra) for i in range(2 * stages)
    ]
    return relay, initial, workers


def check_exact(relay, spec, initial, workers, steps: int, precision: str = "") -> float:
    """How far the run's parameters are from one process training on the same batches with the
    same dropout masks (and under the same autocast)."""
    for worker in workers:
        assert worker.wait(timeout_s=240) in (0, -signal.SIGKILL), worker.log_path.read_text()[-3000:]
    step, final = relay_params(relay.url, min_step=steps)
    reference = replay(
        spec,
        initial,
        accepted_batches(workers),
        steps=step,
        microbatches=MICROBATCHES,
        layers=layers_per_stage(relay.url),
        precision=precision,
    )
    return relative_difference(final, reference)


@pytest.mark.parametrize(
    "model,spec,stages",
    [
        ("byte", BYTE_SPEC, 3),
        ("gpt2-dropout", GPT2_DROPOUT_SPEC, 2),
        ("gpt2-dropout", GPT2_DROPOUT_SPEC, 3),
        ("llama", LLAMA_SPEC, 2),
        pytest.param("gpt_neox", NEOX_SPEC, 2, marks=pytest.mark.slow),
        pytest.param("qwen2", QWEN2_SPEC, 3, marks=pytest.mark.slow),
        pytest.param("byte", BYTE_SPEC, 2, marks=pytest.mark.slow),  # (K = 2 bytes: also the kill test's run)
        pytest.param("gpt2", GPT2_SPEC, 2, marks=pytest.mark.slow),  # (dropout 0: a special case of the above)
    ],
)
def test_pipeline_equals_one_process(serve_relay, launch_stage_worker, model, spec, stages):
    """K stages, 2 workers each, staleness 0, 5 steps: the parameters equal one process on the
    same global batches -- for GPT-2 with its default dropout, drawing the same masks (each
    micro-batch's forward on stage k seeded by (micro-batch, k), the recomputed backward replaying
    it, on whichever worker it runs) -- and every stage's every round counted exactly the batch.

    Whether a backward lands on another worker than its forward is the scheduler's choice (on a
    loaded machine one worker can take them all), so this test does not assert it happened;
    ``tests/test_pipeline_stages.py`` proves the masks do not depend on the worker that draws them."""
    relay, initial, workers = train(serve_relay, launch_stage_worker, spec, stages=stages, steps=EXACT_STEPS)
    assert check_exact(relay, spec, initial, workers, EXACT_STEPS) <= 1e-5
    assert counted(relay) == [[2 * MICROBATCHES] * stages] * EXACT_STEPS


def test_a_pinned_precision_is_the_stage_workers_precision(serve_relay, launch_stage_worker):
    """``run.precision = "bf16"`` on a pipeline run: every stage worker computes its forwards and
    recomputed backwards under bf16 autocast (the dropout masks replayed as in fp32), so the
    parameters equal one process under the same autocast with the same masks, and are measurably
    not the fp32 run's.

    One step, not three: a step's mean gradient is summed in the order the scheduler chose (each
    worker sums the micro-batches it served), so the masters after it differ from one process's by
    fp32 rounding (~4e-9 here). The next step's bf16 cast of a weight that lies that close to a
    rounding midpoint moves it by 2^-9, and the run drifts from the reference by ~1e-5: a chance
    of a few per cent a step, which tests the scheduler's order, not the workers' precision."""
    spec, steps = GPT2_DROPOUT_SPEC, 1
    relay, initial, workers = train(serve_relay, launch_stage_worker, spec, stages=2, steps=steps, precision="bf16")
    difference = check_exact(relay, spec, initial, workers, steps, precision="bf16")
    assert difference <= 1e-5, difference
    assert {e["precision"] for w in workers for e in w.events() if e["event"] == "joined"} == {"bf16"}
    assert check_exact(relay, spec, initial, workers, steps) > 100 * max(difference, 1e-7)
    assert counted(relay) == [[2 * MICROBATCHES] * 2] * steps


def counted(relay) -> list[list[int]]:
    """The samples each stage's parameter server counted, per round."""
    return requests.get(relay.url + "/api/pipeline", timeout=10).json()["counted"]


def holds_task_and_gradient(worker) -> bool:
    """The worker is inside a leased task and holds a stage gradient it has not uploaded."""
    events = worker.events()
    uploaded = max((i for i, e in enumerate(events) if e["event"] == "uploaded"), default=-1)
    held = any(e["event"] == "accepted" and e["kind"] in ("last", "backward") for e in events[uploaded + 1 :])
    return held and bool(events) and events[-1]["event"] == "leased"


def test_a_killed_worker_loses_no_sample(serve_relay, launch_stage_worker):
    """SIGKILL a worker holding a leased task and an unsent stage gradient: its task is
    re-dispatched, its micro-batches' stage gradient recomputed, and every round still counts
    exactly the batch, equal to one process."""
    relay, initial, workers = train(
        serve_relay, launch_stage_worker, BYTE_SPEC, stages=2, extra=("--sleep-per-task", "0.2")
    )
    victim = wait_until(
        lambda: next((w for w in workers if holds_task_and_gradient(w)), None),
        120,
        "a worker holding a leased task and an unsent stage gradient",
    )
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(timeout=10)
    assert check_exact(relay, BYTE_SPEC, initial, workers, STEPS) <= 1e-5
    assert counted(relay) == [[2 * MICROBATCHES] * 2] * STEPS
    pipeline = requests.get(relay.url + "/api/pipeline", timeout=10).json()
    assert pipeline["redispatched"] >= 1 and pipeline["redone"] >= 1, pipeline


@pytest.mark.slow  # 25 s; lost tasks are redone in test_a_killed_worker_loses_no_sample (default)
def test_a_stuck_worker_loses_its_tasks_at_the_lease_deadline(serve_relay, launch_stage_worker):
    """SIGSTOP a worker inside a task, with a peer TTL far longer than the lease: the task is
    re-dispatched at the lease deadline (derived from the stage's measured task time), and any
    stage gradient it held is recomputed once it has been silent that long, so the run finishes
    while it is stopped; resumed, it drops what it held and leaves, and the parameters are exact."""
    relay = serve_relay(
        {
            **pipeline_overrides(BYTE_SPEC, stages=2, microbatches=MICROBATCHES, lease_floor_s=1.0),
            "rounds": {"heartbeat_interval_s": 0.3, "peer_ttl_s": 600.0},
        }
    )
    _, initial = relay_params(relay.url)
    workers = [
        launch_stage_worker(relay.url, f"w{i}", seed=i, until_step=STEPS, extra=("--sleep-per-task", "0.5"))
        for i in range(4)
    ]
    wait_until(lambda: relay.status()["step"] >= 1, 120, "a first step (measured task times)")
    victim = wait_until(
        lambda: next((w for w in workers if w.events() and w.events()[-1]["event"] == "leased"), None),
        60,
        "a worker inside a task",
    )
    os.kill(victim.proc.pid, signal.SIGSTOP)
    try:
        wait_until(
            lambda: requests.get(relay.url + "/api/pipeline", timeout=10).json()["redispatched"] >= 1,
            60,
            "the stuck worker's task re-dispatched",
        )
        # and the run finishes while it is still stopped: whatever stage gradients it held were
        # recomputed once it had been silent past the lease deadline (no wait for the peer TTL)
        wait_until(lambda: relay.status()["step"] >= STEPS, 120, "the last step without the stuck worker")
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
    assert check_exact(relay, BYTE_SPEC, initial, workers, STEPS) <= 1e-5
    assert counted(relay)[-STEPS:] == [[2 * MICROBATCHES] * 2] * STEPS


def test_hostile_results_are_refused_and_the_batch_completes(serve_relay, launch_stage_worker):
    """A worker sending NaN, a wrong shape, token ids out of range, an oversized body or a result
    for a task it does not hold is refused before anything downstream sees it; the relay keeps
    serving and the batch completes with honest workers, exact."""
    relay = serve_relay(pipeline_overrides(BYTE_SPEC, stages=2, microbatches=MICROBATCHES, initial_lease_s=2.0))
    _, initial = relay_params(relay.url)
    hostile = requests.post(
        relay.url + ROUTES["join"], json={"peer_name": "mallory", "protocol": PROTOCOL_VERSION}, timeout=10
    ).json()["peer_id"]
    stage = requests.post(relay.url + ROUTES["pipeline_stage"].format(peer_id=hostile), json={}, timeout=10).json()
    assert stage["stage"] == 0
    work = requests.get(relay.url + ROUTES["pipeline_work"].format(peer_id=hostile), params={"wait": 5}, timeout=30)
    metadata, _ = payloads.decode(work.content, len(work.content))
    task = json.loads(metadata["work"])["tasks"][0]
    assert task["kind"] == "first"
    rows, width = 2 * BYTE_SPEC.kwargs["seq_len"], BYTE_SPEC.kwargs["d_model"]
    tokens = np.zeros((2, BYTE_SPEC.kwargs["seq_len"] + 1), dtype=np.int64)
    good_y = np.zeros((rows, width), dtype=np.float32)

    def send(task_id: str, tensors: dict, headers: dict | None = None) -> requests.Response:
        body = payloads.encode(tensors, {"result": PipelineResult(task_id=task_id).dumps().decode()})
        return requests.put(
            relay.url + ROUTES["pipeline_result"].format(peer_id=hostile, task_id=task_id),
            data=body,
            headers=headers or {},
            timeout=10,
        )

    refusals = [
        (
            send(task["task_id"], {"y": np.full((rows, width), np.nan, dtype=np.float32), "batch": tokens}),
            422,
            "non_finite",
        ),
        (
            send(task["task_id"], {"y": np.zeros((rows, width + 1), dtype=np.float32), "batch": tokens}),
            422,
            "bad_tensor",
        ),
        (send(task["task_id"], {"y": good_y, "batch": tokens + 300}), 422, "bad_batch"),
        (send(task["task_id"], {"y": good_y}), 422, "bad_batch"),
        (send("t999999", {"y": good_y, "batch": tokens}), 410, "task_expired"),
        (
            requests.put(
                relay.url + ROUTES["pipeline_result"].format(peer_id=hostile, task_id=task["task_id"]),
                data=b"x" * (1 << 20),
                timeout=10,
            ),
            413,
            None,
        ),
    ]
    for response, status, code in refusals:
        assert response.status_code == status, response.text
        assert code is None or response.json()["error"] == code, response.text
    pipeline = requests.get(relay.url + "/api/pipeline", timeout=10).json()
    assert pipeline["finished"] == 0 and pipeline["boundary_memory_bytes"] == 0  # nothing of them was kept
    requests.post(relay.url + ROUTES["leave"].format(peer_id=hostile), timeout=10)
    workers = [launch_stage_worker(relay.url, f"w{i}", seed=i, until_step=1) for i in range(2)]
    assert check_exact(relay, BYTE_SPEC, initial, workers, 1) <= 1e-5
    assert counted(relay) == [[2 * MICROBATCHES] * 2]


@pytest.mark.slow  # 25 s; signed whole-vector rounds stay in the default run (tests/test_auth_relay.py)
def test_a_signed_run_trains_exactly(tmp_path, launch_stage_worker, monkeypatch):
    """``auth.mode = "hf"``: every pipeline route is signed (results are streamed containers with
    chunk digests, stage gradients ticketed slices), and the run still equals one process."""
    hub = standin()
    relay = None
    try:
        relay = hf_relay(
            tmp_path, hub, {**pipeline_overrides(BYTE_SPEC, stages=2, microbatches=MICROBATCHES), "limits": {}}
        )
        reader = RelayClient(relay.url)
        reader.login(TOKENS["alice"])
        initial = np.empty(reader.get_run().num_params, dtype=np.float32)
        reader.params.download_params(initial, min_step=0, wait_s=30)
        workers = []
        for i, user in enumerate(("alice", "alice", "bob", "bob")):
            monkeypatch.setenv(f"HF_TOKEN_{user.upper()}", TOKENS[user])
            workers.append(
                launch_stage_worker(
                    relay.url, f"w{i}", seed=i, until_step=2, extra=("--hf-token-env", f"HF_TOKEN_{user.upper()}")
                )
            )
        for worker in workers:
            assert worker.wait(timeout_s=240) == 0, worker.log_path.read_text()[-3000:]
        final = np.empty_like(initial)
        step = reader.params.download_params(final, min_step=2, wait_s=30)
        reference = replay(BYTE_SPEC, initial, accepted_batches(workers), steps=step, microbatches=MICROBATCHES)
        assert relative_difference(final, reference) <= 1e-5
        assert requests.get(relay.url + "/api/pipeline", timeout=10).json()["counted"] == [[8, 8]] * step
    finally:
        if relay is not None:
            relay.stop()
        hub.stop()


@pytest.mark.parametrize("codec", ["int8", pytest.param("float16", marks=pytest.mark.slow)])
def test_lossy_boundaries_and_workers_joining_mid_batch(serve_relay, launch_stage_worker, codec):
    """Boundaries in the run's lossy codec cut the relay's bytes per sample (to about a quarter
    or half of float32's) and still train close to exact; workers that join while a batch is in
    flight get its tasks at their first polls (no barrier), and backward tasks of a worker's own
    forwards come without their input (the worker cached it)."""
    spec = WIDE_BYTE_SPEC  # wide enough that the boundaries' bytes, not the containers' headers, dominate
    relay = serve_relay(pipeline_overrides(spec, stages=2, microbatches=MICROBATCHES, boundary_codec=codec))
    _, initial = relay_params(relay.url)
    steps, slow = 6, ("--sleep-per-task", "0.2")  # long enough that the joiners arrive mid-run
    first = [launch_stage_worker(relay.url, f"w{i}", seed=i, until_step=steps, extra=slow) for i in range(2)]
    wait_until(lambda: relay.status()["step"] >= 1, 120, "a first step")
    joiners = [launch_stage_worker(relay.url, f"j{i}", seed=10 + i, until_step=steps, extra=slow) for i in range(2)]
    workers = first + joiners
    difference = check_exact(relay, spec, initial, workers, steps)
    assert difference <= 0.05, difference
    for joiner in joiners:
        leased = [e for e in joiner.events() if e["event"] == "leased"]
        assert leased, joiner.log_path.read_text()[-2000:]
        # the batch in flight when it joined, or the next one if its stage had nothing left in it
        assert leased[0]["batch"] <= relay_step_when(joiner) + 1, leased[:1]
    assert any(e.get("cached") for w in workers for e in w.events() if e["event"] == "leased")
    pipeline = requests.get(relay.url + "/api/pipeline", timeout=10).json()
    float32_bytes = (
        (5 * 2 - 6) * 4 * spec.kwargs["seq_len"] * spec.kwargs["d_model"]
    )  # docs/pipeline.md's model, K = 2
    assert pipeline["boundary_bytes_per_sample"] < {"int8": 0.4, "float16": 0.62}[codec] * float32_bytes, pipeline
    assert counted(relay) == [[2 * MICROBATCHES] * 2] * steps


def relay_step_when(worker) -> int:
    """The step the relay was at when ``worker`` joined (its first event says)."""
    return next(e["step"] for e in worker.events() if e["event"] == "joined")


@pytest.mark.parametrize(
    "change,names",
    [
        ({"run": {"target_batch": 10, "max_staleness": 0}}, "run.target_batch"),
        ({"run": {"target_batch": 8, "max_staleness": 2}}, "run.max_staleness"),
        (
            {"run": {"target_batch": 8, "max_staleness": 1}, "pipeline": {"check_share": 0.1}},
            "pipeline.check_share needs run.max_staleness = 0",
        ),
        ({"pipeline": {"stages": 5}}, "pipeline.stages = 5"),
        ({"pipeline": {"stages": "auto"}}, "pipeline.worker_memory_mb"),
        ({"pipeline": {"stages": 2, "layers_per_stage": [1, 2]}}, "pipeline.layers_per_stage"),
        ({"pipeline": {"boundary_codec": "bf16"}}, "pipeline.boundary_codec"),
        ({"pipeline": {"boundary_codec": "topk2-64"}}, "topk2-<K> is for run.compression only"),
        ({"run": {"target_batch": 8, "max_staleness": 0, "compression": "topk2-64"}}, "without error feedback"),
        (
            {
                "model": {
                    "factory": "toolkit.models:ByteTransformer",
                    "kwargs": {"d_model": 32, "n_layer": 4, "n_head": 2},
                }
            },
            "tie_embeddings",
        ),
        ({"model": {"factory": "toolkit.models:MLP", "kwargs": {"sizes": [8, 16, 1]}}}, "cannot cut [model]"),
    ],
)
def test_configuration_mistakes_end_in_one_line_before_anything_is_created(tmp_path, change, names):
    """Each mistake is one ConfigError naming the setting, raised while the configuration loads
    (before the data dir, the admin token or a model exists)."""
    sections = pipeline_overrides(BYTE_SPEC, stages=2, microbatches=MICROBATCHES)
    for section, values in change.items():
        sections[section] = {**sections.get(section, {}), **values} if section != "model" else values
    config = merged(sections)
    config["server"] = {**config["server"], "data_dir": str(tmp_path / "data")}
    with pytest.raises(ConfigError) as refused:
        load_config(write_config(tmp_path / "relay.toml", config)).validate()
    assert names in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    assert not (tmp_path / "data").exists()


def test_pipeline_routes_on_a_run_without_a_pipeline_say_so(serve_relay):
    relay = serve_relay()
    response = requests.get(relay.url + ROUTES["pipeline"], timeout=10)
    assert response.status_code == 404 and response.json()["error"] == "no_pipeline"
    assert relay.status()["pipeline"] is None


@pytest.mark.slow  # 32 s; a relay restart's resume is tests/test_collaboration.py's for the whole vector (default)
def test_a_relay_restart_resumes_every_stage(start_relay, launch_stage_worker):
    """SIGKILL the relay mid-run and start it again on its data dir: every stage resumes at the
    step the relay committed last, the workers (re-admitted, asking for a stage again) finish
    the run, and the parameters equal one process on the batches that were counted (the batch in
    flight at the crash is re-run from its first stage)."""
    relay, initial, workers = train(
        start_relay, launch_stage_worker, BYTE_SPEC, stages=2, steps=EXACT_STEPS, extra=("--sleep-per-task", "0.1")
    )
    wait_until(lambda: relay.status()["step"] >= 2, 120, "two steps before the crash")
    relay.kill()
    relay.start()
    for worker in workers:
        assert worker.wait(timeout_s=240) == 0, worker.log_path.read_text()[-3000:]
    step, final = relay_params(relay.url, min_step=EXACT_STEPS)
    batches = accepted_batches(workers, latest=True)  # a crashed batch's micro-batches were read again
    assert (
        relative_difference(final, replay(BYTE_SPEC, initial, batches, steps=step, microbatches=MICROBATCHES)) <= 1e-5
    )
