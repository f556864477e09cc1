"""The decoders people bring, trained through the pipeline by volunteers as volunteers join: real
``python -m toolkit.peer --relay URL`` processes (what ``toolkit.join(URL)`` runs on a pipeline
run), on a relay with a trained tokenizer, the causal-LM objective and its demo corpus.

GPT-2 with its default config (tied input/output embeddings, dropout 0.1) and a Llama config
(untied, rotary, grouped-query attention), each cut into 2 stages: every volunteer takes a stage,
reads its own data through the relay's shards, and leaves when the run reaches its last step
(exit code 0); every round counted exactly the batch on every stage, and the run learns -- the
loss of its last steps is clearly below that of its first. Exactness against one process is
tests/test_pipeline.py's and tests/test_pipeline_tied_run.py's (the same worker code on fixed data).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.support.processes import DEMO_TOKENIZER_VOCAB, REPO

pytestmark = pytest.mark.integration
STEPS = 10
MICROBATCHES = 4
GPT2_DEFAULT = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 32}
"""GPT-2's config with its defaults but for the sizes: tied embeddings, dropout 0.1."""
LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
}


def overrides(config: dict, tokenizer: Path) -> dict:
    return {
        "run": {"target_batch": 2 * MICROBATCHES, "total_steps": STEPS, "max_staleness": 0},
        "model": {
            "kind": "transformers",
            "architecture": "AutoModelForCausalLM",
            "config": {**config, "vocab_size": DEMO_TOKENIZER_VOCAB, "bos_token_id": 0, "eos_token_id": 0},
        },
        "tokenizer": {"file": str(tokenizer)},
        "objective": {"name": "causal-lm", "seq_len": 16},
        "dataset": {"kind": "demo_corpus"},
        "optimizer": {
            "name": "adamw",
            "lr": 0.01,
            "weight_decay": 0.0,
            "betas": [0.9, 0.95],
            "clip_grad_norm": 1.0,
            "schedule": "constant",
        },
        "pipeline": {"enabled": True, "stages": 2, "microbatch_size": 2, "microbatches_per_batch": MICROBATCHES},
    }


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name,config", [("gpt2-default", GPT2_DEFAULT), ("llama", LLAMA)])
def test_volunteers_train_a_decoder_through_the_pipeline(serve_relay, demo_tokenizer, tmp_path, name, config):
    relay = serve_relay(overrides(config, demo_tokenizer))
    logs = [tmp_path / f"v{i}.log" for i in range(2)]
    volunteers = [
        subprocess.Popen(
            [sys.executable, "-m", "toolkit.peer", "--relay", relay.url, "--name", f"v{i}", "--seed", str(i)]
            + ["--threads", "1"],
            stdout=open(log.with_suffix(".out"), "w"),
            stderr=open(log, "w"),
            cwd=REPO,
        )
        for i, log in enumerate(logs)
    ]
    try:
        for proc, log in zip(volunteers, logs):
            assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        for proc in volunteers:
            if proc.poll() is None:
                proc.kill()
    pipeline = requests.get(relay.url + "/api/pipeline", timeout=10).json()
    assert pipeline["counted"][:STEPS] == [[2 * MICROBATCHES] * 2] * STEPS
    rounds = sorted(relay.status()["recent_rounds"], key=lambda r: r["step"])
    losses = [r["loss"] for r in rounds]
    assert len(losses) >= STEPS and all(loss is not None and loss > 0 for loss in losses), rounds
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.95 * first, losses  # it learns
