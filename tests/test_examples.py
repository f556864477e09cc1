"""The own-loop snippets of docs/models.md are the files under ``examples/``, and each one trains a real
run as printed: started with the relay's URL against a live relay whose run pins its precision
(the shipped albert-tiny recipe in miniature, with a tokenizer ``relay-server tokenizer train``
made), it contributes samples and stops by itself when the run finishes."""

from __future__ import annotations

import re
import sqlite3
import sys
from pathlib import Path

import pytest

from relay_server.harness import zygote
from tests.support.processes import DEMO_TOKENIZER_VOCAB

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = ("plain_loop.py", "hf_trainer.py", "accelerate_loop.py", "lightning_loop.py")
NEEDS = {"hf_trainer.py": "transformers", "accelerate_loop.py": "accelerate", "lightning_loop.py": "lightning"}
ALBERT_TINY = {
    "model_type": "albert",
    "vocab_size": DEMO_TOKENIZER_VOCAB,
    "embedding_size": 16,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 32,
}


def docs_section() -> str:
    """docs/models.md's "Your own training loop" section, up to the next second-level heading."""
    text = (REPO / "docs" / "models.md").read_text()
    start = text.index("\n## Your own training loop\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_the_docs_show_the_example_files_verbatim() -> None:
    blocks = re.findall(r"```python[^\n]*\n(.*?)```", docs_section(), flags=re.S)
    for name in EXAMPLES:
        code = (REPO / "examples" / name).read_text()
        assert code in blocks, f"docs/models.md's 'Your own training loop' does not show examples/{name} as it is"
        assert f"examples/{name}" in docs_section()


@pytest.fixture
def tokenizer(demo_tokenizer: Path) -> Path:
    """conftest's ``demo_tokenizer`` (trained once per session), where the loop packages are installed."""
    pytest.importorskip("transformers")
    return demo_tokenizer


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_trains_a_pinned_run_and_stops_when_it_ends(serve_relay, tmp_path, tokenizer, example) -> None:
    pytest.importorskip(NEEDS.get(example, "transformers"))
    steps = 3
    relay = serve_relay(
        {
            "run": {"target_batch": 16, "total_steps": steps, "precision": "fp32"},
            "model": {"kind": "transformers", "architecture": "AutoModelForMaskedLM", "config": ALBERT_TINY},
            "tokenizer": {"file": str(tokenizer)},
            "objective": {"name": "masked-lm", "seq_len": 24},
            "dataset": {"kind": "demo_corpus"},
            "optimizer": {"name": "lamb", "lr": 0.005, "schedule": "constant"},
        }
    )
    done = zygote.run(
        [sys.executable, str(REPO / "examples" / example), relay.url],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    status = relay.status()
    assert status["finished"] and status["step"] == steps, status
    with sqlite3.connect(relay.data_dir / "relay.sqlite") as db:
        credited = db.execute("SELECT SUM(samples_contributed) FROM peers").fetchone()[0]
    assert credited >= steps * 16  # this one peer's samples made every step
    assert all(r["loss"] and r["loss"] > 1.0 for r in status["recent_rounds"]), status["recent_rounds"]  # real losses
