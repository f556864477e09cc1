"""A relay's version, exported, is a checkpoint users load in one line and run padded batches on.

End to end as an organizer does it: ``relay-server tokenizer train`` on the shipped text (its size
from the config; trained once, both runs read the same text at the same size), a real relay (in
this process: ``relay_server.harness.thread.RelayThread``) and a real peer process for a few steps,
``relay-server export``; then
``AutoTokenizer`` / ``AutoModelFor*.from_pretrained`` on the folder and a ``transformers.pipeline``
on a batch of texts of different lengths, whose answers must equal the one-text-at-a-time
answers (padding changes nothing). Masked-LM (ALBERT, fill-mask) and causal-LM (GPT-2,
text-generation).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from relay_server.cli import main
from relay_server.harness import zygote
from tests.support.processes import REPO, merged, write_config

# one worker builds its trained tokenizer once (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("export_checkpoints")

pytest.importorskip("transformers")

VOCAB = 300
ALBERT = {
    "model_type": "albert",
    "vocab_size": VOCAB,
    "embedding_size": 16,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}
GPT2 = {"model_type": "gpt2", "vocab_size": VOCAB, "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 64}
RUNS = {"masked-lm": ("AutoModelForMaskedLM", ALBERT), "causal-lm": ("AutoModelForCausalLM", GPT2)}
ROLES = ("pad_token", "unk_token", "cls_token", "sep_token", "mask_token", "bos_token", "eos_token")


def cli(*args: str) -> subprocess.CompletedProcess:
    return zygote.run(
        [sys.executable, "-m", "relay_server.cli", *args], capture_output=True, text=True, timeout=300, cwd=REPO
    )


def run_sections(objective: str) -> dict:
    architecture, config = RUNS[objective]
    return {
        "run": {"target_batch": 8},
        "model": {"kind": "transformers", "architecture": architecture, "config": config},
        "tokenizer": {"file": "tokenizer.json"},
        "objective": {"name": objective, "seq_len": 32},
        "dataset": {"kind": "demo_corpus"},
    }


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``relay-server tokenizer train`` next to a run's config, its size from model.config.vocab_size."""
    work = tmp_path_factory.mktemp("tokenizer")
    config = write_config(work / "relay.toml", merged(run_sections("masked-lm")))
    trained = cli("tokenizer", "train", "--config", str(config), "--max-texts", "600")
    assert trained.returncode == 0, trained.stderr
    assert f"vocabulary size {VOCAB}: the config's model.config.vocab_size" in trained.stdout
    assert RUNS["causal-lm"][1]["vocab_size"] == VOCAB  # the other run's config asks the same size
    return work / "tokenizer.json"


@pytest.fixture(params=sorted(RUNS))
def exported(request, tmp_path: Path, tokenizer: Path, serve_relay, launch_peer) -> tuple[str, Path, Path]:
    """(objective, the exported folder, the run's config) after a 2-step run."""
    objective = request.param
    shutil.copy(tokenizer, tmp_path / "tokenizer.json")  # the config names it relative to itself
    relay = serve_relay(run_sections(objective))  # its config: tmp_path/relay.toml
    peer = launch_peer(relay.url, "p0", seed=0, batch_size=4, steps=2)
    assert peer.wait(300) == 0, peer.log_path.read_text()[-2000:]
    out = tmp_path / "ckpt"
    done = cli(
        "export", "--config", str(tmp_path / "relay.toml"), "--data-dir", str(relay.data_dir), "--out", str(out)
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"version 2 written to {out}", done.stdout
    return objective, out, tmp_path / "relay.toml"


def test_exported_checkpoint_loads_in_one_line_and_runs_padded_batches(exported) -> None:
    import transformers
    from tokenizers import Tokenizer

    objective, out, config = exported
    trained = Tokenizer.from_file(str(config.parent / "tokenizer.json"))
    assert trained.get_vocab_size() == VOCAB

    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert len(tok) == VOCAB, "no special token may be appended past the model's vocabulary"
    settings = json.loads((out / "tokenizer_config.json").read_text())
    assert settings["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert json.loads((out / "special_tokens_map.json").read_text()) == {
        r: settings[r] for r in ROLES if r in settings
    }
    for role in ("pad_token", "unk_token", "eos_token", "bos_token"):  # each at the run's own id
        assert getattr(tok, f"{role}_id") == trained.token_to_id(settings[role]), role
    auto = transformers.AutoModelForMaskedLM if objective == "masked-lm" else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(out)
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        assert getattr(model.config, name) == getattr(tok, name) < VOCAB, name
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert set(modes.values()) == {0o644}, modes

    if objective == "masked-lm":
        assert (tok.pad_token, tok.mask_token, tok.cls_token, tok.sep_token) == ("[PAD]", "[MASK]", "[CLS]", "[SEP]")
        fill = transformers.pipeline("fill-mask", model=str(out), top_k=3)
        texts = ["the [MASK] was", "a much longer sentence, with many more words, and a [MASK] in the middle of it"]
        assert len(tok(texts[0])["input_ids"]) < len(tok(texts[1])["input_ids"])  # the batch is padded
        batched = fill(texts, batch_size=2)
        alone = [fill(text) for text in texts]
        for b, a in zip(batched, alone):
            assert [x["token"] for x in b] == [x["token"] for x in a]
            assert [x["score"] for x in b] == pytest.approx([x["score"] for x in a], abs=1e-5)
    else:
        assert tok.padding_side == "left"
        assert tok("the river")["input_ids"] == trained.encode("the river", add_special_tokens=False).ids
        generate = transformers.pipeline("text-generation", model=str(out))
        prompts = ["the", "a much longer prompt, with many more words than the first"]
        batched = generate(prompts, batch_size=2, max_new_tokens=6, do_sample=False)
        alone = [generate(p, max_new_tokens=6, do_sample=False) for p in prompts]
        assert [b[0]["generated_text"] for b in batched] == [a[0]["generated_text"] for a in alone]
        assert all(b[0]["generated_text"].startswith(p) for b, p in zip(batched, prompts))


def test_export_names_the_config_to_pass(tmp_path: Path, serve_relay, capsys: pytest.CaptureFixture) -> None:
    """Without --config, or with another run's, export says in one line what to pass (and writes
    nothing). The CLI's ``main`` in this process: the same code path as ``relay-server export``,
    which the test above runs as a process."""
    other = write_config(
        tmp_path / "other.toml", merged({"run": {"name": "other"}, "model": {"kwargs": {"sizes": [8, 4, 1]}}})
    )
    relay = serve_relay({"run": {"name": "mlp-run", "target_batch": 8}})  # it stores version 0 at start
    for args, source in (((), "the embedded demo run (no --config)"), (("--config", str(other)), f"--config {other}")):
        capsys.readouterr()
        code = main(["export", *args, "--data-dir", str(relay.data_dir), "--out", str(tmp_path / "ckpt")])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1, lines
        assert f"holds run 'mlp-run' (161 parameters), but {source} is run" in lines[0]
        assert "pass --config with the TOML that `relay-server serve` ran 'mlp-run' with" in lines[0]
        assert not (tmp_path / "ckpt").exists()
    code = main(
        [
            "export",
            "--config",
            str(tmp_path / "relay.toml"),
            "--data-dir",
            str(relay.data_dir),
            "--out",
            str(tmp_path / "ckpt"),
        ]
    )
    assert code == 0 and (tmp_path / "ckpt" / "model.safetensors").is_file()
