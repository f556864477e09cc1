"""The training loops people already use, around CollaborativeOptimizer, on a real relay.

The optimizer as a torch.optim.Optimizer citizen (state_dict round trip, the relay's lr in its
param groups, an LR scheduler that changes nothing the relay decides, losses noted by loops that
call step() bare), then one run with four real peer processes, each in a different loop: a plain
loop, HF Trainer, Accelerate and Lightning (tests/loop_peer.py).
"""

from __future__ import annotations

import io
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from toolkit.models import build_model
from toolkit.optimizer import CollaborativeOptimizer

LOOP_PEER = Path(__file__).resolve().parent / "loop_peer.py"
REPO = LOOP_PEER.parent.parent
GPT2_TINY = {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 32}
LOOPS = ("plain", "trainer", "accelerate", "lightning")


def mlp_batch(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return torch.cat([x, x.sum(1, keepdim=True).tanh()], dim=1)


def test_optimizer_is_a_torch_optimizer_citizen(start_relay):
    # Warmup makes the relay's lr depend on the step: 0.02 * (step + 1) / 10.
    relay = start_relay({"run": {"target_batch": 8},
                         "optimizer": {"lr": 0.02, "warmup_steps": 10, "schedule": "constant"}})
    client_model = build_model(_mlp_spec())
    with CollaborativeOptimizer(client_model, relay.url, batch_size_per_step=4, report_interval_s=0.0) as opt:
        assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.002)]
        assert not opt.state  # torch's per-parameter state: empty, never the collaboration's

        # state_dict round trip, through torch.save as Trainer/Accelerate/Lightning checkpoints do
        saved = io.BytesIO()
        torch.save(opt.state_dict(), saved)
        loaded = torch.load(io.BytesIO(saved.getvalue()), weights_only=True)
        loaded["param_groups"][0]["lr"] = 123.0
        opt.load_state_dict(loaded)
        assert opt.param_groups[0]["lr"] == 123.0 and len(opt.param_groups[0]["params"]) == 4
        assert opt.state_dict()["param_groups"][0]["params"] == loaded["param_groups"][0]["params"]
        opt.report_progress()
        assert opt.param_groups[0]["lr"] == pytest.approx(0.002)  # the relay's lr wins at the next sync

        # A torch LR scheduler may write the groups' lr; training goes on, the relay's value returns.
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
        # Losses noted by a loop that calls step() bare: averaged by size, their sizes summed.
        while opt.version < 1:
            batch = mlp_batch(8, seed=opt.version)
            opt.zero_grad()
            client_model.loss(batch).backward()
            opt.note_loss(torch.tensor(2.0), 4)
            opt.note_loss(4.0, 4)
            opt.step()
            scheduler.step()
            assert opt.param_groups[0]["lr"] == pytest.approx(scheduler.get_last_lr()[0])  # the scheduler's, for now
        opt.report_progress()
        assert opt.param_groups[0]["lr"] == pytest.approx(0.004) and opt.contributed_samples == 8
    record = next(r for r in relay.status()["recent_rounds"] if r["step"] == 1)
    assert record["samples"] == 8 and record["loss"] == pytest.approx(3.0)


def test_toolkit_imports_without_the_loop_packages():
    code = ("import sys\n"
            "for name in ('transformers', 'accelerate', 'lightning', 'pytorch_lightning'):\n"
            "    sys.modules[name] = None\n"
            "import toolkit, toolkit.optimizer, toolkit.integrations, toolkit.session\n"
            "try:\n    import toolkit.integrations.hf\nexcept ImportError as e:\n    print('hf:', e)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "collabtrain[hf]" in done.stdout


def test_four_loops_train_one_run_together(start_relay, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    pytest.importorskip("lightning")
    steps = 12
    relay = start_relay({"run": {"target_batch": 32, "total_steps": steps},
                         "model": {"kind": "transformers", "architecture": "AutoModelForCausalLM",
                                   "config": GPT2_TINY},
                         "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.0, "schedule": "constant"}})
    procs = {}
    for i, loop in enumerate(LOOPS):
        work = tmp_path / loop
        work.mkdir()
        procs[loop] = subprocess.Popen(
            [sys.executable, str(LOOP_PEER), "--relay", relay.url, "--name", loop, "--loop", loop, "--seed", str(i),
             "--batch-size", "4", "--wait-peers", str(len(LOOPS)), "--workdir", str(work),
             "--result", str(work / "result.json")],
            stdout=open(work / "log", "w"), stderr=subprocess.STDOUT, cwd=REPO)
    try:
        for loop, proc in procs.items():
            assert proc.wait(timeout=240) == 0, (tmp_path / loop / "log").read_text()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    results = {loop: json.loads((tmp_path / loop / "result.json").read_text()) for loop in LOOPS}
    status = relay.status()
    assert status["finished"] and status["step"] == steps
    with sqlite3.connect(relay.data_dir / "relay.sqlite") as db:
        credited = dict(db.execute("SELECT name, samples_contributed FROM peers").fetchall())
    for loop, result in results.items():
        log = (tmp_path / loop / "log").read_text()[-3000:]
        assert result["finished"] and result["contributed_samples"] > 0, (loop, result, log)
        assert credited.get(loop, 0) > 0, (loop, credited)  # the relay applied and credited its samples
        assert result["losses"] and 0.01 in result["lrs"], (loop, result["lrs"])  # the relay's lr in param_groups
        # Every gradient it sent carried its micro-batches' real loss (about 2 to 4.2 on this data), not 0.
        assert result["uploads"] and all(n > 0 and s / n > 1.0 for n, s in result["uploads"]), (loop, result["uploads"])
    rounds = sorted(relay.status()["recent_rounds"], key=lambda r: r["step"])
    losses = [r["loss"] for r in rounds if r["loss"] is not None]
    assert len(losses) >= steps - 2 and all(loss > 0 for loss in losses), rounds  # the charted loss is real
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses  # and it falls


def _mlp_spec():
    from toolkit.wire.protocol import ModelSpec

    return ModelSpec(factory="toolkit.models:MLP", kwargs={"sizes": [8, 16, 1]})
