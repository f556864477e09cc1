"""A transformers run through a real relay equals one process on the same global batches.

Tiny ALBERT (shared layers, tied MLM decoder) built from its config on the relay and on three
peer processes with different micro-batch sizes; masked-LM batches as dicts; the relay applies
the run's optimizer. The reference trains one copy of the same architecture in this process on
exactly the rows each round received, with the same optimizer and parameter groups.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from relay_server.rounds.master import flatten
from tests.peer_worker import batch_for, make_mlm_dataset
from tests.test_collaboration import load_flat, relay_params, rounds_from_events
from toolkit.models import build_model, loss_of
from toolkit.wire.protocol import ModelSpec

ALBERT_TINY = {"model_type": "albert", "vocab_size": 64, "embedding_size": 16, "hidden_size": 32,
               "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
               "max_position_embeddings": 32, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
               "classifier_dropout_prob": 0.0}


def reference_optimizer(name: str, model: torch.nn.Module, cfg: dict) -> torch.optim.Optimizer:
    """The relay's parameter groups (decay on tensors with ndim >= 2) and optimizer, in-process."""
    from relay_server.core.config import OptimizerSection
    from relay_server.rounds.master import _make_optimizer

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    return _make_optimizer(groups, OptimizerSection(**cfg))


@pytest.mark.parametrize("optimizer", ["adamw"])
def test_albert_mlm_three_peers_equal_one_process(start_relay, launch_peer, tmp_path, optimizer: str) -> None:
    steps = 3
    opt_cfg = {"name": optimizer, "lr": 0.005, "weight_decay": 0.01, "betas": [0.9, 0.99], "clip_grad_norm": 0.0,
               "schedule": "constant"}
    relay = start_relay({"run": {"target_batch": 36},
                         "model": {"kind": "transformers", "architecture": "AutoModelForMaskedLM",
                                   "config": ALBERT_TINY},
                         "optimizer": opt_cfg})
    _, initial = relay_params(relay.url)
    peers = [launch_peer(relay.url, f"p{i}", seed=20 + i, batch_size=b, steps=steps, extra=("--wait-peers", "3"))
             for i, b in enumerate((3, 4, 6))]
    for peer in peers:
        assert peer.wait() == 0, peer.log_path.read_text()[-2000:]
    _, final = relay_params(relay.url, min_step=steps)
    rounds = rounds_from_events(peers)
    assert sorted(rounds) == list(range(steps))
    assert len({p.name for p in peers if any(e["event"] == "round" for e in p.events())}) >= 2

    spec = ModelSpec(kind="transformers", architecture="AutoModelForMaskedLM", config=ALBERT_TINY)
    model = build_model(spec)
    load_flat(model, initial)
    data = make_mlm_dataset(ALBERT_TINY["vocab_size"])
    opt = reference_optimizer(optimizer, model, opt_cfg)
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, batch_for(spec, rounds[step], data)).backward()
        opt.step()
    reference = flatten(model)
    relative = np.linalg.norm(final - reference) / np.linalg.norm(reference)
    assert relative <= 1e-5, relative
    assert np.linalg.norm(final - initial) / np.linalg.norm(initial) > 1e-4  # it did train
    assert all(r["loss"] and r["loss"] > 0 for r in relay.status()["recent_rounds"])  # the real loss, not 0

    # The relay's version as a checkpoint users load with transformers, giving the same logits.
    out = tmp_path / "ckpt"
    done = subprocess.run([sys.executable, "-m", "relay_server.cli", "export", "--config", str(relay.config_path),
                           "--data-dir", str(relay.data_dir), "--out", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    from transformers import AutoModelForMaskedLM

    loaded = AutoModelForMaskedLM.from_pretrained(out).eval()
    load_flat(model, final)
    model.eval()
    inputs = batch_for(spec, list(range(8)), data)
    with torch.no_grad():
        expected = model(input_ids=inputs["input_ids"]).logits
        got = loaded(input_ids=inputs["input_ids"]).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
