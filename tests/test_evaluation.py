"""``[evaluation]``: held-out validation and live samples, on a real relay with real peers.

An albert-tiny-like masked-LM run (tokenizer trained by the project's own code on the shipped
text, a validation file of other text) must record a validation loss per evaluated version that
a separate process -- the version's parameters read from the relay's data dir, the model and the
batches built with the project's functions -- reproduces to 1e-6; the records and the samples
must survive a restart; a stopped evaluator process (SIGSTOP: the test holds it) must never stop
rounds from completing and publishing; the dashboard must draw both curves, the chance line and
the samples. Hostile configurations are refused at load, in one line naming the field.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from relay_server.core.config import ConfigError, load_config
from relay_server.harness import zygote
from relay_server.harness.process import wait_until
from tests.hub_standin import HubStandin
from tests.support.evaluation import PROMPTS, SEQ_LEN, albert_run, train_until_evaluated
from tests.support.processes import REPO
from tests.support.wandb_records import finished_run_records, history_rows

HUB_TOKEN = "hf_test_organizer_write_token"
HUB_REPO = "organizer/eval-ckpt"


# The separate process: the version's parameters from the relay's data dir, the model and the
# validation batches built with the project's functions, the loss computed here (not by the relay's code).
REFERENCE = r"""
import json, sys
import torch, torch.nn.functional as F
from safetensors import safe_open
from relay_server.core.config import load_config
from toolkit.data.objectives import ObjectiveConfig, load_tokenizer, objective_batches
from toolkit.data.reading import read_shard
from toolkit.models import build_model

torch.set_num_threads(1)
config = load_config(sys.argv[1], overrides={"server": {"data_dir": sys.argv[2]}})
section = config.evaluation
tokenizer = load_tokenizer(open(config.tokenizer.file, "rb").read())
rows = (t for f in section.data_files for t in read_shard(f, text_column=section.text_column))
batches, count = [], 0
for batch in objective_batches(rows, tokenizer, ObjectiveConfig.from_dict(config.objective),
                               batch_size=section.batch_size, seed=section.seed):
    take = min(len(batch["labels"]), section.samples - count)
    batches.append({k: v[:take] for k, v in batch.items()})
    count += take
    if count >= section.samples:
        break
model = build_model(config.model.spec()).eval()
losses = {}
for step in map(int, sys.argv[3:]):
    path = f"{sys.argv[2]}/state/step-{step:08d}.safetensors"
    with safe_open(path, framework="pt") as f:
        flat = f.get_tensor("master" if "master" in f.keys() else "params")
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        nll, n = 0.0, 0
        for batch in batches:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            keep = batch["labels"] != -100
            nll += float(F.cross_entropy(logits[keep].double(), batch["labels"][keep], reduction="sum"))
            n += int(keep.sum())
    losses[step] = nll / n
print(json.dumps(losses))
"""


def evaluator_process(relay) -> psutil.Process:
    """The relay's evaluator: its child started by multiprocessing's spawn (not the resource tracker)."""

    def found():
        return [c for c in psutil.Process(relay.proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]

    wait_until(lambda: found(), 60, "the evaluator process")
    return found()[0]


def test_validation_loss_per_version_equals_a_separate_process_and_survives_a_restart(
    start_relay,
    launch_peer,
    tmp_path: Path,
    demo_tokenizer: Path,
    offline_wandb: Path,
    hub_standin: HubStandin,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hub_standin.add_user(HUB_TOKEN, "organizer", role="write")  # Hub checkpoints: their card states validation
    monkeypatch.setenv("COLLAB_TEST_HUB_TOKEN", HUB_TOKEN)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    relay = start_relay(
        {
            **albert_run(tmp_path, demo_tokenizer),
            "wandb": {"project": "collab-eval", "mode": "offline"},
            "hub": {
                "repo_id": HUB_REPO,
                "endpoint": hub_standin.url,
                "token_env": "COLLAB_TEST_HUB_TOKEN",
                "every_steps": 1,
            },
        }
    )
    status = train_until_evaluated(relay, launch_peer, 3)
    evaluations = status["evaluations"]
    steps = [e["step"] for e in evaluations]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert all(
        e["targets"] == 6 * round(0.15 * (SEQ_LEN - 2)) for e in evaluations
    )  # the same masked tokens each time
    assert all(e["perplexity"] == pytest.approx(2.718281828459045 ** e["loss"]) for e in evaluations)
    assert all(0 <= e["accuracy"] <= 1 for e in evaluations)
    assert len({e["loss"] for e in evaluations}) == len(evaluations)  # the model moved between versions

    done = zygote.run(
        [sys.executable, "-c", REFERENCE, str(relay.config_path), str(relay.data_dir), *map(str, steps)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    reference = {int(k): v for k, v in json.loads(done.stdout).items()}
    for e in evaluations:
        assert abs(e["loss"] - reference[e["step"]]) <= 1e-6, (e["step"], e["loss"], reference[e["step"]])

    # The last record carries the samples: the fixed prompts, fill-mask top tokens from the model.
    last = evaluations[-1]
    assert [s["prompt"] for s in last["samples"]] == PROMPTS
    assert all(
        s["kind"] == "fill-mask" and len(s["tokens"]) == 5 and s["scores"] == sorted(s["scores"], reverse=True)
        for s in last["samples"]
    )
    assert all(e["samples"] == [] for e in evaluations[:-1])  # the status stays small

    # W&B: an eval/ row per evaluated version and the samples table; the Hub card: the latest validation.
    relay.stop()  # closes the observers: W&B's run is on disk, the last upload done
    run_id = (relay.data_dir / "wandb-run-id").read_text().strip()
    [log] = offline_wandb.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
    rows = [r for r in history_rows(finished_run_records(log)) if "eval/loss" in r]
    assert [(r["step"], r["eval/loss"], r["eval/accuracy"]) for r in rows] == [
        (e["step"], e["loss"], e["accuracy"]) for e in evaluations
    ]
    assert all(r["eval/samples/_type"] == "table-file" and r["eval/samples/nrows"] == len(PROMPTS) for r in rows)
    table = json.loads((log.parent / "files" / rows[-1]["eval/samples/path"]).read_text())
    assert table["data"] == [[last["step"], s["prompt"], "fill-mask", s["output"]] for s in last["samples"]]
    card = hub_standin.commits(HUB_REPO)[-1].files["README.md"].decode()
    shown = int(re.search(r"Latest validation \(held-out data, version (\d+)", card)[1])
    assert f"loss {next(e for e in evaluations if e['step'] == shown)['loss']:.4f}" in card

    # Persisted in the data dir: the same records after a restart.
    relay.start()
    again = relay.status()["evaluations"]
    assert [(e["step"], e["loss"]) for e in again] == [(e["step"], e["loss"]) for e in evaluations]
    assert again[-1]["samples"] == last["samples"]


def test_a_stopped_evaluator_never_holds_up_rounds(
    start_relay, launch_peer, tmp_path: Path, demo_tokenizer: Path
) -> None:
    relay = start_relay(albert_run(tmp_path, demo_tokenizer))
    # A peer that keeps training (and leaves the evaluator some of the machine's CPU meanwhile).
    launch_peer(relay.url, "alice", seed=1, batch_size=4, steps=1_000_000, extra=("--sleep-per-batch", "0.1"))
    status = relay.wait_for(lambda s: s["evaluations"], timeout_s=180, what="a first evaluation")
    evaluator = evaluator_process(relay)
    evaluator.send_signal(signal.SIGSTOP)  # held: it cannot score anything until the test lets it go
    try:
        # A report of a later step is built fresh (the status cache keys on the step): it has every
        # record the relay got so far; at most one more can come, one the process sent before it stopped.
        stopped_at = relay.status()["step"]
        held = relay.wait_for(lambda s: s["step"] > stopped_at, timeout_s=60, what="a step after the stop")
        recorded = len(held["evaluations"])
        after = relay.wait_for(
            lambda s: s["step"] >= held["step"] + 5,
            timeout_s=120,
            what="rounds completing while the evaluator is stopped",
        )
        assert len(after["evaluations"]) <= recorded + 1  # at most the one it had already finished
        assert after["recent_rounds"][-1]["step"] >= held["step"] + 5  # published, not merely counted
    finally:
        evaluator.send_signal(signal.SIGCONT)
    behind = after["step"]
    caught_up = relay.wait_for(
        lambda s: s["evaluations"] and s["evaluations"][-1]["step"] >= behind,
        timeout_s=120,
        what="the evaluator catching up with the latest version",
    )
    steps = [e["step"] for e in caught_up["evaluations"]]
    assert any(b - a > 1 for a, b in zip(steps, steps[1:]))  # versions published while it was held were skipped
    assert status["evaluations"][0]["step"] in steps


def write_toml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


BASE_TOML = """
[auth]
mode = "open"
[model]
kind = "transformers"
architecture = "AutoModelForMaskedLM"
config = {{ model_type = "albert", vocab_size = 200, embedding_size = 16, hidden_size = 32, num_hidden_layers = 2, num_attention_heads = 2, intermediate_size = 64, max_position_embeddings = 32 }}
[tokenizer]
file = "{tokenizer}"
[objective]
name = "masked-lm"
seq_len = 24
[dataset]
kind = "stream"
[[dataset.sources]]
name = "train"
data_files = ["train.txt"]
[evaluation]
data_files = ["validation.txt"]
{evaluation}
"""


@pytest.mark.parametrize(
    "evaluation, message",
    [
        ('prompts = ["' + "x [MASK] " * 40 + '"]', "evaluation.prompts[0] must be 1 to 256 characters"),
        ("prompts = [" + ", ".join(['"a [MASK]"'] * 17) + "]", "evaluation.prompts has 17 prompts; at most 16"),
        ('prompts = "a [MASK]"', "evaluation.prompts must be a list of strings"),
        ("prompts = [1, 2]", "evaluation.prompts[0] must be a string"),
        ('prompts = ["no mask token here"]', "evaluation.prompts[0] has no [MASK]"),
        ('data_files = ["train.txt"]', "evaluation.data_files includes the training shard"),
        ('repo = "org/val"', "evaluation.repo needs evaluation.revision"),
        ("every_steps = 0", "evaluation needs evaluation.every_steps > 0 or evaluation.every_s > 0"),
        ("threads = 0", "evaluation.threads must be in 1..256"),
    ],
)
def test_hostile_evaluation_config_is_refused_at_load(
    tmp_path: Path, demo_tokenizer: Path, evaluation: str, message: str
) -> None:
    (tmp_path / "train.txt").write_text("training text\n")
    (tmp_path / "validation.txt").write_text("held-out text\n")
    text = BASE_TOML.format(tokenizer=demo_tokenizer, evaluation=evaluation)
    if evaluation.startswith("data_files"):  # replaces the section's own line
        text = text.replace('data_files = ["validation.txt"]\n', "", 1)
    with pytest.raises(ConfigError) as refused:
        load_config(write_toml(tmp_path / "run.toml", text))
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_serve_refuses_a_hostile_prompt_before_creating_the_data_dir(tmp_path: Path, demo_tokenizer: Path) -> None:
    (tmp_path / "train.txt").write_text("training text\n")
    (tmp_path / "validation.txt").write_text("held-out text\n")
    config = write_toml(
        tmp_path / "run.toml", BASE_TOML.format(tokenizer=demo_tokenizer, evaluation='prompts = [{ text = "x" }]')
    )
    data_dir = tmp_path / "data"
    done = subprocess.run(
        [sys.executable, "-m", "relay_server.cli", "serve", "--config", str(config), "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].count("evaluation.prompts[0] must be a string") == 1
    assert not data_dir.exists()


def test_the_docs_evaluation_block_loads(tmp_path: Path, demo_tokenizer: Path) -> None:
    block = re.search(r"```toml\n(\[evaluation\]\n.*?)```", (REPO / "docs" / "evaluation.md").read_text(), re.S)[1]
    (tmp_path / "train.txt").write_text("training text\n")
    (tmp_path / "validation").mkdir()
    (tmp_path / "validation" / "a.txt").write_text("held-out text\n")
    text = BASE_TOML.format(tokenizer=demo_tokenizer, evaluation="").split("[evaluation]")[0] + block
    config = load_config(write_toml(tmp_path / "run.toml", text))
    assert config.evaluation.shards() == [str(tmp_path / "validation" / "a.txt")]
    assert len(config.evaluation.prompts) == 2


# --- every objective, in-process: the scorer's metric is the model's own loss ------------------
def scorer_for(tmp_path: Path, tokenizer: Path | None, **sections):
    """The evaluator's scorer for a run written from ``sections`` (validation: tests.support.evaluation's text)."""
    from relay_server.observers.eval_model import VersionScorer
    from tests.support.processes import write_config

    config = load_config(
        write_config(
            tmp_path / "run.toml",
            {"auth": {"mode": "open"}, **({"tokenizer": {"file": str(tokenizer)}} if tokenizer else {}), **sections},
        )
    )
    return VersionScorer(config)


def initial_flat(scorer):
    import torch

    return torch.cat([p.detach().reshape(-1) for p in scorer.model.parameters()])


def test_byte_level_demo_model_scores_next_bytes_as_its_own_loss(tmp_path: Path) -> None:
    import torch

    from tests.support.evaluation import VALIDATION

    (tmp_path / "val.txt").write_text("\n".join(VALIDATION))
    scorer = scorer_for(
        tmp_path,
        None,
        model={
            "factory": "toolkit.models:ByteTransformer",
            "kwargs": {"d_model": 32, "n_head": 2, "n_layer": 1, "seq_len": 32},
        },
        evaluation={
            "data_files": [str(tmp_path / "val.txt")],
            "samples": 8,
            "batch_size": 4,
            "seq_len": 32,
            "prompts": ["The relay "],
            "max_new_tokens": 5,
        },
    )
    record = scorer.evaluate(0, initial_flat(scorer))
    with torch.no_grad():  # ByteTransformer.loss: the mean next-byte cross-entropy of a batch
        own = sum(float(scorer.model.loss(b)) for b in scorer.batches) / len(scorer.batches)
    assert [tuple(b.shape) for b in scorer.batches] == [(4, 33), (4, 33)]
    assert abs(record.loss - own) <= 1e-6 and record.targets == 8 * 32 and record.accuracy is None
    [sample] = record.samples
    assert sample.kind == "continuation" and sample.prompt == "The relay "


@pytest.mark.parametrize("objective", ["causal-lm", "classification"])
def test_causal_and_classification_runs_score_the_models_own_loss(
    tmp_path: Path, demo_tokenizer: Path, objective: str
) -> None:
    import torch

    from tests.support.evaluation import VALIDATION

    if objective == "causal-lm":
        model = {
            "kind": "transformers",
            "architecture": "AutoModelForCausalLM",
            "config": {
                "model_type": "gpt2",
                "vocab_size": 200,
                "n_embd": 16,
                "n_layer": 1,
                "n_head": 2,
                "n_positions": 32,
            },
        }
        (tmp_path / "val.txt").write_text("\n".join(VALIDATION))
        files, prompts = [str(tmp_path / "val.txt")], ["The relay keeps"]
    else:
        model = {
            "kind": "transformers",
            "architecture": "AutoModelForSequenceClassification",
            "config": {
                "model_type": "albert",
                "vocab_size": 200,
                "embedding_size": 16,
                "hidden_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "intermediate_size": 64,
                "max_position_embeddings": 32,
                "num_labels": 2,
                "id2label": {"0": "no", "1": "yes"},
            },
        }
        (tmp_path / "val.jsonl").write_text(
            "\n".join(json.dumps({"text": t, "label": i % 2}) for i, t in enumerate(VALIDATION))
        )
        files, prompts = [str(tmp_path / "val.jsonl")], ["Is this held out?"]
    scorer = scorer_for(
        tmp_path,
        demo_tokenizer,
        model=model,
        objective={"name": objective, "seq_len": 16},
        evaluation={"data_files": files, "samples": 4, "batch_size": 4, "prompts": prompts},
    )
    record = scorer.evaluate(3, initial_flat(scorer))
    [batch] = scorer.batches
    with torch.no_grad():  # the architecture's own loss: a mean over the batch's targets
        own = float(scorer.model(**batch).loss)
    assert abs(record.loss - own) <= 1e-6
    [sample] = record.samples
    if objective == "causal-lm":
        assert record.perplexity == pytest.approx(2.718281828459045**record.loss) and record.accuracy is None
        assert sample.kind == "continuation"
    else:
        assert record.perplexity is None and 0 <= record.accuracy <= 1 and record.targets == 4
        assert sample.kind == "label" and sample.output in ("no", "yes") and 0.5 <= sample.scores[0] <= 1


def test_which_versions_are_due() -> None:
    from relay_server.observers.evaluation import Schedule
    from tests.support.clock import Clock

    clock = Clock()
    every_3 = Schedule(3, 0.0, clock=clock)
    assert [s for s in range(1, 11) if every_3.due(s)] == [1, 4, 7, 10]
    assert every_3.due(11, finished=True)  # the run's last step, whatever the count
    assert every_3.due(5)  # a rollback: the version is new again
    resumed = Schedule(3, 0.0, last_step=20, clock=clock)  # after a restart: counted from the last record
    assert [s for s in range(21, 27) if resumed.due(s)] == [23, 26]
    timed = Schedule(0, 30.0, clock=clock)
    assert timed.due(1) and not timed.due(2)
    clock.now += 30.0
    assert timed.due(3) and not timed.due(4)
