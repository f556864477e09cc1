"""What the evaluation tests share: an albert-tiny-like masked-LM run validating on held-out
text (``[evaluation]``) and its fixed prompts; its tokenizer is conftest's ``demo_tokenizer``."""

from __future__ import annotations

from pathlib import Path

from tests.support.processes import DEMO_TOKENIZER_VOCAB as VOCAB

SEQ_LEN = 24
ALBERT_TINY = {
    "model_type": "albert",
    "vocab_size": VOCAB,
    "embedding_size": 16,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 32,
}
VALIDATION = [  # held-out text: none of it is in the shipped demo corpus the peers train on
    "The relay keeps the master parameters and publishes a new version after every round.",
    "Volunteers join from a notebook cell and train on the shards the relay leases to them.",
    "A held-out file tells whether the model generalizes beyond the text it was trained on.",
    "The statement returns a value when the function is called with a list of arguments.",
    "Each module defines its own classes, and the interpreter imports them on first use.",
    "Exceptions are raised when an operation fails, and the handler decides what to do next.",
]
PROMPTS = ["The function returns a [MASK] value.", "Import the [MASK] module first."]


def albert_run(tmp_path: Path, tokenizer: Path, **evaluation) -> dict:
    """The overrides of an albert-tiny-like masked-LM run validating on a held-out file."""
    validation = tmp_path / "validation.txt"
    validation.write_text("\n".join(VALIDATION) + "\n")
    return {
        "run": {"name": "eval-run", "target_batch": 8},
        "model": {"kind": "transformers", "architecture": "AutoModelForMaskedLM", "config": ALBERT_TINY},
        "tokenizer": {"file": str(tokenizer)},
        "objective": {"name": "masked-lm", "seq_len": SEQ_LEN, "mlm_probability": 0.15},
        "dataset": {"kind": "demo_corpus"},
        "optimizer": {"name": "lamb", "lr": 0.005, "weight_decay": 0.01, "schedule": "constant"},
        "evaluation": {
            "data_files": [str(validation)],
            "samples": 6,
            "batch_size": 4,
            "every_steps": 1,
            "prompts": PROMPTS,
            **evaluation,
        },
    }


def train_until_evaluated(relay, launch_peer, versions: int) -> dict:
    """A peer slower than the evaluator (a micro-batch every 0.3 s) trains until ``versions``
    versions were scored, then stops; the relay's status once its last version is scored too
    (the latest version is never skipped, only those overtaken by a newer one)."""
    peer = launch_peer(relay.url, "alice", seed=1, batch_size=4, steps=1_000_000, extra=("--sleep-per-batch", "0.3"))
    relay.wait_for(lambda s: len(s["evaluations"]) >= versions, timeout_s=180, what=f"{versions} evaluated versions")
    peer.stop()
    peer.wait()
    return relay.wait_for(
        lambda s: s["evaluations"][-1]["step"] == s["step"], timeout_s=60, what="the last version evaluated"
    )
