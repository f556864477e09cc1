"""Configuration that means what it says: every field type-checked from the file and from
``RELAY_*`` overrides (lists and tables included), an override naming no setting refused like a
misspelled key, relative paths resolved against the config file, and overrides taking effect in
real relays (an allowlist both users join, a DMoE grid, the optimizer's betas)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import requests
import torch

from relay_server.core.config import ConfigError, load_config
from relay_server.core.typed import parse_env
from relay_server.harness.hf_standin import HfStandin
from relay_server.rounds.master import MasterState
from tests.support.moe import overrides as moe_run
from toolkit.client import RelayClient
from toolkit.errors import RelayRejected
from toolkit.wire.protocol import PROTOCOL_VERSION, JoinRequest, ParamSpec


def refusal(env: dict[str, str] | None = None, toml: str | None = None, tmp_path: Path | None = None) -> str:
    """The one-line message a configuration is refused with."""
    path = None
    if toml is not None:
        assert tmp_path is not None
        path = tmp_path / "run.toml"
        path.write_text(toml)
    with pytest.raises(ConfigError) as refused:
        load_config(path, env=env or {})
    message = str(refused.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "toml, message",
    [
        (
            '[run]\ntarget_batch = "64"',
            'run.target_batch must be an integer, got "64" (a string): write it without quotes',
        ),
        ("[run]\ntarget_batch = 64.5", "run.target_batch must be an integer, got 64.5 (a number)"),
        (
            '[server]\nfsync = "yes"',
            'server.fsync must be true or false, got "yes" (a string): write it without quotes',
        ),
        (
            '[auth]\nallow_users = "alice,bob"',
            'auth.allow_users must be a list of strings, got "alice,bob" (a string)',
        ),
        ("[auth]\nallow_users = [1]", "auth.allow_users[0] must be a string, got 1 (an integer)"),
        ('[moe]\ngrid = [4, "4"]', 'moe.grid[1] must be an integer, got "4" (a string): write it without quotes'),
        ("[optimizer]\nbetas = 0.9", "optimizer.betas must be a list of numbers, got 0.9 (a number)"),
        (
            "[optimizer]\nbetas = [0.9, 0.95, 0.99]",
            "optimizer.betas must be two numbers in [0, 1), e.g. [0.9, 0.999]; got [0.9, 0.95, 0.99]",
        ),
        ("[model]\nkwargs = 3", "model.kwargs must be a table, got 3 (an integer)"),
        ("dataset = 3", "dataset must be a table, got 3 (an integer)"),
        (
            "[run]\ntarget_bacth = 64",
            "unknown setting run.target_bacth (did you mean run.target_batch?): fix or remove it",
        ),
        ("[servr]\nport = 1", "unknown setting servr (did you mean server?): fix or remove it"),
    ],
)
def test_every_field_is_type_checked_from_the_file(tmp_path: Path, toml: str, message: str) -> None:
    assert refusal(toml=toml, tmp_path=tmp_path) == message


def test_fixed_length_lists_and_overrides_from_code_are_checked_too() -> None:
    """The generic machinery: tuple[float, float] from the environment, and values a caller passes
    (``relay-server serve --port``, the demo) meet the same types as the file's."""
    assert parse_env("0.9, 0.95", tuple[float, float], "x.pair", "RELAY_X_PAIR") == (0.9, 0.95)
    assert parse_env("[0.9, 1]", tuple[float, float], "x.pair", "RELAY_X_PAIR") == (0.9, 1.0)
    with pytest.raises(ConfigError) as refused:
        parse_env("0.9", tuple[float, float], "x.pair", "RELAY_X_PAIR")
    assert str(refused.value) == (
        "RELAY_X_PAIR='0.9' is not a list of exactly 2 values (a number, a number) for "
        "x.pair (1 comma-separated value(s), 2 expected): write RELAY_X_PAIR as an array "
        "('[0.9, 0.95]') or comma-separated (0.9,0.95)"
    )
    for overrides, message in [
        (
            {"run": {"target_batch": "64"}},
            'run.target_batch must be an integer, got "64" (a string): write it without quotes',
        ),
        ({"run": {"target_bach": 64}}, "unknown setting run.target_bach (did you mean run.target_batch?)"),
    ]:
        with pytest.raises(ConfigError) as refused:
            load_config(None, env={}, overrides=overrides)
        assert str(refused.value) == message


def test_lists_and_tables_from_the_environment_in_either_syntax() -> None:
    forms = {
        "RELAY_AUTH_ALLOW_USERS": ["alice,bob", " alice , bob ,", '["alice", "bob"]', "['alice', 'bob']"],
        "RELAY_MOE_GRID": ["2,3", "[2, 3]"],
        "RELAY_OPTIMIZER_BETAS": ["0.5,0.6", "[0.5, 0.6]"],
        "RELAY_MOE_EXPERT": ['{ kind = "ffn", d = 8, hidden = 16 }', '{"kind": "ffn", "d": 8, "hidden": 16}'],
    }
    expected = {
        "RELAY_AUTH_ALLOW_USERS": ["alice", "bob"],
        "RELAY_MOE_GRID": [2, 3],
        "RELAY_OPTIMIZER_BETAS": [0.5, 0.6],
        "RELAY_MOE_EXPERT": {"kind": "ffn", "d": 8, "hidden": 16},
    }
    where = {
        "RELAY_AUTH_ALLOW_USERS": ("auth", "allow_users"),
        "RELAY_MOE_GRID": ("moe", "grid"),
        "RELAY_OPTIMIZER_BETAS": ("optimizer", "betas"),
        "RELAY_MOE_EXPERT": ("moe", "expert"),
    }
    for variable, values in forms.items():
        for value in values:
            section, name = where[variable]
            got = getattr(getattr(load_config(None, env={variable: value}), section), name)
            assert got == expected[variable] and type(got) is type(expected[variable]), (variable, value, got)
    config = load_config(
        None,
        env={
            "RELAY_AUTH_ALLOW_USERS": "",
            "RELAY_SERVER_FSYNC": "on",
            "RELAY_ROUNDS_CLIP_TAU": "2.5",
            "RELAY_DATASET": '{ kind = "demo_corpus" }',
        },
    )
    assert (config.auth.allow_users, config.server.fsync, config.rounds.clip_tau) == ([], True, 2.5)
    assert config.dataset == {"kind": "demo_corpus"}


@pytest.mark.parametrize(
    "variable, value, message",
    [
        (
            "RELAY_MOE_GRID",
            "4x4",
            "RELAY_MOE_GRID='4x4' is not a list of integers for moe.grid ('4x4' is not an "
            "integer): write RELAY_MOE_GRID as an array ('[4, 4]') or comma-separated (4,4)",
        ),
        (
            "RELAY_OPTIMIZER_BETAS",
            "0.9;0.95",
            "RELAY_OPTIMIZER_BETAS='0.9;0.95' is not a list of numbers for "
            "optimizer.betas ('0.9;0.95' is not a number): write RELAY_OPTIMIZER_BETAS as an array ('[0.9, 0.95]') "
            "or comma-separated (0.9,0.95)",
        ),
        (
            "RELAY_AUTH_ALLOW_USERS",
            "[alice, bob]",
            "RELAY_AUTH_ALLOW_USERS='[alice, bob]' is not a list of strings for "
            "auth.allow_users (neither a TOML nor a JSON value; quote strings): write RELAY_AUTH_ALLOW_USERS as an "
            'array (\'["alice", "bob"]\') or comma-separated (alice,bob)',
        ),
        (
            "RELAY_MOE_EXPERT",
            "d=32",
            "RELAY_MOE_EXPERT='d=32' is not a table for moe.expert (does not start with {): "
            "write RELAY_MOE_EXPERT as a TOML inline table ('{ d = 32 }') or a JSON object ('{\"d\": 32}')",
        ),
        (
            "RELAY_RUN_TARGET_BATCH",
            "64.5",
            "RELAY_RUN_TARGET_BATCH='64.5' is not an integer for run.target_batch "
            "(not a whole number): write RELAY_RUN_TARGET_BATCH as an integer",
        ),
        (
            "RELAY_SERVER_FSYNC",
            "maybe",
            "RELAY_SERVER_FSYNC='maybe' is not true or false for server.fsync (not a "
            "true/false word): write RELAY_SERVER_FSYNC=true or RELAY_SERVER_FSYNC=false",
        ),
        (
            "RELAY_OPTIMIZER_BETAS",
            "0.9",
            "optimizer.betas must be two numbers in [0, 1), e.g. [0.9, 0.999]; got [0.9]",
        ),
    ],
)
def test_a_bad_override_ends_in_one_line_naming_the_variable_and_the_syntax(
    variable: str, value: str, message: str
) -> None:
    assert refusal(env={variable: value}) == message


@pytest.mark.parametrize(
    "variable, suggestion",
    [
        ("RELAY_RUN_TARGET_BACTH", "RELAY_RUN_TARGET_BATCH"),  # a known section, a misspelled field
        ("RELAY_SERVR_PORT", "RELAY_SERVER_PORT"),  # a misspelled section
        ("RELAY_TARGET_BATCH", "RELAY_RUN_TARGET_BATCH"),  # the section left out
        ("RELAY_PORT", "RELAY_SERVER_PORT"),
        ("RELAY_TARGT_BATCH", "RELAY_RUN_TARGET_BATCH"),  # both
        ("RELAY_DATASET_KIND", "RELAY_DATASET"),  # a free-form table is overridden whole
    ],
)
def test_an_override_naming_no_setting_is_refused_with_the_closest_name(variable: str, suggestion: str) -> None:
    assert refusal(env={variable: "64"}) == (
        f"environment variable {variable} names no setting (did you mean {suggestion}?): fix or unset it "
        "(overrides are RELAY_<SECTION>_<FIELD>, e.g. RELAY_RUN_TARGET_BATCH)"
    )


def test_relay_variables_that_are_not_overrides_are_left_alone() -> None:
    """Nothing in the project reads a RELAY_* variable but the overrides; a shell's RELAY_URL is not ours."""
    config = load_config(None, env={"RELAY_URL": "https://relay.example.org", "RELAY_HOME": "/srv"})
    assert config.run.target_batch == load_config(None, env={}).run.target_batch


def test_relative_paths_resolve_against_the_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    org, elsewhere = tmp_path / "org", tmp_path / "elsewhere"
    org.mkdir()
    elsewhere.mkdir()
    (org / "init.safetensors").write_bytes(b"")  # only its existence is checked at load
    (org / "config.json").write_text('{"model_type": "albert", "vocab_size": 32}')
    (org / "run.toml").write_text(
        '[server]\ndata_dir = "relay-data"\n[auth]\nmode = "open"\n[admin]\ntoken_file = "secrets/admin"\n'
        '[model]\nkind = "transformers"\narchitecture = "AutoModelForMaskedLM"\nconfig_file = "config.json"\n'
        'init_checkpoint = "init.safetensors"\n'
        '[dataset]\nkind = "stream"\n[[dataset.sources]]\ndata_files = ["shards/*.txt", "/abs/a.txt"]\n'
        '[[dataset.sources]]\ndata_files = "one.txt"\n'
        '[[dataset.sources]]\nrepo = "org/corpus"\ndata_files = ["train/*.parquet"]\n'
        '[[dataset.sources]]\ndata_files = ["hf://datasets/org/c/x.txt"]\n'
    )
    monkeypatch.chdir(elsewhere)
    config = load_config(Path("../org/run.toml"), env={})
    real = org.resolve()
    assert config.server.data_dir == str(real / "relay-data")
    assert config.admin.token_file == str(real / "secrets/admin")
    assert config.model.init_checkpoint == str(real / "init.safetensors")
    assert config.model.config == {"model_type": "albert", "vocab_size": 32}
    assert [s["data_files"] for s in config.dataset["sources"]] == [
        [str(real / "shards/*.txt"), "/abs/a.txt"],
        str(real / "one.txt"),
        ["train/*.parquet"],
        ["hf://datasets/org/c/x.txt"],
    ]
    # A path given in the environment (or on the command line) is a shell path: the working directory's.
    moved = load_config(Path("../org/run.toml"), env={"RELAY_SERVER_DATA_DIR": "here"})
    assert moved.server.data_dir == str(elsewhere.resolve() / "here")
    (org / "init.safetensors").unlink()
    assert refusal(toml=(org / "run.toml").read_text(), tmp_path=org) == (
        f"model.init_checkpoint: no file {real / 'init.safetensors'} (relative paths start at the config "
        "file's directory)"
    )


def test_betas_from_the_environment_drive_the_relays_optimizer() -> None:
    """The relay's own MasterState, built from a config whose betas came from RELAY_OPTIMIZER_BETAS,
    steps exactly like torch's AdamW with those betas, and unlike the file's."""
    layout = [ParamSpec(name="w", shape=(3, 4), offset=0), ParamSpec(name="b", shape=(4,), offset=12)]
    start = np.linspace(-1, 1, 16, dtype=np.float32)
    grads = [np.random.default_rng(i).standard_normal(16).astype(np.float32) for i in range(3)]

    def relay_steps(env: dict[str, str]) -> np.ndarray:
        cfg = load_config(None, env={"RELAY_OPTIMIZER_CLIP_GRAD_NORM": "0", **env}).optimizer
        master = MasterState(layout, start.copy(), cfg, total_steps=0)
        for g in grads:
            master.grad.copy_(torch.from_numpy(g))
            master.apply_gradient()
        return master.flat.numpy().copy()

    cfg = load_config(None, env={"RELAY_OPTIMIZER_BETAS": "0.5,0.6"}).optimizer
    w, b = (
        torch.nn.Parameter(torch.from_numpy(start[:12].reshape(3, 4).copy())),
        torch.nn.Parameter(torch.from_numpy(start[12:].copy())),
    )
    reference = torch.optim.AdamW(
        [{"params": [w], "weight_decay": cfg.weight_decay}, {"params": [b], "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.5, 0.6),
        eps=cfg.eps,
    )
    for g in grads:
        w.grad, b.grad = torch.from_numpy(g[:12].reshape(3, 4).copy()), torch.from_numpy(g[12:].copy())
        reference.step()
    expected = np.concatenate([w.detach().numpy().ravel(), b.detach().numpy()])
    overridden = relay_steps({"RELAY_OPTIMIZER_BETAS": "0.5,0.6"})
    assert cfg.name == "adamw" and np.allclose(overridden, expected, rtol=0, atol=1e-5)
    assert np.abs(relay_steps({}) - expected).max() > 1e-3  # the file's betas step differently


ALICE, BOB, MALLORY = "hf_alice_token_123456", "hf_bob_token_12345678", "hf_mallory_token_1234"


def test_an_allowlist_from_the_environment_admits_both_users(
    serve_relay, hf_standin: HfStandin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RELAY_AUTH_ALLOW_USERS=alice,bob used to become the set of the string's characters."""
    for token, name in ((ALICE, "alice"), (BOB, "bob"), (MALLORY, "mallory")):
        hf_standin.add_user(token, name)
    monkeypatch.setenv("RELAY_AUTH_ALLOW_USERS", "alice,bob")
    relay = serve_relay({"auth": {"mode": "hf", "hf_endpoint": hf_standin.url}})  # the file lists nobody
    for token, name in ((ALICE, "alice"), (BOB, "bob")):
        client = RelayClient(relay.url, retries=0)
        client.login(token)
        client.join(JoinRequest(peer_name=f"{name}-laptop", protocol=PROTOCOL_VERSION))
    with pytest.raises(RelayRejected) as refused:
        RelayClient(relay.url, retries=0).login(MALLORY)
    assert refused.value.status == 403
    assert relay.status()["num_peers"] == 2


def test_a_grid_from_the_environment_shapes_the_relays_experts(serve_relay, monkeypatch) -> None:
    monkeypatch.setenv("RELAY_MOE_GRID", "2,3")
    monkeypatch.setenv("RELAY_MOE_EXPERT", '{ kind = "ffn", d = 8, hidden = 16 }')
    relay = serve_relay({"moe": {"enabled": True, "layers": 2}})
    spec = requests.get(relay.url + "/api/moe/spec", timeout=10).json()
    assert spec["grid"] == [2, 3] and spec["expert"] == {"kind": "ffn", "d": 8, "hidden": 16}


def test_frozen_experts_need_no_learning_rate_and_training_ones_do() -> None:
    """``[moe] optimizer = { name = "none" }``: hosts only compute (the exactness test of several
    micro-batches in flight); sgd or adam without an lr is refused in one line that says so."""
    frozen = moe_run(3, experts_learn=False)
    assert load_config(None, env={}, overrides=frozen).moe.optimizer == {"name": "none"}
    frozen["moe"] = {**frozen["moe"], "optimizer": {"name": "sgd"}}
    with pytest.raises(ConfigError) as refused:
        load_config(None, env={}, overrides=frozen)
    assert str(refused.value) == (
        "moe.optimizer needs name in ('none', 'sgd', 'adam') and lr > 0 (none: experts are not trained)"
    )
