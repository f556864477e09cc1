"""Organizer mistakes in the run's model are one line at ``relay-server serve``, before anything exists.

Each case runs ``relay-server serve --config bad.toml --data-dir D`` (the CLI's ``main``; one case
as a real process): it must exit non-zero with one line on stderr naming the setting and what to
set it to (no traceback), and leave neither the data dir nor an admin token behind. The tokenizer
is the project's own (``train_tokenizer`` on the shipped text); the labelled shard is a parquet
file written here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from relay_server.cli import main
from relay_server.harness import zygote
from tests.support.processes import REPO, write_config

pytestmark = pytest.mark.xdist_group("model_checks")  # one worker builds its trained tokenizer once (--dist loadgroup)

pytest.importorskip("transformers")

ALBERT = {
    "model_type": "albert",
    "vocab_size": 200,
    "embedding_size": 16,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}
GPT2 = {"model_type": "gpt2", "vocab_size": 200, "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 64}
VOCAB = 200


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from relay_server.data.tokenizer_train import train_tokenizer
    from toolkit.corpus import demo_paragraphs

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok = train_tokenizer(demo_paragraphs()[:400], vocab_size=VOCAB)
    assert tok.get_vocab_size() == VOCAB and tok.token_to_id("[PAD]") == 0
    tok.save(str(path))
    return path


def labelled_shard(directory: Path, labels: list[int]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = directory / "labelled.parquet"
    pq.write_table(pa.table({"text": [f"text number {i}" for i in range(len(labels))], "label": labels}), path)
    return path


def serve_refuses(tmp_path: Path, sections: dict, capsys: pytest.CaptureFixture | None = None) -> str:
    """Run ``relay-server serve`` on ``sections``; its one stderr line (asserting all the rest).

    With ``capsys``, the CLI's ``main`` in this process (the same code path, without paying a
    process start and a transformers import per case); without, a real ``relay-server`` process,
    which also shows no traceback reaches the terminal."""
    config = write_config(
        tmp_path / "bad.toml", {"run": {"name": "bad", "target_batch": 8}, "auth": {"mode": "open"}, **sections}
    )
    data_dir = tmp_path / "relay-data"
    argv = ["serve", "--config", str(config), "--data-dir", str(data_dir), "--port", "0"]
    if capsys is not None:
        capsys.readouterr()
        code, stderr = main(argv), capsys.readouterr().err
    else:
        done = zygote.run(
            [sys.executable, "-m", "relay_server.cli", *argv], capture_output=True, text=True, timeout=180, cwd=REPO
        )
        code, stderr = done.returncode, done.stderr
    assert code == 2, (code, stderr[-3000:])
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert lines[0].startswith("relay-server: configuration error: ")
    assert not data_dir.exists() and not list(tmp_path.rglob("admin_token")), "serve created state before refusing"
    return lines[0]


def transformers_run(architecture: str, config: dict, tokenizer: Path | None = None, **objective) -> dict:
    sections: dict = {"model": {"kind": "transformers", "architecture": architecture, "config": config}}
    if tokenizer is not None:
        sections["tokenizer"] = {"file": str(tokenizer)}
    if objective:
        sections["objective"] = objective
    return sections


CASES = {
    "typo_architecture": (
        lambda tok, d: transformers_run("AutoModelForMaskLM", ALBERT),
        ["model.architecture:", "has no AutoModelForMaskLM", "did you mean AutoModelForMaskedLM?"],
    ),
    "unknown_model_type": (
        lambda tok, d: transformers_run("AutoModelForMaskedLM", {**ALBERT, "model_type": "albret"}),
        ["model.config.model_type:", "'albret'", "did you mean albert", "set one"],
    ),
    "architecture_without_that_model": (
        lambda tok, d: transformers_run("AutoModelForMaskedLM", GPT2),
        ["model.architecture: AutoModelForMaskedLM has no gpt2 model: use one of", "AutoModelForCausalLM"],
    ),
    "objective_trains_another_architecture": (
        lambda tok, d: transformers_run("AutoModelForCausalLM", GPT2, tok, name="masked-lm", seq_len=32),
        [
            "model.architecture: objective 'masked-lm' trains AutoModelForMaskedLM",
            'set model.architecture = "AutoModelForMaskedLM"',
        ],
    ),
    "seq_len_past_positions": (
        lambda tok, d: transformers_run("AutoModelForMaskedLM", ALBERT, tok, name="masked-lm", seq_len=128),
        [
            "objective.seq_len = 128 exceeds model.config.max_position_embeddings = 64",
            "lower objective.seq_len to 64 or raise max_position_embeddings",
        ],
    ),
    "seq_len_past_gpt2_n_positions": (
        lambda tok, d: transformers_run("AutoModelForCausalLM", GPT2, tok, name="causal-lm", seq_len=65),
        ["objective.seq_len = 65 exceeds model.config.n_positions = 64", "raise n_positions"],
    ),
    "tokenizer_larger_than_the_embedding": (
        lambda tok, d: transformers_run(
            "AutoModelForMaskedLM", {**ALBERT, "vocab_size": 150}, tok, name="masked-lm", seq_len=32
        ),
        ["model.config.vocab_size = 150 but the tokenizer has 200 tokens", "set model.config.vocab_size = 200"],
    ),
    "model_vocabulary_far_larger_than_the_tokenizer": (
        lambda tok, d: transformers_run(
            "AutoModelForMaskedLM",
            {k: v for k, v in ALBERT.items() if k != "vocab_size"},
            tok,
            name="masked-lm",
            seq_len=32,
        ),
        [
            "model.config.vocab_size = 30000 (albert's default) but the tokenizer has 200 tokens",
            "set model.config.vocab_size = 200",
        ],
    ),
    "decoder_classifier_without_pad_token": (
        lambda tok, d: transformers_run(
            "AutoModelForSequenceClassification", GPT2, tok, name="classification", seq_len=32
        ),
        [
            "model.config.pad_token_id: a decoder classifier (model_type gpt2)",
            "set model.config.pad_token_id = 0 (the tokenizer's [PAD])",
        ],
    ),
    "pad_token_other_than_the_tokenizers": (
        lambda tok, d: transformers_run(
            "AutoModelForMaskedLM", {**ALBERT, "pad_token_id": 7}, tok, name="masked-lm", seq_len=32
        ),
        ["model.config.pad_token_id = 7 but the tokenizer pads with id 0", "set model.config.pad_token_id = 0"],
    ),
    "token_id_past_the_vocabulary": (
        lambda tok, d: transformers_run("AutoModelForCausalLM", {**GPT2, "eos_token_id": 50256}),
        ["model.config.eos_token_id = 50256 is not a token of the model's 200-token vocabulary"],
    ),
    "labels_beyond_num_labels": (
        lambda tok, d: {
            **transformers_run(
                "AutoModelForSequenceClassification",
                {**ALBERT, "num_labels": 3},
                tok,
                name="classification",
                seq_len=32,
            ),
            "dataset": {"kind": "stream", "sources": [{"data_files": [str(labelled_shard(d, [0, 4, 1, 2]))]}]},
        },
        [
            "model.config.num_labels = 3, but the dataset shard",
            "labelled.parquet holds label 4",
            "set model.config.num_labels = 5",
        ],
    ),
    "typo_factory": (
        lambda tok, d: {"model": {"factory": "toolkit.models:ByteTransformr"}},
        [
            "model.factory: model factory 'toolkit.models:ByteTransformr' is not part of toolkit.models",
            "use one of toolkit.models:ByteTransformer",
        ],
    ),
    "factory_kwarg_it_does_not_take": (
        lambda tok, d: {"model": {"factory": "toolkit.models:MLP", "kwargs": {"sizez": [8, 16, 1]}}},
        ["model.kwargs: toolkit.models:MLP refuses them", "unexpected keyword argument 'sizez'", "fix [model] kwargs"],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_model_mistake_is_one_line_before_anything_is_created(
    case: str, tmp_path: Path, tokenizer_file: Path, capsys: pytest.CaptureFixture
) -> None:
    sections, fragments = CASES[case]
    line = serve_refuses(tmp_path, sections(tokenizer_file, tmp_path), capsys)
    missing = [f for f in fragments if f not in line]
    assert not missing, f"{line!r} lacks {missing}"
    assert len(line) < 400, f"one readable line, not {len(line)} characters"


@pytest.mark.integration
def test_a_refusal_from_a_real_relay_server_process_is_one_line(tmp_path: Path, tokenizer_file: Path) -> None:
    """The cases above run the CLI's ``main`` in this process; one runs as the organizer does, a
    ``relay-server serve`` process, whose terminal shows the same one line and nothing else."""
    sections, fragments = CASES["typo_architecture"]
    line = serve_refuses(tmp_path, sections(tokenizer_file, tmp_path))
    assert all(f in line for f in fragments), line


def test_a_correct_run_with_the_same_pieces_loads(tmp_path: Path, tokenizer_file: Path) -> None:
    """The checks refuse the mistakes only: the same model, tokenizer, objective and labelled
    shard, set right, load (a decoder classifier with its pad token included)."""
    from relay_server.core.config import load_config

    shard = labelled_shard(tmp_path, [0, 2, 1, 2])
    good = [
        transformers_run("AutoModelForMaskedLM", ALBERT, tokenizer_file, name="masked-lm", seq_len=64),
        transformers_run("AutoModelForCausalLM", GPT2, tokenizer_file, name="causal-lm", seq_len=64),
        {
            **transformers_run(
                "AutoModelForSequenceClassification",
                {**GPT2, "num_labels": 3, "pad_token_id": 0},
                tokenizer_file,
                name="classification",
                seq_len=32,
            ),
            "dataset": {"kind": "stream", "sources": [{"data_files": [str(shard)]}]},
        },
        transformers_run(
            "AutoModelForMaskedLM", {**ALBERT, "vocab_size": VOCAB + 56}, tokenizer_file, name="masked-lm", seq_len=64
        ),
    ]  # rounded up to a multiple of 64: allowed
    for i, sections in enumerate(good):
        config = load_config(write_config(tmp_path / f"good{i}.toml", {"auth": {"mode": "open"}, **sections}))
        assert config.model.kind == "transformers"


@pytest.mark.integration
def test_a_run_without_transformers_models_never_imports_it() -> None:
    """transformers stays optional: checking the toolkit's own model does not import it."""
    code = (
        "import sys; from relay_server.core.config import load_config; config = load_config(None, env={}); "
        "assert config.model.kind == 'toolkit'; print('transformers' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]
