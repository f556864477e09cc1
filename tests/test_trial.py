"""``relay-server trial``: an organizer's own configuration on this machine, in one command.

Real processes throughout: the CLI as the organizer types it, the relay it starts, the local
peer it launches. The loss references it prints come from the relay's ``/api/status``, and are
checked here against an independent computation from the shipped text.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from relay_server.cli import main
from relay_server.harness import zygote
from tests.support.processes import REPO

pytestmark = pytest.mark.integration  # starts relay, peer or tool processes

DEMO_TOML = REPO / "relay_server/defaults/demo.toml"
STEP = re.compile(r"^step\s+(\d+)\s+loss (\S+)\s+samples/s .*\(applied (\d+) of target 16 samples from 1 peers", re.M)
URL = re.compile(r"^relay:\s+(http://127\.0\.0\.1:\d+)\s+\(dashboard: \1/ ,", re.M)


def byte_unigram_entropy() -> float:
    """The shipped text's byte entropy, computed here without the relay's code."""
    counts = np.bincount(
        np.frombuffer((REPO / "toolkit/assets/demo_corpus.txt").read_bytes(), dtype=np.uint8), minlength=256
    ).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def trial(*args: str, cwd: Path = REPO) -> subprocess.Popen:
    return zygote.Popen(
        [sys.executable, "-m", "relay_server.cli", "trial", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_trial_of_the_shipped_config_prints_its_steps_and_references() -> None:
    proc = trial("--config", str(DEMO_TOML), "--steps", "2", "--threads", "1")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
    assert URL.search(out), out
    assert f"trial:     {DEMO_TOML} on this machine: auth open on 127.0.0.1, state in a temporary directory" in out
    assert "micro-batch 8, target batch 16 (the run's own, 64, is for the collaboration), stops after 2 steps" in out
    entropy = byte_unigram_entropy()
    assert (
        f"losses:    chance: ln 256 (bytes) = {math.log(256):.4f}; unigram entropy of the demo text (bytes) = "
        f"{entropy:.4f}"
    ) in out
    steps = {int(m[1]): float(m[2]) for m in STEP.finditer(out)}
    assert sorted(steps) == [1, 2] and all(0 < v < 10 for v in steps.values()), out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["peers"] == 1
    assert summary["loss_references"] == {"chance": round(math.log(256), 4), "unigram": round(entropy, 4)}


def test_trial_keeps_the_dashboard_up_until_ctrl_c(tmp_path: Path) -> None:
    """The organizer's path: ``init`` writes a config (auth on, 4096 samples a step), ``trial``
    runs it locally at once, the dashboard and ``/api/status`` answer while it trains, and Ctrl-C
    is the normal way out. Nothing is written next to the config."""
    zygote.run(
        [sys.executable, "-m", "relay_server.cli", "init", "my-run.toml"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        env=None,
    )
    proc = trial("--config", "my-run.toml", "--threads", "1", cwd=tmp_path)
    try:
        lines = []
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("step    1 "):
                break
        out = "".join(lines)
        assert "the run's own, 4096, is for the collaboration), until Ctrl-C" in out, out
        url = URL.search(out)[1]
        with urllib.request.urlopen(url + "/api/status", timeout=30) as answer:
            status = json.load(answer)
        references = {r["name"]: r for r in status["loss_references"]}
        assert abs(references["chance"]["value"] - math.log(256)) < 1e-5
        assert abs(references["unigram"]["value"] - byte_unigram_entropy()) < 1e-5
        assert references["chance"]["label"] == "chance: ln 256 (bytes)"
        assert status["auth_mode"] == "open" and status["target_batch"] == 16
        with urllib.request.urlopen(url + "/", timeout=30) as page:
            assert page.status == 200
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        assert json.loads(rest.strip().splitlines()[-1])["steps"] >= 1
        assert sorted(p.name for p in tmp_path.iterdir()) == ["my-run.toml"]  # no relay-data beside it
    finally:
        proc.kill()


def test_trial_of_a_tokenized_run_names_the_vocabulary(tmp_path: Path) -> None:
    """albert-tiny as an organizer would copy it: its tokenizer trained first, then a trial
    whose chance level is ln of that tokenizer's vocabulary."""
    config = tmp_path / "albert-tiny.toml"
    shutil.copy(REPO / "relay_server/defaults/albert-tiny.toml", config)
    assert main(["tokenizer", "train", "--config", str(config), "--vocab-size", "2000"]) == 0  # the CLI, in process
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).get_vocab_size()
    proc = trial("--config", str(config), "--steps", "2", "--threads", "1", "--batch-size", "4", cwd=tmp_path)
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
    assert (
        f"losses:    chance: ln {vocab} (tokens) = {math.log(vocab):.4f}; unigram entropy of the demo text "
        "(tokens) = " in out
    ), out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["loss_references"]["chance"] == round(math.log(vocab), 4)
    assert summary["loss_references"]["unigram"] < summary["loss_references"]["chance"]


def test_references_by_objective() -> None:
    """Classification: ln of the labels; a regression model has no chance level to show."""
    from relay_server.data.loss_references import loss_references, unigram_entropy

    classify = SimpleNamespace(
        objective={"name": "classification"},
        dataset={},
        model=SimpleNamespace(kind="transformers", config={"num_labels": 3}),
    )
    [chance] = loss_references(classify)
    assert (
        chance.name == "chance" and abs(chance.value - math.log(3)) < 1e-12 and chance.label == "chance: ln 3 (labels)"
    )
    mlp = SimpleNamespace(
        objective={}, dataset={}, model=SimpleNamespace(kind="toolkit", factory="toolkit.models:MLP", config={})
    )
    assert loss_references(mlp) == []
    assert abs(unigram_entropy([0, 1, 2, 3] * 5) - math.log(4)) < 1e-12


def test_a_model_the_peer_cannot_train_is_explained_by_the_trial(tmp_path: Path) -> None:
    """The trial exists to find this before volunteers do: the organizer's own module model
    (trusted by the local peer: it is the organizer's machine) has no ``loss``; the trial ends 1
    with the peer's own words in its output."""
    config = tmp_path / "linear.toml"
    config.write_text(
        '[run]\nname = "linear"\n[model]\nkind = "module"\nfactory = "torch.nn:Linear"\n'
        'kwargs = { in_features = 4, out_features = 2 }\n[auth]\nmode = "open"\n'
    )
    proc = trial("--config", str(config), "--steps", "1", "--threads", "1", cwd=tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, out + err
    assert "all peers exited early; the end of peer-0's log:" in err and "has no attribute 'loss'" in err, err
    assert "untrusted_model" not in err
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 0


PIPELINE_TOML = REPO / "relay_server/defaults/pipeline-tiny.toml"
PIPELINE_STEP = re.compile(
    r"^step\s+(\d+)\s+loss (\S+)\s+.*\(applied (\d+) of target (\d+) samples from (\d+) peers", re.M
)


def test_trial_of_a_pipeline_config_starts_a_worker_per_stage_and_keeps_its_batch() -> None:
    """The organizer's pipeline run as shipped (2 stages, 4 micro-batches of 4): the trial starts
    one local stage worker per stage, keeps the batch shape (saying so), states the predicted
    memory, and makes the 3 steps asked for, each applying exactly the run's batch."""
    proc = trial("--config", str(PIPELINE_TOML), "--steps", "3", "--threads", "2")
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
    assert "pipeline:  2 stages (layers [2, 2]); the trial starts one local stage worker per stage" in out, out
    assert "workers:   2 CPU processes (1 thread each), stops after 3 steps" in out, out
    assert (
        "batch:     the run's own: 4 micro-batches of 4 = target batch 16 (unchanged; --batch-size / "
        "--target-batch change it)"
    ) in out, out
    assert re.search(r"^memory:    predicted \d+ MiB in all \(workers \d+, \d+ MiB, relay \d+ MiB\)", out, re.M), out
    steps = [(int(m[1]), int(m[3]), int(m[4]), int(m[5])) for m in PIPELINE_STEP.finditer(out)]
    assert [s[0] for s in steps] == [1, 2, 3], out
    assert all(applied == target == 16 and peers == 2 for _, applied, target, peers in steps), out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["peers"] == 2


def test_a_pipeline_trial_says_what_it_changed_and_refuses_a_batch_it_cannot_cut() -> None:
    """``--batch-size`` / ``--target-batch`` on a pipeline run change its shape, in the header's
    words; a batch that is no whole number of micro-batches is one line, before anything starts."""
    from relay_server.trial import pipeline_batch

    assert pipeline_batch(4, 4, None, 2)[:2] == (2, 8)
    size, count, line = pipeline_batch(4, 4, 32, None)
    assert (size, count) == (4, 8)
    assert line == (
        "batch:     8 micro-batches of 4 = target batch 32 (changed by --target-batch 32; the run's own, "
        "4 micro-batches of 4 = 16, is for the collaboration)"
    )
    proc = trial("--config", str(PIPELINE_TOML), "--steps", "1", "--target-batch", "10")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, out + err
    assert err.strip().splitlines() == [
        "relay-server: configuration error: --target-batch 10 is not a whole number of micro-batches of 4 (a "
        "pipeline batch is pipeline.microbatch_size x pipeline.microbatches_per_batch): pick a multiple of 4"
    ], err
    assert "relay:" not in out


def test_a_pipeline_too_large_for_this_machine_is_one_line(tmp_path: Path, capsys) -> None:
    """A pipeline whose predicted memory (its workers and relay together, 38B parameters here)
    exceeds what this machine has: the trial says so in one line, before any process or relay
    starts (the model is only ever built on the meta device)."""
    config = tmp_path / "huge.toml"
    config.write_text(
        PIPELINE_TOML.read_text()
        .replace(
            "d_model = 128, n_layer = 4, n_head = 4, d_ff = 512",
            "d_model = 8192, n_layer = 48, n_head = 64, d_ff = 32768",
        )
        .replace("port = 8750", "port = 0")
    )
    assert main(["trial", "--config", str(config), "--steps", "1"]) == 2
    out, err = capsys.readouterr()
    assert not out
    [line] = err.strip().splitlines()
    assert line.startswith(
        "relay-server: configuration error: the trial cannot run this pipeline here: its 2 stage workers "
    ), line
    assert "MiB available: try it on a machine with more memory" in line, line
