"""The figures ``/api/status`` and every heartbeat answer give are the relay's own (issue 35).

A DMoE run's dashboard once showed 32,574 samples/s, the sum of its peers' self-reports, while its
rounds applied 0.8: the collaboration's samples/s is now what the relay's rounds applied over the
time they took, and a peer's self-report is listed as such, capped where the peer's own progress
reports make it implausible. Peers are listed in their role. (The browser's view of the same
figures on a real DMoE run: tests/test_dashboard.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import requests
import torch

from relay_server.collaboration.status import RunFigures, collab_state, peer_status, run_summary
from relay_server.core.config import RelayConfig
from relay_server.harness.process import wait_until
from relay_server.pipeline.figures import (
    MAX_CREDITED,
    PipelineFigures,
    WasteTotals,
    batch_eta_s,
    tasks_per_batch,
)
from relay_server.pipeline.ledger import Ledger
from relay_server.rounds.peer_registry import Peer, Registry
from relay_server.rounds.throughput import measured_samples_per_s
from tests.support.peers import OVERRIDES, SAMPLES, RawPeer
from toolkit.wire.protocol import PROTOCOL_VERSION, BatchProgress, WastedWork, WorkerCredit

ABSURD = 5e6  # samples/s: what a peer with a broken clock (or a liar) may claim; the schema allows up to 1e7


def run_rounds(relay, peer: RawPeer, rounds: int) -> None:
    """``rounds`` real rounds of SAMPLES samples each, every heartbeat claiming ABSURD samples/s."""
    num_params = relay.status()["num_params"]
    for step in range(rounds):
        answer = peer.heartbeat(SAMPLES, version=step, samples_per_s=ABSURD)
        assert answer.ok, answer.text
        wait_until(lambda: relay.status()["round"], 30, f"round {step}")
        grad = np.full(num_params, 0.001, np.float32)
        upload = peer.upload(peer.container(grad, peer.meta(step=step, version=step, samples=SAMPLES)), step=step)
        assert upload.ok, upload.text
        wait_until(lambda: relay.status()["step"] > step, 30, f"step {step + 1}")


def test_samples_per_s_is_what_the_rounds_applied_not_what_peers_claim(serve_relay) -> None:
    relay = serve_relay(OVERRIDES)
    peer = RawPeer(relay).join("braggart")
    run_rounds(relay, peer, 4)
    status = relay.status()
    rounds = status["recent_rounds"]
    assert [r["samples"] for r in rounds] == [SAMPLES] * 4
    # 3 rounds' samples after the first round's end, over at least the time they took (longer once idle)
    rounds_rate = 3 * SAMPLES / (rounds[-1]["finalized_at"] - rounds[0]["finalized_at"])
    assert status["samples_per_s_rounds"] == 3
    assert 0 < status["samples_per_s"] <= rounds_rate * 1.000001, (status["samples_per_s"], rounds_rate)
    state = peer.heartbeat(0, version=4, samples_per_s=ABSURD).json()  # what the peers' panels show
    assert 0 < state["samples_per_s"] <= rounds_rate * 1.000001
    # The claim is listed as the peer's own, cut to 10x what its reports' growth (40 samples) makes plausible.
    (me,) = status["peers"]
    assert me["role"] == "trainer" and me["samples_per_s_capped"] is True
    assert 0 < me["samples_per_s"] < ABSURD
    assert status["reported_samples_per_s"] == pytest.approx(me["samples_per_s"])


def test_an_expert_host_is_listed_as_a_host_without_a_trainers_figures(serve_relay) -> None:
    """A host joins saying so (``toolkit.moe.host`` does): no device "unknown", no samples/s."""
    relay = serve_relay(OVERRIDES)
    joined = requests.post(
        relay.url + "/api/peers/join",
        timeout=10,
        json={"peer_name": "gpu-box", "protocol": PROTOCOL_VERSION, "device": {"role": "expert_host"}},
    ).json()
    requests.post(
        f"{relay.url}/api/peers/{joined['peer_id']}/heartbeat",
        timeout=10,
        json={"version": 0, "samples": 0, "samples_per_s": 123.0},
    ).raise_for_status()
    (host,) = relay.status()["peers"]
    assert (host["role"], host["device"], host["samples_per_s"], host["experts_hosted"]) == ("expert_host", "", 0.0, 0)
    assert relay.status()["reported_samples_per_s"] == 0.0


def test_a_stalled_run_s_measured_rate_falls_with_the_wait() -> None:
    """Five rounds of 10 samples in 10 s: 5 samples/s while rounds keep coming; once none finished
    for longer than those rounds took, the wait counts (20 s idle: 50 samples over 20 s)."""
    points = [(100.0 + 2 * i, 10) for i in range(6)]
    assert measured_samples_per_s(points) == (pytest.approx(5.0), 5)
    assert measured_samples_per_s(points, now=112.0)[0] == pytest.approx(5.0)
    assert measured_samples_per_s(points, now=130.0)[0] == pytest.approx(2.5)
    assert measured_samples_per_s(points[:1]) == (None, 0)


# --- a pipeline run's figures: the relay's own counts (its step is a batch of tasks, not a round) -----


def test_a_batch_counts_each_stage_pass_once_and_a_recomputed_gradient_again_when_redone() -> None:
    """3 stages, 2 micro-batches: 2 x (2 x 3 - 1) = 10 tasks, each accepted result one more done;
    a holder that left un-does its stage gradient until the redo's result is accepted."""
    ledger = Ledger(batch=0, version=0, num_stages=3, first_id=0, count=2)
    total, pending, done = tasks_per_batch(2, 3), ledger.start(), 0
    assert total == 10 and ledger.tasks_done == 0
    while pending:
        step = pending.pop(0)
        following = ledger.accept(step, "w", rows=4, loss_sum=1.0)
        done += 1
        assert ledger.tasks_done == done, step
        if following is not None:
            pending.append(following)
    assert done == total and ledger.complete
    (redo,) = ledger.orphan("w", only=(1, {0}))
    assert ledger.tasks_done == total - 1
    assert ledger.accept(redo, "v") is None
    assert ledger.tasks_done == total


def test_worker_credits_and_wasted_work_per_batch_are_counted_where_they_happen() -> None:
    figures = PipelineFigures()
    for worker in ("a", "a", "a", "b"):
        figures.task_accepted(worker)
    figures.batch_committed({"a": 8, "b": 4})
    figures.batch_committed({"a": 8})
    assert figures.credit("a", 0) == WorkerCredit(peer_id="a", stage=0, tasks=3, samples=16)
    assert figures.credit("b") == WorkerCredit(peer_id="b", tasks=1, samples=4)
    assert figures.credit("nobody") == WorkerCredit(peer_id="nobody")
    # wasted work: the run's counters' growth over each batch
    first = WasteTotals(redispatched=2, recomputed=1, refused=0)
    assert figures.wasted_since(0, first) == WastedWork(batch=0, redispatched=2, recomputed=1)
    figures.batch_over(0, first)
    assert figures.wasted_since(1, first) == WastedWork(batch=1)
    figures.batch_over(1, WasteTotals(redispatched=5, recomputed=1, refused=3))
    assert figures.wasted == [
        WastedWork(batch=0, redispatched=2, recomputed=1, refused=0),
        WastedWork(batch=1, redispatched=3, recomputed=0, refused=3),
    ]
    resumed = PipelineFigures()  # a restarted relay: the samples the store credited, tasks from zero
    resumed.resume({"a": 16, "gone": 0})
    assert resumed.credit("a") == WorkerCredit(peer_id="a", samples=16) and "gone" not in resumed.credits
    # the credits of workers that left are kept for the most recent MAX_CREDITED (a leaving worker asks for its own)
    for i in range(MAX_CREDITED):
        figures.task_accepted(f"w{i}")
    assert figures.credit("a").tasks == 0 and figures.credit(f"w{MAX_CREDITED - 1}").tasks == 1


def test_a_batch_s_eta_is_the_measured_batch_time_left_by_tasks_and_by_time() -> None:
    assert batch_eta_s(None, 0, 12, None) is None  # no batch measured yet: no ETA, not a guess
    assert batch_eta_s(30.0, 0, 12, None) == 30.0  # not begun: a whole batch
    assert batch_eta_s(30.0, 6, 12, 10.0) == 20.0  # half the tasks in a third of the time: the time left
    assert batch_eta_s(30.0, 6, 12, 25.0) == 15.0  # slow so far: the tasks left at the measured pace
    assert batch_eta_s(30.0, 12, 12, 29.0) == pytest.approx(1.0)  # every task done: the round's upload
    assert batch_eta_s(30.0, 12, 12, 40.0) == 0.0


def test_a_feature_s_figures_stand_in_for_the_rounds_in_status_and_progress() -> None:
    """The pipeline's figures (:class:`RunFigures`): the progress and its ETA go to every peer's
    progress answer, each worker's credit to its row, the mode to the configuration."""
    config, registry = RelayConfig(), Registry(60.0)
    peer = registry.add(Peer(peer_id="p" * 32, name="w0", username="anonymous:w0", device={}, precision=None))
    figures = RunFigures(
        mode="pipeline",
        progress=BatchProgress(unit="tasks", done=5, total=12, eta_s=17.5),
        samples_accumulated=4,
        credit=lambda peer_id: (7, 16),
    )
    state = collab_state(registry, config.run, 3, None, False, samples_per_s=2.0, figures=figures)
    assert (state.samples_accumulated, state.eta_s, state.samples_per_s) == (4, 17.5, 2.0)
    plain = collab_state(registry, config.run, 3, None, False, samples_per_s=2.0)
    assert (plain.samples_accumulated, plain.eta_s) == (0, config.run.target_batch / 2.0)
    row = peer_status(peer, peer.joined_at, figures.peer_role, figures.credit(peer.peer_id))
    assert (row.role, row.samples_contributed, row.tasks_done, row.samples_per_s) == ("stage_worker", 16, 7, 0.0)
    assert peer_status(peer, peer.joined_at).tasks_done is None
    assert run_summary(config, 10, figures.mode).mode == "pipeline"
    assert run_summary(config, 10).mode == "sync"


def test_step_metrics_of_a_pipeline_run_carry_its_traffic_and_no_plan() -> None:
    """W&B's row comes from the same status: a pipeline run (no averaging plan) logs no plan
    figures, and its bytes per sample include the stage parameters and gradients."""
    from relay_server.observers.events import StepEvent
    from relay_server.observers.wandb_observer import step_metrics
    from toolkit.wire.protocol import RoundRecord, RunSummary, StatusReport, TrafficStatus

    record = RoundRecord(
        step=4, contributors=4, samples=8, loss=2.0, duration_s=3.0, deadline_s=0.0, finalized_by="pipeline"
    )
    summary = RunSummary(
        model="m", num_params=10, optimizer="sgd", lr=0.1, schedule="constant", target_batch=8,
        max_staleness=0, precision=None, compression="none", auth_mode="open", mode="pipeline",
    )  # fmt: skip
    status = StatusReport(
        run_name="r", step=4, total_steps=0, finished=False, target_batch=8, num_params=10, samples_accumulated=0,
        samples_per_s=2.0, eta_s=3.0, loss=2.0, num_peers=4, peers=[], recent_rounds=[record], round=None,
        auth_mode="open", uptime_s=9.0, plan=None, config=summary,
        traffic=TrafficStatus(up_bytes=800, down_bytes=1600, samples=32, up_bytes_per_sample=25.0,
                              down_bytes_per_sample=50.0),
        progress=BatchProgress(unit="tasks", done=0, total=12, eta_s=3.0),
    )  # fmt: skip
    row = step_metrics(StepEvent(step=4, record=record, status=status, state_path=None), RelayConfig())
    assert not any(key.startswith("plan/") for key in row)
    assert (row["bytes_per_sample/up"], row["bytes_per_sample/down"], row["samples_per_s"]) == (25.0, 50.0, 2.0)


def test_a_pipeline_run_s_status_and_its_volunteers_results_are_the_relay_s_counts(serve_relay) -> None:
    """Two volunteers' ``join()`` (stage workers, one per stage, on their own threads) for 3
    steps: each one's result reports the samples the relay credited it (its leaderboard entry,
    not 0), ``/api/status`` names the mode, has no averaging plan, counts the batch in tasks,
    lists each worker's credited tasks and samples, and its traffic is the pipeline's bytes by
    kind (stage parameters and gradients included), per sample of the committed batches."""
    import threading

    from tests.support.pipeline import pipeline_overrides
    from tests.support.pipeline_models import BYTE_SPEC
    from toolkit.session import join

    relay = serve_relay(pipeline_overrides(BYTE_SPEC, stages=2))
    spec = relay.status()["config"]
    assert spec["mode"] == "pipeline"

    def data(seed: int):
        g = torch.Generator().manual_seed(seed)
        while True:
            yield torch.randint(0, 256, (2, BYTE_SPEC.kwargs["seq_len"] + 1), generator=g)

    results: dict[str, object] = {}

    def volunteer(name: str, seed: int) -> None:
        results[name] = join(relay.url, peer_name=name, max_steps=3, data=data(seed), panel="none")

    threads = [threading.Thread(target=volunteer, args=(f"v{i}", i)) for i in range(2)]
    for thread in threads:
        thread.start()
    status = relay.wait_for(
        lambda s: s["step"] >= 2 and len(s["peers"]) == 2, timeout_s=180, what="two steps with both volunteers"
    )
    pipe = requests.get(relay.url + "/api/pipeline", timeout=10).json()
    assert status["plan"] is None and status["config"]["mode"] == "pipeline"
    assert status["progress"]["unit"] == "tasks" and status["progress"]["total"] == 4 * (2 * 2 - 1)
    assert pipe["tasks_total"] == status["progress"]["total"]
    assert 0 <= status["progress"]["done"] <= status["progress"]["total"]
    for peer in status["peers"]:  # credited as the leaderboard credits: samples of the stage gradients delivered
        assert peer["role"] == "stage_worker" and peer["samples_contributed"] > 0 and peer["tasks_done"] > 0
    for thread in threads:
        thread.join(timeout=180)
    assert not any(thread.is_alive() for thread in threads)

    def traffic_is_the_pipeline_s() -> bool:  # both read once the volunteers left (status is cached up to 1 s)
        traffic = relay.status()["traffic"]
        parts = requests.get(relay.url + "/api/pipeline", timeout=10).json()["traffic"]
        return (
            traffic["up_bytes"] == parts["boundaries_up"] + parts["stage_gradients_up"] > 0
            and traffic["down_bytes"] >= parts["boundaries_down"] + parts["stage_params_down"] > 0
            and parts["stage_gradients_up"] > 0
            and parts["stage_params_down"] > 0
        )

    wait_until(traffic_is_the_pipeline_s, 10, "status's traffic to be the pipeline's bytes")
    pipe = requests.get(relay.url + "/api/pipeline", timeout=10).json()
    assert relay.status()["traffic"]["up_bytes_per_sample"] > pipe["boundary_bytes_per_sample"]  # gradients count too
    board = {entry["username"]: entry["samples"] for entry in relay.status()["leaderboard"]}
    for name, result in results.items():
        assert result.contributed_samples == board[f"anonymous:{name}"] > 0, (name, result, board)
    assert relay.status()["peers"] == []  # they left; their credit was asked for before or after, the same


def test_a_restarted_relay_credits_each_stage_worker_what_its_leaderboard_entry_says(
    start_relay, launch_stage_worker
) -> None:
    """SIGKILL the relay of a pipeline run and start it again: the workers carry on, and each
    one's contributed samples (its dashboard row, and the credit its ``join()`` result reports)
    still equal its leaderboard entry, which the store kept: the count does not start again at 0."""
    from tests.support.pipeline import pipeline_overrides
    from tests.support.pipeline_models import BYTE_SPEC

    relay = start_relay(pipeline_overrides(BYTE_SPEC, stages=2))
    workers = [
        launch_stage_worker(relay.url, f"w{i}", seed=i, until_step=1_000_000, extra=("--sleep-per-task", "0.05"))
        for i in range(2)
    ]
    before = relay.wait_for(lambda s: s["step"] >= 2 and len(s["peers"]) == 2, timeout_s=180, what="two steps")
    relay.kill()
    relay.start()
    relay.wait_for(lambda s: s["step"] >= before["step"] + 2, timeout_s=240, what="two steps after the restart")

    def agree() -> bool:
        status = relay.status()
        board = {entry["username"]: entry["samples"] for entry in status["leaderboard"]}
        rows = {peer["username"]: peer["samples_contributed"] for peer in status["peers"]}
        return len(rows) == 2 and rows == {user: board.get(user) for user in rows}

    wait_until(agree, 60, "each worker's contributed samples to equal its leaderboard entry")
    earlier = {entry["username"]: entry["samples"] for entry in before["leaderboard"]}
    after = {peer["username"]: peer["samples_contributed"] for peer in relay.status()["peers"]}
    for user, samples in after.items():  # counted on from the store's figure, not again from 0
        assert samples > earlier.get(user, 0) > 0, (user, samples, earlier)
    for worker in workers:  # what its join() result will report: the relay's credit, asked by the worker
        (joined,) = [e for e in worker.events() if e["event"] == "joined"]
        route = f"{relay.url}/api/pipeline/workers/{joined['peer_id']}/credit"

        def credit_and_board() -> tuple[int, int]:
            board = {entry["username"]: entry["samples"] for entry in relay.status()["leaderboard"]}
            return requests.get(route, timeout=10).json()["samples"], board[f"anonymous:{worker.name}"]

        credit, board_samples = wait_until(
            lambda: (pair := credit_and_board())[0] == pair[1] and pair,
            60,
            f"{worker.name}'s credit to equal its board",
        )  # the pair read when they agreed: the run goes on, so a later read may straddle a commit
        assert credit == board_samples > earlier[f"anonymous:{worker.name}"], (worker.name, credit, board_samples)
