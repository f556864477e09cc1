"""A pipeline run's versions are whole-model versions: what users load and the relay evaluates.

End to end: a real relay (in this process) and real stage-worker processes train a few batches;
then ``relay-server export`` writes the latest version as a folder, loaded the way a user loads
it (``AutoModelForCausalLM.from_pretrained`` for GPT-2 and Llama, ``build_model`` + ``load_state_dict``
for the toolkit's model, as the folder's ``collabtrain-model.json`` says), and its logits must
equal those of the relay's own stages -- each built from its cut and loaded with the slice the
relay publishes for it -- chained as the workers chain them. ``[evaluation]`` on a pipeline run
scores those versions: its records reach ``/api/status``, the dashboard's source. And Hub
checkpoints (against tests/hub_standin.py) upload them, and a new pipeline run starts from one.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load, load_file

from relay_server.cli import main
from relay_server.core.config import load_config
from relay_server.harness.process import wait_until
from relay_server.observers.eval_model import score, validation_batches
from relay_server.observers.hub_checkpoints import INFO_FILE
from relay_server.observers.pretrained import MODEL_FILE
from relay_server.pipeline.model_cut import cut_model
from tests.hub_standin import HubStandin
from tests.support.pipeline import pipeline_overrides
from tests.support.pipeline_models import BYTE_SPEC, DEFAULT_GPT2_SPEC, GPT2_SPEC, GPT2_VOCAB, LLAMA_SPEC
from tests.support.training import relay_params
from toolkit.models import build_model
from toolkit.models.flat import load_flat
from toolkit.pipeline import build_stage, cut_stages, units_of
from toolkit.pipeline.decoder import DecoderStage
from toolkit.wire.protocol import ModelSpec

RECIPE = Path(__file__).resolve().parent.parent / "relay_server" / "defaults" / "pipeline-tiny.toml"
STEPS = 2


def recipe_overrides() -> dict:
    """The ``pipeline-tiny`` recipe as shipped, but for its port (the harness picks one) and its
    fp32 pin (the test's workers join without a device, as they do in tests/test_pipeline.py)."""
    sections = tomllib.loads(RECIPE.read_text())
    sections["server"] = {k: v for k, v in sections["server"].items() if k != "port"}
    sections["run"] = {k: v for k, v in sections["run"].items() if k != "precision"}
    return sections


RUNS = {
    "pipeline-tiny": recipe_overrides,
    "gpt2": lambda: pipeline_overrides(GPT2_SPEC, stages=2),
    "gpt2-default": lambda: pipeline_overrides(DEFAULT_GPT2_SPEC, stages=2),  # tied embeddings, dropout 0.1
    "llama": lambda: pipeline_overrides(LLAMA_SPEC, stages=2),
}


def train(serve_relay, launch_stage_worker, overrides: dict):
    """Two workers (a stage each) train ``STEPS`` batches; the relay and its published version."""
    relay = serve_relay(overrides)
    workers = [launch_stage_worker(relay.url, f"w{i}", seed=i, until_step=STEPS) for i in range(2)]
    for worker in workers:
        assert worker.wait(timeout_s=300) == 0, worker.log_path.read_text()[-3000:]
    return relay, *relay_params(relay.url, min_step=STEPS)


def stages_logits(config, flat, tokens: torch.Tensor) -> torch.Tensor:
    """The relay's stages, each loaded with its published slice, chained on ``tokens``."""
    spec = config.model.spec()
    stages = [build_stage(spec, cut) for cut in cut_stages(units_of(spec), cut_model(config).layers)]
    for stage in stages:
        stage.load_flat(flat[stage.cut.start : stage.cut.end])
        if stage.tied is not None:  # the last stage's head: its copy of stage 0's tied matrix
            stage.load_tied(flat[stage.tied[0] : stage.tied[1]])
        stage.eval()
    with torch.no_grad():
        h = tokens
        for stage in stages:
            h = stage(h)
        last = stages[-1]
        if isinstance(last, DecoderStage):
            return last.body.lm_head(getattr(last.trunk, last.family.norm)(h))
        return last.body.logits(h)


def load_exported(folder: Path) -> torch.nn.Module:
    """The folder as a user loads it."""
    if (folder / "config.json").exists():
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(folder).eval()
    model = build_model(ModelSpec.from_json(json.loads((folder / "collabtrain-model.json").read_text())))
    model.load_state_dict(load_file(folder / "model.safetensors"))
    return model.eval()


@pytest.mark.parametrize(
    "run", [pytest.param(r, marks=pytest.mark.slow) if r == "llama" else r for r in sorted(RUNS)]
)  # (llama: 48 s here; its stages are exact in tests/test_pipeline.py's default tier)
def test_an_exported_pipeline_version_gives_the_stages_logits(serve_relay, launch_stage_worker, tmp_path, capsys, run):
    relay, step, flat = train(serve_relay, launch_stage_worker, RUNS[run]())
    out = tmp_path / "export"
    assert (
        main(
            [
                "export",
                "--config",
                str(tmp_path / "relay.toml"),
                "--data-dir",
                str(tmp_path / "relay-data"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert f"version {step} written" in capsys.readouterr().out  # the latest version, not the initial one
    config = load_config(tmp_path / "relay.toml")
    model = load_exported(out)
    vocab = GPT2_VOCAB if config.model.kind == "transformers" else 256
    tokens = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        exported = model(tokens)
    exported = exported.logits if hasattr(exported, "logits") else exported
    if run == "gpt2-default":  # written once, tied again by from_pretrained
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    expected = stages_logits(config, torch.from_numpy(flat), tokens)
    assert exported.shape == expected.shape
    assert float((exported - expected).abs().max()) <= 1e-5


def test_evaluation_of_a_pipeline_run_reaches_the_status(serve_relay, launch_stage_worker, tmp_path):
    """``[evaluation]`` on the ``pipeline-tiny`` recipe: the last version's record is in
    ``/api/status``, and its loss is that of the relay's published parameters of that version,
    scored here on the same held-out windows."""
    held_out = tmp_path / "valid.txt"
    held_out.write_text("Held-out text the stage workers never see, to validate the whole model on.\n" * 8)
    overrides = {
        **recipe_overrides(),
        "evaluation": {"data_files": [str(held_out)], "samples": 4, "batch_size": 2, "seq_len": 32, "every_steps": 1},
    }
    relay, step, flat = train(serve_relay, launch_stage_worker, overrides)
    status = relay.wait_for(
        lambda s: s["evaluations"] and s["evaluations"][-1]["step"] == step,
        timeout_s=120,
        what=f"version {step} evaluated",
    )
    record = status["evaluations"][-1]
    config = load_config(tmp_path / "relay.toml")
    model = build_model(config.model.spec()).eval()
    load_flat(model, flat)
    expected = score(model, validation_batches(config, None), "")
    assert record["targets"] == expected["targets"] == 4 * 32  # 4 windows of 33 bytes: 32 next bytes each
    assert record["loss"] == pytest.approx(expected["loss"], rel=1e-5)


TOKEN = "hf_test_organizer_write_token"  # a fake
REPO_ID = "organizer/pipeline-ckpt"


def test_hub_checkpoints_of_a_pipeline_run_and_a_pipeline_run_from_one(
    serve_relay, launch_stage_worker, tmp_path, hub_standin: HubStandin, monkeypatch
):
    """Every version is uploaded as the whole model by name; a new pipeline run with
    ``hub.init_from`` that commit starts every stage from exactly those parameters."""
    hub_standin.add_user(TOKEN, "organizer", role="write")
    monkeypatch.setenv("COLLAB_TEST_HUB_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    hub = {"endpoint": hub_standin.url, "token_env": "COLLAB_TEST_HUB_TOKEN"}
    run = pipeline_overrides(BYTE_SPEC, stages=2)
    relay, step, flat = train(
        serve_relay, launch_stage_worker, {**run, "hub": {**hub, "repo_id": REPO_ID, "every_steps": 1}}
    )
    wait_until(
        lambda: any(json.loads(c.files[INFO_FILE])["step"] == step for c in hub_standin.commits(REPO_ID)),
        120,
        f"the checkpoint of step {step}",
    )
    commit = next(c for c in hub_standin.commits(REPO_ID) if json.loads(c.files[INFO_FILE])["step"] == step)
    named = load(commit.files[MODEL_FILE])
    model = build_model(BYTE_SPEC)
    assert np.array_equal(torch.cat([named[name].reshape(-1) for name, _ in model.named_parameters()]).numpy(), flat)

    fresh = serve_relay({**run, "hub": {**hub, "init_from": f"{REPO_ID}@{commit.oid}"}}, name="from-hub")
    fresh_step, params = relay_params(fresh.url)
    assert fresh_step == 0 and np.array_equal(params, flat)  # each stage's slice, as the checkpoint holds it
