"""A transformers run through a real relay equals one process on the same global batches.

The sahajBERT recipe in miniature: a tokenizer trained on the shipped text (``relay-server
tokenizer train``), a tiny ALBERT (shared layers, tied MLM decoder) built from its config on the
relay and on three peer processes with different micro-batch sizes, the run's own input pipeline
(packing, fixed-count masking) on each peer, LAMB on the relay. The reference trains one copy of
the same architecture in this process on exactly the rows each round received, with the same
optimizer and parameter groups. Then the relay's version, exported, loads with
``AutoModelForMaskedLM.from_pretrained`` and gives the relay's logits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from relay_server.harness import zygote
from tests.support.processes import DEMO_TOKENIZER_VOCAB as VOCAB
from tests.support.training import relay_params, train_together
from toolkit.models import build_model, loss_of
from toolkit.models.flat import flatten, load_flat
from toolkit.wire.protocol import ModelSpec

ALBERT_TINY = {
    "model_type": "albert",
    "embedding_size": 16,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 32,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
    "classifier_dropout_prob": 0.0,
}
SEQ_LEN = 24


def reference_optimizer(model: torch.nn.Module, cfg: dict) -> torch.optim.Optimizer:
    """The relay's parameter groups (decay on tensors with ndim >= 2) and optimizer, in-process."""
    from relay_server.core.config import OptimizerSection
    from relay_server.rounds.master import _make_optimizer

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    return _make_optimizer(groups, OptimizerSection(**cfg))


def rows_of(peers, ids: list[str]) -> dict[str, torch.Tensor]:
    """The rows ``name/batch/row`` the peers trained on, from the batches each one kept."""
    kept = {p.name: torch.load(str(p.events_path) + ".batches.pt") for p in peers}
    picked = [(kept[n][int(b)], int(r)) for n, b, r in (i.split("/") for i in ids)]
    return {key: torch.stack([batch[key][r] for batch, r in picked]) for key in picked[0][0]}


def test_albert_mlm_with_trained_tokenizer_and_lamb_three_peers_equal_one_process(
    serve_relay, launch_peer, tmp_path: Path, demo_tokenizer: Path
) -> None:
    steps = 3
    opt_cfg = {
        "name": "lamb",
        "lr": 0.005,
        "weight_decay": 0.01,
        "betas": [0.9, 0.99],
        "clip_grad_norm": 0.0,
        "schedule": "constant",
    }
    config = {**ALBERT_TINY, "vocab_size": VOCAB}
    relay = serve_relay(
        {
            "run": {"target_batch": 36},
            "model": {"kind": "transformers", "architecture": "AutoModelForMaskedLM", "config": config},
            "tokenizer": {"file": str(demo_tokenizer)},
            "objective": {"name": "masked-lm", "seq_len": SEQ_LEN, "mlm_probability": 0.15},
            "dataset": {"kind": "demo_corpus"},
            "optimizer": opt_cfg,
        }
    )
    _, initial = relay_params(relay.url)
    peers, final, rounds = train_together(relay, launch_peer, steps=steps, batch_sizes=(3, 4, 6), seed=20)
    assert len({p.name for p in peers if any(e["event"] == "round" for e in p.events())}) >= 2

    spec = ModelSpec(kind="transformers", architecture="AutoModelForMaskedLM", config=config)
    model = build_model(spec)
    load_flat(model, initial)
    opt = reference_optimizer(model, opt_cfg)
    for step in range(steps):
        batch = rows_of(peers, rounds[step])
        assert ((batch["labels"] != -100).sum(dim=1) == round(0.15 * (SEQ_LEN - 2))).all()  # fixed-count masking
        opt.zero_grad()
        loss_of(model, batch).backward()
        opt.step()
    reference = flatten(model)
    relative = np.linalg.norm(final - reference) / np.linalg.norm(reference)
    assert relative <= 1e-5, relative
    assert np.linalg.norm(final - initial) / np.linalg.norm(initial) > 1e-4  # it did train
    assert all(r["loss"] and r["loss"] > 0 for r in relay.status()["recent_rounds"])  # the real loss, not 0

    # The relay's version as a checkpoint users load with transformers, giving the same logits.
    out = tmp_path / "ckpt"
    done = zygote.run(
        [
            sys.executable,
            "-m",
            "relay_server.cli",
            "export",
            "--config",
            str(tmp_path / "relay.toml"),
            "--data-dir",
            str(relay.data_dir),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    from transformers import AutoModelForMaskedLM, PreTrainedTokenizerFast

    loaded = AutoModelForMaskedLM.from_pretrained(out).eval()
    load_flat(model, final)
    model.eval()
    inputs = rows_of(peers, rounds[0][:8])["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=inputs).logits, model(input_ids=inputs).logits, rtol=1e-5, atol=1e-5
        )
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {f.name for f in out.iterdir()}
    assert PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json")).vocab_size == VOCAB
