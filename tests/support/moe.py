"""The DMoE run the MoE tests share: its ``[moe]`` section and model (two mixtures of a 2x2 grid,
k=2, SGD everywhere), expert host processes, :class:`Member`, a peer driven by hand (join and
heartbeats) that plays a hostile host or a trainer, and the relay's expert :func:`directory`."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import requests
import torch

from relay_server.harness import zygote
from relay_server.harness.manual_peer import ManualPeer
from relay_server.harness.process import wait_until
from tests.dmoe_lm_trainer import BATCH as LM_BATCH
from tests.dmoe_lm_trainer import SEQ_LEN
from tests.moe_trainer import BATCH, IN_FEATURES, batches
from tests.support.processes import DEMO_TOKENIZER_VOCAB, REPO
from tests.support.training import relay_params
from toolkit.client import RelayClient
from toolkit.models import DMoEMLP
from toolkit.models.flat import load_flat
from toolkit.moe.calls import LoopbackCaller
from toolkit.wire import payloads
from toolkit.wire.protocol import ROUTES


def directory(url: str) -> dict:
    """The relay's expert directory (``GET moe_directory``): live experts, their hosts, orphans."""
    return requests.get(url + ROUTES["moe_directory"], timeout=10).json()


class Member(ManualPeer):
    """A peer of the run driven by hand (the harness's :class:`ManualPeer`: join, heartbeats, any
    request of its own) through a client of its own, logged in with ``token`` on an hf-mode run:
    a hostile host or a trainer whose requests a test writes itself."""

    def __init__(self, url: str, name: str, token: str | None = None) -> None:
        client = RelayClient(url, retries=0)
        if token:
            client.login(token)
        super().__init__(client, name)


LR = 0.05
MOE = {
    "enabled": True,
    "uid_prefix": "ffn",
    "layers": 2,
    "grid": [2, 2],
    "k": 2,
    "expert": {"kind": "ffn", "d": 8, "hidden": 16},
    "optimizer": {"name": "sgd", "lr": LR},
    "seed": 0,
    "checkpoint_every_s": 0.5,
    "forward_timeout_s": 10.0,
    "backward_timeout_s": 10.0,
}
KWARGS = {
    "in_features": IN_FEATURES,
    "hidden": 8,
    "out_features": 1,
    "layers": 2,
    "grid": [2, 2],
    "k": 2,
    "expert_hidden": 16,
    "uid_prefix": "ffn",
    "expert_seed": 0,
    "balancing_coef": 0.01,
    "timeout_s": 10.0,
}
UIDS = [f"ffn{layer}.{i}.{j}" for layer in range(2) for i in range(2) for j in range(2)]


def overrides(steps: int, *, micro_batches_per_step: int = 1, experts_learn: bool = True) -> dict:
    """The run: ``steps`` strict large-batch steps of ``micro_batches_per_step`` trainer micro-batches;
    ``experts_learn=False`` freezes the experts (``[moe] optimizer = none``): hosts only compute, so
    the order their backward calls arrive in (several micro-batches in flight) changes nothing."""
    moe = MOE if experts_learn else {**MOE, "optimizer": {"name": "none"}}
    return {
        "model": {"factory": "toolkit.models:DMoEMLP", "kwargs": KWARGS},
        "moe": moe,
        "run": {"target_batch": BATCH * micro_batches_per_step, "max_staleness": 0, "total_steps": steps},
        "optimizer": {"name": "sgd", "lr": LR, "weight_decay": 0.0, "clip_grad_norm": 0.0},
    }


def start_host(relay_url: str, name: str, capacity: int, log: Path) -> subprocess.Popen:
    return zygote.Popen(
        [
            sys.executable,
            "-m",
            "toolkit.moe.host",
            "--relay",
            relay_url,
            "--capacity",
            str(capacity),
            "--name",
            name,
            "-v",
        ],
        cwd=REPO,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # a clean stop uploads the final checkpoints
    for proc in procs:
        proc.wait(timeout=30)


def latest_checkpoint(data_dir: Path, uid: str) -> dict[str, np.ndarray]:
    """The tensors of the newest checkpoint the relay keeps of expert ``uid``."""
    files = sorted((data_dir / "experts" / uid).glob("*.safetensors"))
    return payloads.decode(files[-1].read_bytes(), 1 << 24)[1]


def run_trainer(url: str, steps: int, sleep_s: float = 0.0, *extra: str) -> dict:
    """``tests/moe_trainer.py`` against ``url``: its JSON outcome line."""
    done = zygote.run(
        [sys.executable, "tests/moe_trainer.py", url, str(steps), "--sleep", str(sleep_s), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def train_with_two_hosts(url: str, steps: int, logs: Path) -> tuple[np.ndarray, dict]:
    """Two expert hosts of 4 experts each (logs in ``logs``) and one trainer for ``steps`` steps
    against the relay at ``url``: the parameters the trainer started from and its outcome.
    Checks that the trainer reached its last step with no failed call in any layer."""
    _, initial = relay_params(url)
    hosts = [start_host(url, f"host{i}", 4, logs / f"host{i}.log") for i in range(2)]
    try:
        wait_until(lambda: len(directory(url)["live"]) == 8, 60, "both hosts to lease 4 experts each")
        outcome = run_trainer(url, steps)
    finally:
        stop(hosts)
    assert outcome["final_step"] == steps and outcome["failed_uids"] == {}, outcome
    assert all(layer["failures"] == layer["backward_failures"] == 0 for layer in outcome["layers"]), outcome
    return initial, outcome


def one_process_reference(initial: np.ndarray, steps: int) -> tuple[np.ndarray, dict[str, torch.nn.Module]]:
    """The run of :func:`overrides` ``(steps)`` in one process, from the relay's ``initial``
    parameters: the same model, data and update order, experts behind a LoopbackCaller that steps
    each expert's SGD once per backward call, as a host does. Returns the flat dense parameters
    and the experts by uid."""
    torch.manual_seed(0)
    model = DMoEMLP(**KWARGS)
    load_flat(model, initial)
    experts = {uid: model.make_expert(uid) for uid in UIDS}
    with LoopbackCaller(experts, optimizer_factory=lambda m: torch.optim.SGD(m.parameters(), lr=LR)) as caller:
        model.attach_caller(caller)
        dense = torch.optim.SGD(model.parameters(), lr=LR)
        for batch in batches(steps):
            dense.zero_grad()
            model.loss(batch).backward()
            dense.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy(), experts


# The DMoE language model run (tests/test_moe_lm.py, tests/test_moe_evaluation.py)
LM_LR = 0.05
LM_KWARGS = {
    "vocab_size": DEMO_TOKENIZER_VOCAB,
    "seq_len": SEQ_LEN,
    "hidden": 8,
    "heads": 2,
    "layers": 2,
    "grid": [2, 2],
    "k": 2,
    "expert_hidden": 16,
    "uid_prefix": "ffn",
    "expert_seed": 0,
    "balancing_coef": 0.01,
    "timeout_s": 10.0,
}


def lm_run(steps: int, tokenizer: Path) -> dict:
    """A causal-LM run of :data:`LM_KWARGS` over [moe] ``MOE`` (2 layers of 2x2 FFN experts, d 8),
    SGD everywhere, one micro-batch per step."""
    return {
        "model": {"factory": "toolkit.models:DMoEByteLM", "kwargs": LM_KWARGS},
        "moe": MOE,
        "tokenizer": {"file": str(tokenizer)},
        "objective": {"name": "causal-lm", "seq_len": SEQ_LEN},
        "run": {"target_batch": LM_BATCH, "max_staleness": 0, "total_steps": steps},
        "optimizer": {"name": "sgd", "lr": LM_LR, "weight_decay": 0.0, "clip_grad_norm": 0.0},
    }
