"""Learning@home through a real relay: expert hosts and a trainer as separate processes, calls
brokered by the relay (hosts cannot be reached), checked against the in-process reference.

* exactness: relay + 2 hosts + 1 trainer, SGD everywhere, fixed seeds: after the steps every
  expert (from the relay's checkpoints) and every dense parameter (from the relay's state) equals
  the same model trained in one process with :class:`LoopbackCaller` to 1e-5;
* failover: a host SIGKILLed mid-run: the trainer never raises, only the dead host's experts fail,
  a spare host takes them over from their checkpoints, the run reaches its last step;
* hostile hosts: NaN, wrong shapes, oversized results, results for tasks a host does not hold,
  checkpoints for experts it does not lease: refused with a 4xx, the caller sees a failed expert;
* the [moe]/[model] agreement check, on the model's effective values.

How hosts batch and recover: tests/test_moe_hosts.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from relay_server.harness.process import wait_until
from tests.moe_trainer import BATCH, batches
from tests.support.moe import (
    KWARGS,
    LR,
    MOE,
    UIDS,
    Member,
    directory,
    latest_checkpoint,
    one_process_reference,
    overrides,
    run_trainer,
    start_host,
    stop,
    train_with_two_hosts,
)
from tests.support.processes import REPO
from tests.support.training import relay_params
from toolkit.models import DMoEMLP
from toolkit.models.flat import load_flat
from toolkit.moe.calls import ExpertFailed, LoopbackCaller
from toolkit.moe.experts import checkpoint_of, expert_shapes, make_optimizer, restore
from toolkit.moe.remote import RelayExpertCaller
from toolkit.wire import payloads
from toolkit.wire.protocol import ROUTES


def test_two_hosts_and_a_trainer_equal_one_process(serve_relay, tmp_path: Path) -> None:
    steps = 20
    relay = serve_relay(overrides(steps))
    initial, _ = train_with_two_hosts(relay.url, steps, tmp_path)

    reference, experts = one_process_reference(initial, steps)
    _, final = relay_params(relay.url, min_step=steps)
    np.testing.assert_allclose(final, reference, rtol=1e-5, atol=1e-6)
    for uid in UIDS:
        stored = latest_checkpoint(relay.data_dir, uid)
        for name, p in experts[uid].named_parameters():
            np.testing.assert_allclose(
                stored[f"p.{name}"], p.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=f"{uid}.{name}"
            )


def test_four_micro_batches_in_flight_through_join_equal_one_process(serve_relay, tmp_path: Path) -> None:
    """join() with J = 4 (each micro-batch on its own replica, results summed in data order) is
    exactly large-batch SGD over the same micro-batches. The experts are frozen (``[moe]
    optimizer = none``): with learning experts, J > 1 changes the order in which hosts apply the
    backward calls' updates (Learning@home's asynchrony), which no sequential reference has."""
    steps, per_step = 10, 4
    relay = serve_relay(overrides(steps, micro_batches_per_step=per_step, experts_learn=False))
    _, initial = relay_params(relay.url)
    hosts = [start_host(relay.url, f"host{i}", 4, tmp_path / f"host{i}.log") for i in range(2)]
    try:
        wait_until(lambda: len(directory(relay.url)["live"]) == 8, 60, "both hosts to lease 4 experts each")
        outcome = run_trainer(relay.url, steps, 0.0, "--batches", str(steps * per_step), "--in-flight", "4")
    finally:
        stop(hosts)
    assert outcome["final_step"] == steps and outcome["failed_uids"] == {} and outcome["in_flight"] == 4, outcome
    assert outcome["local_steps"] == steps * per_step and outcome["contributed"] == steps * per_step * BATCH

    torch.manual_seed(0)
    model = DMoEMLP(**KWARGS)
    load_flat(model, initial)
    with LoopbackCaller({uid: model.make_expert(uid) for uid in UIDS}) as caller:  # frozen: no optimizer
        model.attach_caller(caller)
        dense = torch.optim.SGD(model.parameters(), lr=LR)
        data = batches(steps * per_step)
        losses = []
        for step in range(steps):
            dense.zero_grad()
            for batch in data[step * per_step : (step + 1) * per_step]:
                loss = model.loss(batch)
                (loss / per_step).backward()  # the mean over the step's samples, as the relay averages
                losses.append(loss.item())
            dense.step()
    np.testing.assert_allclose(outcome["losses"], losses, rtol=1e-5, atol=1e-6)  # the same order, step by step
    _, final = relay_params(relay.url, min_step=steps)
    reference = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    np.testing.assert_allclose(final, reference, rtol=1e-5, atol=1e-6)


def test_learning_experts_with_micro_batches_in_flight_train_and_every_sample_counts(
    serve_relay, tmp_path: Path
) -> None:
    """Learning experts, J = 4: no sequential reference exists (hosts apply the backward calls in
    the order they arrive), but the run must still learn, and the relay must count exactly the
    samples the trainer computed: none overshoots a round or is lost."""
    steps, per_step = 12, 4
    relay = serve_relay(overrides(steps, micro_batches_per_step=per_step))
    hosts = [start_host(relay.url, f"host{i}", 4, tmp_path / f"host{i}.log") for i in range(2)]
    try:
        wait_until(lambda: len(directory(relay.url)["live"]) == 8, 60, "both hosts to lease 4 experts each")
        outcome = run_trainer(
            relay.url, steps, 0.0, "--batches", str(steps * per_step), "--in-flight", "4", "--repeat", str(per_step)
        )
        status = relay.status()
    finally:
        stop(hosts)
    assert outcome["final_step"] == steps and outcome["in_flight"] == 4, outcome
    assert all(layer["failures"] == layer["backward_failures"] == 0 for layer in outcome["layers"])
    computed = outcome["local_steps"] * BATCH
    assert outcome["local_steps"] == steps * per_step and outcome["contributed"] == computed, outcome
    assert sum(entry["samples"] for entry in status["leaderboard"]) == computed, status["leaderboard"]
    first, last = np.mean(outcome["losses"][:per_step]), np.mean(outcome["losses"][-per_step:])
    assert last < 0.7 * first, outcome["losses"]


class FailsOnMarkedBatch(DMoEMLP):
    """The run's model, raising ``error`` on a batch whose first value is :data:`MARK` (in whichever
    worker thread computes it)."""

    MARK = 1234.0

    def __init__(self, error: BaseException, **kwargs) -> None:
        super().__init__(**kwargs)
        self.error = error

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        if batch[0, 0].item() == self.MARK:
            raise self.error
        return super().loss(batch)


def test_micro_batches_in_flight_raise_in_the_cell_and_leave_no_thread_behind(serve_relay, tmp_path: Path) -> None:
    """With J = 4: a worker's out-of-memory error is join's DeviceOutOfMemory (what to do, not a
    traceback), any other exception is raised as it was, an interrupted cell returns its result;
    every time the micro-batch threads and the expert call threads are gone afterwards."""
    from toolkit import join
    from toolkit.errors import DeviceOutOfMemory

    relay = serve_relay(overrides(100, micro_batches_per_step=4))
    hosts = [start_host(relay.url, f"host{i}", 4, tmp_path / f"host{i}.log") for i in range(2)]

    def data(marked_at: int):
        for i, batch in enumerate(batches(12)):
            if i == marked_at:
                batch = batch.clone()
                batch[0, 0] = FailsOnMarkedBatch.MARK
            yield batch

    def interrupted():
        yield from batches(12)[:6]
        raise KeyboardInterrupt  # the volunteer stops the cell while micro-batches are in flight

    def threads_left() -> list[str]:
        return [
            t.name for t in threading.enumerate() if t.name.startswith(("collab-micro-batch", "collab-expert-call"))
        ]

    try:
        wait_until(lambda: len(directory(relay.url)["live"]) == 8, 60, "both hosts to lease 4 experts each")
        for error, expected in (
            (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), DeviceOutOfMemory),
            (ValueError("a bug in the model's loss"), ValueError),
        ):
            model = FailsOnMarkedBatch(error, **KWARGS)
            with pytest.raises(expected) as raised:
                join(relay.url, model=model, data=data(5), batch_size=BATCH, panel="none", moe_in_flight=4)
            assert (
                "out of memory on a micro-batch of 16 samples" in str(raised.value)
                if expected is DeviceOutOfMemory
                else str(raised.value) == "a bug in the model's loss"
            )
            wait_until(lambda: not threads_left(), 30, "the trainer's threads to end")
        result = join(
            relay.url,
            model=FailsOnMarkedBatch(ValueError("unused"), **KWARGS),
            data=interrupted(),
            batch_size=BATCH,
            panel="none",
            moe_in_flight=4,
        )
        assert result.in_flight == 4 and result.local_steps <= 6, result
        wait_until(lambda: not threads_left(), 30, "the trainer's threads to end")
    finally:
        stop(hosts)


def test_a_killed_host_fails_only_its_experts_and_a_spare_takes_them_over(serve_relay, tmp_path: Path) -> None:
    steps = 24
    relay = serve_relay(overrides(steps))
    victim = start_host(relay.url, "victim", 4, tmp_path / "victim.log")
    wait_until(lambda: len(directory(relay.url)["live"]) == 4, 60, "the first host's 4 experts")
    victims = set(directory(relay.url)["live"])
    keeper = start_host(relay.url, "keeper", 4, tmp_path / "keeper.log")
    wait_until(lambda: len(directory(relay.url)["live"]) == 8, 60, "all 8 experts hosted")
    spare = start_host(relay.url, "spare", 8, tmp_path / "spare.log")  # holds nothing until a host dies
    trainer = subprocess.Popen(
        [sys.executable, "tests/moe_trainer.py", relay.url, str(steps), "--sleep", "0.15"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: relay.status()["step"] >= 4, 120, "step 4")
        wait_until(
            lambda: all((relay.data_dir / "experts" / uid).is_dir() for uid in victims),
            30,
            "a checkpoint of every expert of the host about to die",
        )
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        last = {
            uid: int(
                payloads.decode(
                    sorted((relay.data_dir / "experts" / uid).glob("*.safetensors"))[-1].read_bytes(), 1 << 24
                )[0]["updates"]
            )
            for uid in victims
        }
        wait_until(lambda: "victim" not in {p["name"] for p in relay.status()["peers"]}, 30, "the victim's TTL")
        wait_until(lambda: len(directory(relay.url)["live"]) == 8, 10, "the spare to take over the orphans")
        out, err = trainer.communicate(timeout=240)
        assert trainer.returncode == 0, err[-3000:]
    finally:
        trainer.kill()
        stop([keeper, spare])
    outcome = json.loads(out.strip().splitlines()[-1])
    # the run reaches its last step and the trainer never raised; the trainer may leave before it
    # downloads the version its last batch made (a round still in flight when its data ran out)
    wait_until(lambda: relay.status()["step"] >= steps, 30, "the run's last step")
    assert outcome["final_step"] >= steps - 1, outcome
    assert set(outcome["failed_uids"]) <= victims, (outcome["failed_uids"], victims)
    spare_log = (tmp_path / "spare.log").read_text()
    resumed = {
        uid for uid in victims if f"expert {uid} resumed from its checkpoint ({last[uid]} updates)" in spare_log
    }
    assert resumed == victims, (last, spare_log[-2000:])  # exactly the dead host's last checkpoints


def test_checkpoint_round_trip_restores_parameters_and_optimizer_state_exactly() -> None:
    spec = {"expert": MOE["expert"], "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}, "seed": 0}
    shapes = expert_shapes(spec["expert"])
    source = DMoEMLP(**KWARGS).make_expert("ffn0.1.0")
    optimizer = make_optimizer(spec["optimizer"], source)
    for _ in range(3):
        source(torch.randn(5, 8)).square().sum().backward()
        optimizer.step()
    body = checkpoint_of(source, optimizer, updates=3)
    copy = DMoEMLP(**KWARGS).make_expert("ffn1.1.1")
    copy_opt = make_optimizer(spec["optimizer"], copy)
    assert restore(copy, copy_opt, body, shapes) == 3
    for (name, a), (_, b) in zip(source.named_parameters(), copy.named_parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(source.parameters(), copy.parameters()):
        assert torch.equal(optimizer.state[a]["momentum_buffer"], copy_opt.state[b]["momentum_buffer"])


def test_hostile_results_and_checkpoints_are_refused_and_the_caller_sees_a_failure(serve_relay) -> None:
    from toolkit.errors import RelayRejected

    relay = serve_relay(overrides(0))
    mallory, bob, alice = Member(relay.url, "mallory"), Member(relay.url, "bob"), Member(relay.url, "alice")
    caller = RelayExpertCaller(alice.client, alice.peer_id)
    try:
        held = mallory.request("POST", "moe_lease", params={"capacity": 8}).json()["uids"]
        assert sorted(held) == sorted(UIDS)
        x = torch.randn(3, 8)
        rows = x.shape[0]
        bad_results = {
            "NaN": (payloads.encode({"y": np.full((rows, 8), np.nan, np.float32)}), "non_finite"),
            "wrong shape": (payloads.encode({"y": np.zeros((rows * 2, 4), np.float32)}), "bad_tensor"),
            "oversized": (payloads.encode({"y": np.zeros((rows * 1000, 8), np.float32)}), "body_too_large"),
            "wrong name": (payloads.encode({"z": np.zeros((rows, 8), np.float32)}), "bad_tensor"),
            "trailing bytes": (payloads.encode({"y": np.zeros((rows, 8), np.float32)}) + b"{}", "bad_body"),
        }
        for what, (body, code) in bad_results.items():
            call = caller.forward("ffn0.0.0", x)
            task = _next_task(mallory)
            with pytest.raises(RelayRejected) as refused:
                mallory.request("PUT", "moe_result", task_id=task.task_id, data=body)
            assert (refused.value.status, refused.value.code) == (422, code), (what, refused.value)
            with pytest.raises(ExpertFailed) as failed:
                call.result(timeout=30)
            assert failed.value.code == "bad_result", what  # a failed expert for the trainer, never garbage

        # A result for a task this host does not hold: another host's, or one that ended.
        call = caller.forward("ffn0.0.1", x)
        task = _next_task(mallory)
        good = payloads.encode({"y": np.ones((rows, 8), np.float32)})
        with pytest.raises(RelayRejected) as not_held:
            bob.request("PUT", "moe_result", task_id=task.task_id, data=good)
        assert (not_held.value.status, not_held.value.code) == (409, "not_your_task")
        mallory.request("PUT", "moe_result", task_id=task.task_id, data=good)
        assert torch.equal(call.result(timeout=30), torch.ones(rows, 8))  # the honest answer got through
        with pytest.raises(RelayRejected) as again:
            mallory.request("PUT", "moe_result", task_id=task.task_id, data=good)
        assert again.value.status in (409, 410)

        # Checkpoints: only for leased experts, only finite tensors of the expert's shapes.
        shapes = expert_shapes(MOE["expert"])
        zeros = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
        with pytest.raises(RelayRejected) as not_leased:
            bob.request("PUT", "moe_checkpoint", uid="ffn0.0.0", data=payloads.checkpoint_body(zeros, {}, 1))
        assert (not_leased.value.status, not_leased.value.code) == (403, "not_your_expert")
        poisoned = dict(zeros, **{"up.weight": np.full(shapes["up.weight"], np.inf, np.float32)})
        with pytest.raises(RelayRejected) as non_finite:
            mallory.request("PUT", "moe_checkpoint", uid="ffn0.0.0", data=payloads.checkpoint_body(poisoned, {}, 1))
        assert (non_finite.value.status, non_finite.value.code) == (422, "non_finite")
        assert not (relay.data_dir / "experts" / "ffn0.0.0").exists()  # nothing stored
        with pytest.raises(RelayRejected) as unknown:
            caller.client.transport.request(
                "PUT",
                ROUTES["moe_call"].format(peer_id=alice.peer_id, uid="../../etc"),
                params={"kind": "forward", "call_id": "x1"},
                data=payloads.call_body(x.numpy()),
            )
        assert unknown.value.status == 404
    finally:
        caller.close()
        for member in (mallory, bob, alice):
            member.close()


def _next_task(host: Member) -> dict:
    for _ in range(50):
        response = host.request("GET", "moe_tasks", params={"wait": 1})
        if response.status_code == 200:
            batch = payloads.read_task_batch(response.content, 1 << 20, 8)
            assert len(batch) == 1
            return batch[0][0]
    raise TimeoutError("no task reached the host")


def test_expert_calls_are_signed_end_to_end_in_a_login_run(start_relay, hf_standin, tmp_path: Path) -> None:
    """hf mode: the host logs in with its token; calls, tasks, results and checkpoints are small
    tensor bodies signed whole, and the trainer gets the expert's exact output."""
    hf_standin.add_user("hf_host_token_1234567", "hosting-volunteer")
    hf_standin.add_user("hf_trainer_token_12345", "training-volunteer")
    big = {
        **overrides(0),
        "auth": {
            "mode": "hf",
            "hf_endpoint": hf_standin.url,
            "allow_users": ["hosting-volunteer", "training-volunteer"],
        },
    }
    # Experts of 74k parameters: a checkpoint (296 KB) is larger than any whole-signed request.
    big["moe"] = {**MOE, "expert": {"kind": "ffn", "d": 8, "hidden": 4096}}
    big["model"] = {**big["model"], "kwargs": {**KWARGS, "expert_hidden": 4096}}
    relay = start_relay(big)
    host = subprocess.Popen(
        [sys.executable, "-m", "toolkit.moe.host", "--relay", relay.url, "--capacity", "8"],
        cwd=REPO,
        env={**os.environ, "HF_TOKEN": "hf_host_token_1234567"},
        stdout=open(tmp_path / "host.log", "w"),
        stderr=subprocess.STDOUT,
    )
    trainer = Member(relay.url, "trainer", token="hf_trainer_token_12345")
    caller = RelayExpertCaller(trainer.client, trainer.peer_id)
    try:
        wait_until(lambda: len(caller.live()) == 8, 60, "the host's 8 experts")
        x = torch.randn(4, 8)
        y = caller.forward("ffn1.0.1", x).result(timeout=30)
        expected = DMoEMLP(**{**KWARGS, "expert_hidden": 4096}).make_expert("ffn1.0.1")(x)
        torch.testing.assert_close(y, expected.detach(), rtol=1e-5, atol=1e-6)
    finally:
        caller.close()
        trainer.close()
        stop([host])
    stored = latest_checkpoint(relay.data_dir, "ffn1.0.1")  # the final checkpoint, streamed and digest-checked
    assert stored["p.up.weight"].shape == (4096, 8)
    torch.testing.assert_close(
        torch.from_numpy(stored["p.up.weight"]),
        DMoEMLP(**{**KWARGS, "expert_hidden": 4096}).make_expert("ffn1.0.1").up.weight.detach(),
    )
    newest = sorted((relay.data_dir / "experts" / "ffn1.0.1").glob("*.safetensors"))[-1]
    assert newest.stat().st_size > 256 * 1024  # more than one whole-signed request may carry
    assert "hosting-volunteer" in relay.log_path.read_text()
    assert "hf_host_token" not in relay.log_path.read_text() + (tmp_path / "host.log").read_text()


def test_join_as_expert_host_serves_and_the_panel_says_what_it_hosts(start_relay) -> None:
    from toolkit import join

    class Recorder:
        def __init__(self) -> None:
            self.seen, self.closed = [], False

        def update(self, progress) -> None:
            self.seen.append(dict(progress.rows()))

        def close(self) -> None:
            self.closed = True

    relay = start_relay(overrides(0))
    panel = Recorder()
    result = {}
    worker = threading.Thread(
        target=lambda: result.update(
            r=join(relay.url, role="expert_host", capacity=3, max_seconds=6, panel=panel, peer_name="nb")
        )
    )
    worker.start()
    wait_until(lambda: len(directory(relay.url)["live"]) == 3, 60, "the notebook's 3 experts")
    trainer = Member(relay.url, "trainer")
    caller = RelayExpertCaller(trainer.client, trainer.peer_id)
    try:
        uid = directory(relay.url)["live"][0]
        caller.forward(uid, torch.randn(2, 8)).result(timeout=30)
    finally:
        caller.close()
        trainer.close()
    worker.join(60)
    assert result["r"].local_steps >= 1 and panel.closed
    hosting = panel.seen[-1]["you host"]
    assert hosting.startswith("3 experts (") and "tasks served" in hosting, hosting
    assert "your contribution" not in panel.seen[-1]  # a host trains nothing
    wait_until(lambda: directory(relay.url)["live"] == [], 5, "the experts handed back (leave, then a tick)")


@pytest.mark.parametrize("codec", ["float16", "int8"])
def test_activation_codecs_carry_exactly_the_codec_round_trip(serve_relay, tmp_path: Path, codec: str) -> None:
    """[moe] codec: x, dy, y and dx travel in float16 or int8 (the run's compression codecs) and the
    expert computes in float32: the answers equal the codec round trip of each tensor computed in
    this process (so the relay neither alters nor re-encodes anything), the bodies shrink, and a
    call in another encoding is refused."""
    from toolkit.errors import RelayRejected
    from toolkit.wire.compression import get_codec

    wire = get_codec(codec)

    def q(t: torch.Tensor) -> torch.Tensor:  # what the far side reads of t
        rows = payloads.encode_rows("t", t.detach().numpy(), wire)
        return torch.from_numpy(payloads.read_rows(rows, "t", None, t.shape[1], wire))

    relay = serve_relay({**overrides(0), "moe": {**MOE, "codec": codec}})
    host = start_host(relay.url, "host", 8, tmp_path / "host.log")
    trainer = Member(relay.url, "trainer")
    caller = RelayExpertCaller(trainer.client, trainer.peer_id)
    try:
        wait_until(lambda: len(caller.live()) == 8, 60, "the host's experts")
        x, dy = torch.randn(16, 8), torch.randn(16, 8)
        expert = DMoEMLP(**KWARGS).make_expert("ffn0.1.1")
        y = caller.forward("ffn0.1.1", x).result(timeout=30)
        torch.testing.assert_close(y, q(expert(q(x))), rtol=1e-5, atol=1e-6)
        x_seen = q(x).requires_grad_(True)
        expert(x_seen).backward(q(dy))  # the host's dx, before its SGD step changes the expert
        dx = caller.backward("ffn0.1.1", x, dy).result(timeout=30)
        torch.testing.assert_close(dx, q(x_seen.grad), rtol=1e-5, atol=1e-6)
        assert len(payloads.call_body(x.numpy(), codec=wire)) < 0.6 * len(payloads.call_body(x.numpy()))
        with pytest.raises(RelayRejected) as wrong:  # float32 on a run that pins another codec
            trainer.request(
                "PUT",
                "moe_call",
                uid="ffn0.1.1",
                params={"kind": "forward", "call_id": "raw1"},
                data=payloads.call_body(x.numpy()),
                headers={"Content-Type": "application/octet-stream"},
            )
        assert wrong.value.status == 400 and codec in wrong.value.hint
    finally:
        caller.close()
        trainer.close()
        stop([host])


def test_the_mixture_agreement_check_compares_effective_values() -> None:
    """[moe] and the model's kwargs are compared on what the model will run with: a kwarg left
    out is the model class's default (DMoEMLP's k is 4), refused in one line naming the field."""
    from relay_server.core.config import ConfigError, load_config
    from relay_server.core.training_config import ModelSection
    from relay_server.moe.moe_config import MoeSection

    without_k = {key: value for key, value in KWARGS.items() if key != "k"}
    with pytest.raises(ConfigError) as refused:
        load_config(
            None,
            env={},
            overrides={**overrides(1), "model": {"factory": "toolkit.models:DMoEMLP", "kwargs": without_k}},
        )
    message = str(refused.value)
    assert "\n" not in message and "model.kwargs.k = 4 (the default of DMoEMLP)" in message and "says 2" in message
    load_config(None, env={}, overrides=overrides(1))  # the same mixture on both sides loads

    # The language model is checked by name (its class may come with another branch of the toolkit).
    lm = ModelSection(factory="toolkit.models:DMoEByteLM", kwargs={**without_k, "k": 3})
    [(holds, line)] = MoeSection(**MOE)._model_checks(lm)
    assert not holds and "model.kwargs.k = 3" in line
    [(holds, line)] = MoeSection(**{**MOE, "enabled": False})._model_checks(lm)
    assert not holds and "DMoEByteLM needs [moe] enabled = true" in line
