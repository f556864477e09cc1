"""Hub checkpoints against a local stand-in of the Hub (tests/hub_standin.py).

The real ``huggingface_hub`` client talks to the stand-in over HTTP: a real relay process uploads
a checkpoint every ``hub.every_steps`` steps while real peers train, the files on the "Hub" are
byte-for-byte the relay's state, and a new run started from one begins from exactly those
parameters. Failures of the Hub never reach the rounds.
"""

from __future__ import annotations

import inspect
import json
import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load, save_file

from relay_server.collaboration.machine import Collaboration
from relay_server.core.config import ConfigError, load_config
from relay_server.harness.hf_standin import StandinResponse
from relay_server.harness.process import wait_until
from relay_server.observers.events import StepEvent
from relay_server.observers.hub_checkpoints import (
    INFO_FILE,
    STATE_FILE,
    HubCheckpointer,
    init_model_from_hub,
    load_hub_checkpoint,
    parse_init_from,
)
from relay_server.observers.pretrained import MODEL_FILE, master_params
from tests.hub_standin import HubStandin
from tests.support.processes import BASE_CONFIG, write_config
from tests.support.training import relay_params
from toolkit.models import build_model
from toolkit.wire.protocol import PlanInfo, RoundRecord, StatusReport

pytestmark = pytest.mark.integration  # starts relay, peer or tool processes

TOKEN = "hf_test_organizer_write_token"  # a fake; the test checks it never reaches a log
REPO_ID = "organizer/collab-ckpt"
MODEL = BASE_CONFIG["model"]


def relay_hub_config(hub: HubStandin, **hub_settings) -> dict:
    return {"hub": {"repo_id": REPO_ID, "endpoint": hub.url, "token_env": "COLLAB_TEST_HUB_TOKEN", **hub_settings}}


@pytest.fixture
def organizer(hub_standin: HubStandin, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> HubStandin:
    """The stand-in with a write token in the relay's environment (inherited by relay processes)."""
    hub_standin.add_user(TOKEN, "organizer", role="write")
    monkeypatch.setenv("COLLAB_TEST_HUB_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no ambient cache or saved token
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    return hub_standin


def in_process_config(tmp_path: Path, hub: HubStandin, **hub_settings):
    return load_config(
        None,
        env={},
        overrides={
            "model": {"factory": MODEL["factory"], "kwargs": MODEL["kwargs"]},
            "server": {"data_dir": str(tmp_path / "data")},
            **relay_hub_config(hub, **hub_settings),
        },
    )


def flat_params(named: dict[str, torch.Tensor], config) -> np.ndarray:
    model = build_model(config.model.spec())
    return torch.cat([named[name].reshape(-1) for name, _ in model.named_parameters()]).numpy()


def step_one(model: torch.nn.Module, state_path: Path) -> StepEvent:
    """Step 1 of a run of ``model`` as the relay's observers receive it: the model's own parameters
    written to ``state_path`` as the relay's state, one round of 8 samples at loss 0.5."""
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    save_file({"params": params}, str(state_path))
    record = RoundRecord(
        step=1,
        contributors=1,
        samples=8,
        loss=0.5,
        duration_s=0.1,
        deadline_s=2.0,
        finalized_by="all_arrived",
        finalized_at=time.time(),
    )
    status = StatusReport(
        run_name="r",
        step=1,
        total_steps=0,
        finished=False,
        target_batch=8,
        num_params=params.numel(),
        samples_accumulated=0,
        samples_per_s=0.0,
        eta_s=None,
        loss=0.5,
        num_peers=0,
        peers=[],
        recent_rounds=[record],
        round=None,
        auth_mode="open",
        uptime_s=1.0,
        plan=PlanInfo(version="v", steps_per_s=None, slices=[]),
    )
    return StepEvent(step=1, record=record, status=status, state_path=state_path)


# --- unit -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, expected",
    [("a/b", ("a/b", None)), ("a/b@main", ("a/b", "main")), ("org/m-1@0123abc", ("org/m-1", "0123abc"))],
)
def test_init_from_accepts_repo_and_revision(value, expected):
    assert parse_init_from(value) == expected


@pytest.mark.parametrize("value", ["b", "a/b/c", "/b", "a/b@", "a/@x"])
def test_init_from_rejects_malformed_values_naming_the_setting(value):
    with pytest.raises(ConfigError, match="hub.init_from"):
        parse_init_from(value)


def test_missing_token_is_a_config_error_naming_token_env(tmp_path, hub_standin, monkeypatch):
    monkeypatch.delenv("COLLAB_TEST_HUB_TOKEN", raising=False)
    config = in_process_config(tmp_path, hub_standin, every_steps=1)
    with pytest.raises(ConfigError, match="COLLAB_TEST_HUB_TOKEN.*hub.token_env"):
        HubCheckpointer(config)


def test_a_failing_hub_never_blocks_or_breaks_the_observer(tmp_path, organizer, caplog):
    """Commits answer 500, and only once on_step has returned: on_step never waits for the Hub; the
    error is logged without the token."""
    returned, released = threading.Event(), []

    def failing_commit(_) -> StandinResponse:
        released.append(returned.wait(60))  # held until on_step returned: it must not wait for this answer
        return StandinResponse(500, {"error": "boom"})

    organizer.add_route("POST", r"/api/models/.+/commit/.+", failing_commit)
    config = in_process_config(tmp_path, organizer, every_steps=1)
    model = build_model(config.model.spec())
    event = step_one(model, tmp_path / "step-00000001.safetensors")
    checkpointer = HubCheckpointer(config)
    with caplog.at_level(logging.INFO, logger="relay_server"):
        checkpointer.on_step(event)
        returned.set()  # staging only: the upload is another thread's job
        wait_until(lambda: "failed" in caplog.text, 60, "the upload error to be logged")
        assert released and all(released), "on_step waited for the Hub's answer"
        checkpointer.close()
    assert "Hub upload of step 1 to organizer/collab-ckpt failed" in caplog.text
    assert TOKEN not in caplog.text
    assert organizer.commits(REPO_ID) == [] and checkpointer.uploaded == []
    assert list((tmp_path / "data" / "hub-staging").iterdir()) == []  # nothing left behind


# --- end to end -----------------------------------------------------------------------------------
def test_relay_uploads_checkpoints_and_a_run_starts_from_one(tmp_path, organizer, start_relay, launch_peer):
    relay = start_relay({**relay_hub_config(organizer, every_steps=2, private=True), "run": {"target_batch": 24}})
    peer = launch_peer(relay.url, "p0", seed=0, batch_size=4, steps=4)  # one peer: rounds are not the point
    assert peer.wait() == 0, peer.log_path.read_text()[-2000:]
    final = relay.status()
    expected_steps = [s for s in range(1, final["step"] + 1) if s % 2 == 0]
    assert expected_steps[:2] == [2, 4], final["step"]
    wait_until(lambda: len(organizer.commits(REPO_ID)) >= len(expected_steps), 60, "the checkpoint commits")
    relay.stop()  # close() lets an upload in flight finish

    repo = organizer.repos[REPO_ID]
    assert repo.private, "hub.private = true must create a private repo"
    commits = organizer.commits(REPO_ID)
    losses = {r["step"]: r["loss"] for r in final["recent_rounds"]}
    uploaded = {}
    for commit in commits:
        info = json.loads(commit.files[INFO_FILE])
        uploaded[info["step"]] = commit
        state_file = relay.data_dir / "state" / f"step-{info['step']:08d}.safetensors"
        assert commit.files[STATE_FILE] == state_file.read_bytes()  # the relay's state, byte for byte
        named = load(commit.files[MODEL_FILE])
        assert np.array_equal(flat_params(named, load_config(relay.config_path)), master_params(state_file).numpy())
        assert any(k.startswith("opt.") for k in load(commit.files[STATE_FILE]))  # optimizer state travels too
        assert info["loss"] == pytest.approx(losses[info["step"]])
        assert info["config"]["num_params"] == final["num_params"] and info["model"]["factory"] == MODEL["factory"]
        assert commit.message.startswith(f"step {info['step']}: loss ")
        assert "README.md" in commit.files
    assert sorted(uploaded) == expected_steps, "one checkpoint every hub.every_steps steps, no other"
    writes = [c for c in organizer.calls if c[0] == "POST"]
    assert writes and all(had_token for _, _, had_token in writes)
    assert TOKEN not in relay.log_path.read_text()

    # A new run from the step-2 checkpoint, named by its commit: the parameters arrive exactly.
    step2 = load(uploaded[2].files[MODEL_FILE])
    config = in_process_config(tmp_path, organizer, init_from=f"{REPO_ID}@{uploaded[2].oid}")
    loaded = load_hub_checkpoint(config)
    assert loaded.keys() == step2.keys() and all(torch.equal(loaded[k], step2[k]) for k in step2)
    model = build_model(config.model.spec())
    init_model_from_hub(model, config)
    assert all(torch.equal(p, step2[name]) for name, p in model.named_parameters())

    if "init_model_from_hub" not in inspect.getsource(Collaboration):
        pytest.skip(
            "Collaboration does not call hub_checkpoints.init_model_from_hub yet (proposed change); "
            "the upload half and the loader passed"
        )
    fresh = start_relay(
        {
            "hub": {
                "init_from": f"{REPO_ID}@{uploaded[2].oid}",
                "endpoint": organizer.url,
                "token_env": "COLLAB_TEST_HUB_TOKEN",
            }
        },
        name="from-hub",
    )
    step, params = relay_params(fresh.url)
    assert step == 0  # a new run: its own step count, optimizer state fresh
    assert np.array_equal(params, flat_params(step2, config))


def test_init_from_errors_name_the_setting(tmp_path, organizer):
    config = in_process_config(tmp_path, organizer, init_from="organizer/nothing-here")
    with pytest.raises(ConfigError, match="hub.init_from: repository organizer/nothing-here not found"):
        load_hub_checkpoint(config)
    organizer.repos[REPO_ID] = _repo_with_model(organizer, {"other.weight": torch.zeros(3)})
    config = in_process_config(tmp_path, organizer, init_from=f"{REPO_ID}@deadbeefdead")
    with pytest.raises(ConfigError, match="hub.init_from: no revision 'deadbeefdead'"):
        load_hub_checkpoint(config)
    config = in_process_config(tmp_path, organizer, init_from=REPO_ID)
    with pytest.raises(ConfigError, match="does not fit the run's model"):
        init_model_from_hub(build_model(config.model.spec()), config)


def _repo_with_model(hub: HubStandin, tensors: dict[str, torch.Tensor]):
    from safetensors.torch import save

    from tests.hub_standin import Commit, Repo

    repo = Repo(REPO_ID, private=False)
    repo.commits.append(Commit("0" * 40, "initial", {MODEL_FILE: save(tensors)}))
    return repo


ALBERT = {
    "model_type": "albert",
    "vocab_size": 64,
    "embedding_size": 16,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 32,
}


@pytest.mark.parametrize("legacy_tied_copy", [False, True])
def test_init_from_accepts_a_save_pretrained_checkpoint_with_tied_weights(tmp_path, organizer, legacy_tied_copy):
    """A checkpoint made by transformers itself (not by collabtrain) starts a transformers run:
    ALBERT's tied decoder stored once (save_pretrained today) or twice (older checkpoints)."""
    import transformers
    from safetensors.torch import load_file

    fields = dict(ALBERT)
    source = transformers.AlbertForMaskedLM(transformers.AutoConfig.for_model(fields.pop("model_type"), **fields))
    source.save_pretrained(tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    if legacy_tied_copy:
        tensors["predictions.decoder.weight"] = tensors["albert.embeddings.word_embeddings.weight"].clone()
    organizer.repos[REPO_ID] = _repo_with_model(organizer, tensors)
    config = load_config(
        None,
        env={},
        overrides={
            "model": {"kind": "transformers", "architecture": "AutoModelForMaskedLM", "config": ALBERT},
            "server": {"data_dir": str(tmp_path / "data")},
            **relay_hub_config(organizer, init_from=REPO_ID),
        },
    )
    model = build_model(config.model.spec())
    init_model_from_hub(model, config)
    expected = dict(source.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, expected[name]), name
    assert model.predictions.decoder.weight is model.albert.embeddings.word_embeddings.weight  # still tied


def test_model_config_and_tokenizer_from_a_pinned_hub_repo(tmp_path, organizer):
    """[model] config_repo and [tokenizer] repo: the relay reads config.json and tokenizer.json
    of a pinned commit (peers get them from the relay); an unpinned repo or a missing file is a
    ConfigError naming the setting."""
    import hashlib
    import json
    import secrets

    from relay_server.data.tokenizer_train import train_tokenizer
    from tests.hub_standin import Commit, Repo
    from toolkit.corpus import demo_paragraphs

    trained = train_tokenizer(demo_paragraphs()[:200], vocab_size=64)
    tokenizer, albert = trained.to_str().encode(), {**ALBERT, "vocab_size": trained.get_vocab_size()}
    repo = Repo("organizer/albert-config", private=False)
    commit = secrets.token_hex(20)  # a new commit each run: the Hub client's cache never answers for it
    repo.commits.append(
        Commit(commit, "config", {"config.json": json.dumps(albert).encode(), "tokenizer.json": tokenizer})
    )
    organizer.repos[repo.repo_id] = repo

    def load(model: dict, tok: dict):
        return load_config(
            None,
            env={},
            overrides={
                "model": {"kind": "transformers", "architecture": "AutoModelForMaskedLM", "config": {}, **model},
                "tokenizer": tok,
                "objective": {},
                "server": {"data_dir": str(tmp_path / "data")},
                **relay_hub_config(organizer),
            },
        )

    config = load({"config_repo": f"{repo.repo_id}@{commit}"}, {"repo": f"{repo.repo_id}@{commit}"})
    assert config.model.config == albert and config.model.spec().config == albert
    assert config.tokenizer.sha256 == hashlib.sha256(tokenizer).hexdigest()
    with pytest.raises(ConfigError, match=r"model.config_repo must be 'owner/name@revision'.*pin a commit"):
        load({"config_repo": repo.repo_id}, {})
    other = secrets.token_hex(20)
    repo.commits.append(Commit(other, "no tokenizer", {"config.json": json.dumps(albert).encode()}))
    with pytest.raises(ConfigError, match=f"tokenizer.repo: organizer/albert-config@{other} has no tokenizer.json"):
        load({"config_repo": f"{repo.repo_id}@{other}"}, {"repo": f"{repo.repo_id}@{other}"})


def test_a_transformers_checkpoint_on_the_hub_loads_with_its_tokenizer(tmp_path, organizer):
    """The Hub commit of a masked-LM run holds what ``AutoTokenizer`` / ``AutoModelForMaskedLM``
    load in one line: the run's special tokens at their own ids, nothing appended past the
    vocabulary, and a padded fill-mask batch answers as each text alone does."""
    import transformers

    from relay_server.data.tokenizer_train import train_tokenizer
    from toolkit.corpus import demo_paragraphs

    tokenizer = train_tokenizer(demo_paragraphs()[:200], vocab_size=64)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    config = load_config(
        write_config(
            tmp_path / "run.toml",
            {
                "model": {
                    "kind": "transformers",
                    "architecture": "AutoModelForMaskedLM",
                    "config": {**ALBERT, "vocab_size": vocab},
                },
                "tokenizer": {"file": "tokenizer.json"},
                "objective": {"name": "masked-lm", "seq_len": 32},
                "server": {"data_dir": str(tmp_path / "data")},
                "auth": {"mode": "open"},
                **relay_hub_config(organizer, every_steps=1),
            },
        ),
        env={},
    )
    model = build_model(config.model.spec())
    checkpointer = HubCheckpointer(config)
    checkpointer.on_step(step_one(model, tmp_path / "step-00000001.safetensors"))
    wait_until(lambda: checkpointer.uploaded, 60, "the checkpoint commit")
    checkpointer.close()

    folder = tmp_path / "from-hub"
    folder.mkdir()
    for name, data in organizer.commits(REPO_ID)[-1].files.items():
        (folder / name).write_bytes(data)
    files = organizer.commits(REPO_ID)[-1].files
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"} <= set(files)
    assert f'AutoModelForMaskedLM.from_pretrained("{REPO_ID}"' in files["README.md"].decode()  # the card says how
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert len(tok) == vocab
    assert [tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id] == [
        tokenizer.token_to_id(t) for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
    ]
    loaded = transformers.AutoModelForMaskedLM.from_pretrained(folder)
    assert all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in loaded.named_parameters())
    fill = transformers.pipeline("fill-mask", model=loaded, tokenizer=tok, top_k=2)
    texts = ["the [MASK] is", "a longer [MASK] in it"]  # under 32 tokens of this tiny vocabulary
    assert len(tok(texts[0])["input_ids"]) < len(tok(texts[1])["input_ids"]) <= 32
    for batched, alone in zip(fill(texts, batch_size=2), [fill(t) for t in texts]):
        assert [x["token"] for x in batched] == [x["token"] for x in alone]
        assert [x["score"] for x in batched] == pytest.approx([x["score"] for x in alone], abs=1e-5)
