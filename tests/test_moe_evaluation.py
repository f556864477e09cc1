"""``[evaluation]`` on a ``[moe]`` run scores the whole model: the relay's dense version and its
own copies of the experts (their checkpoints on the relay's disk).

End to end: a real relay (in this process), two expert host processes and a trainer process
train the DMoE language model a few steps; the relay's expert checkpoints are set up front to
weights no expert starts from (and ``[moe] optimizer = "none"`` keeps them), so a score made
with fresh experts, or without them, cannot pass. The record the relay shows in ``/api/status``
must equal the loss a separate process computes on the same held-out data from the version's
state file and the checkpoint files, with the mixtures as local modules
(:class:`~toolkit.moe.LocalMixtureOfExperts`), to 1e-5.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from relay_server.harness import zygote
from relay_server.harness.process import wait_until
from relay_server.moe.checkpoints import CHECKPOINTS_DIR, CheckpointStore
from tests.support.evaluation import VALIDATION
from tests.support.moe import MOE, UIDS, directory, lm_run, start_host, stop
from tests.support.processes import REPO
from toolkit.moe.experts import build_expert, checkpoint_of

STEPS = 3


def seed_checkpoints(data_dir: Path) -> None:
    """Every expert's checkpoint on the relay: its initial weights plus noise (what hosts resume from)."""
    store = CheckpointStore(data_dir / CHECKPOINTS_DIR, keep=3)
    noise = torch.Generator().manual_seed(7)
    for uid in UIDS:
        module = build_expert(MOE["expert"], uid, MOE["seed"])
        with torch.no_grad():
            for p in module.parameters():
                p.add_(torch.randn(p.shape, generator=noise) * 0.3)
        store.save(uid, checkpoint_of(module, None, updates=5))


def reference_loss(config_path: str, state_path: str) -> float:
    """(In a separate process.) The version's dense parameters and the relay's expert checkpoints
    as a decoder with local mixtures, scored on the run's validation batches."""
    from relay_server.core.config import load_config
    from relay_server.observers.eval_model import (
        run_tokenizer,
        score,
        validation_batches,
    )
    from relay_server.observers.pretrained import master_params
    from tests.test_moe_lm import local_reference
    from toolkit.models import build_model
    from toolkit.models.flat import load_flat
    from toolkit.wire import payloads

    config = load_config(config_path)
    model = build_model(config.model.spec())
    load_flat(model, master_params(Path(state_path)))
    experts = {}
    for uid in model.expert_uids():
        newest = sorted((Path(config.server.data_dir) / CHECKPOINTS_DIR / uid).glob("*.safetensors"))[-1]
        tensors = payloads.decode(newest.read_bytes(), 1 << 24)[1]
        experts[uid] = model.make_expert(uid)
        experts[uid].load_state_dict(
            {name[2:]: torch.from_numpy(a) for name, a in tensors.items() if name.startswith("p.")}
        )
    reference = local_reference(model, experts).eval()
    return score(reference, validation_batches(config, run_tokenizer(config)), "causal-lm")["loss"]


def test_a_moe_runs_evaluation_equals_a_separate_process(serve_relay, demo_tokenizer: Path, tmp_path: Path) -> None:
    seed_checkpoints(tmp_path / "relay-data")
    held_out = tmp_path / "validation.txt"
    held_out.write_text("\n".join(VALIDATION) + "\n")
    overrides = lm_run(STEPS, demo_tokenizer)
    overrides["moe"] = {**overrides["moe"], "optimizer": {"name": "none"}}
    overrides["evaluation"] = {"data_files": [str(held_out)], "samples": 6, "batch_size": 4, "every_steps": 1}
    relay = serve_relay(overrides)
    hosts = [start_host(relay.url, f"host{i}", 4, tmp_path / f"host{i}.log") for i in range(2)]
    try:
        wait_until(lambda: len(directory(relay.url)["live"]) == 8, 60, "both hosts to lease 4 experts each")
        done = zygote.run(
            [sys.executable, "tests/dmoe_lm_trainer.py", relay.url, str(STEPS), str(demo_tokenizer)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        stop(hosts)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["final_step"] == STEPS
    status = relay.wait_for(
        lambda s: s["evaluations"] and s["evaluations"][-1]["step"] == STEPS,
        timeout_s=120,
        what=f"version {STEPS} evaluated",
    )
    record = status["evaluations"][-1]
    state_path = tmp_path / "relay-data" / "state" / f"step-{STEPS:08d}.safetensors"
    separate = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from tests.test_moe_evaluation import reference_loss; "
            "print(repr(reference_loss(sys.argv[1], sys.argv[2])))",
            str(tmp_path / "relay.toml"),
            str(state_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert separate.returncode == 0, separate.stderr[-3000:]
    expected = float(separate.stdout.strip().splitlines()[-1])
    assert abs(record["loss"] - expected) <= 1e-5 * abs(expected), (record, expected)
