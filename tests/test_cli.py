"""``relay-server`` as an organizer first meets it: --version, init, serve without a config,
a config that is missing or wrong (refused before any state is created), a config served from
another directory, and help on every option."""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relay_server.cli import build_parser, main, version
from relay_server.core.config import ConfigError, load_config
from relay_server.harness import zygote

pytestmark = pytest.mark.integration  # starts relay, peer or tool processes

REPO = Path(__file__).resolve().parent.parent


def relay_server(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return zygote.run(
        [sys.executable, "-m", "relay_server.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


SMALL_RUN = '[auth]\nmode = "open"\n[model]\nfactory = "toolkit.models:MLP"\nkwargs = { sizes = [8, 16, 1] }\n'
"""An open run of a tiny model, ending inside [model]; with [server] data_dir it starts."""


def test_version_prints_the_installed_version() -> None:
    done = relay_server("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"collabtrain {version()}"
    assert version()[0].isdigit()


def test_serve_without_a_config_refuses_pointing_at_init_and_demo() -> None:
    done = relay_server("serve")
    assert done.returncode == 2
    assert "relay-server serve needs --config RUN.toml" in done.stderr
    assert "relay-server init RUN.toml" in done.stderr and "relay-server demo" in done.stderr


def test_a_missing_or_wrong_config_names_the_file_and_the_field(tmp_path: Path) -> None:
    done = relay_server("serve", "--config", str(tmp_path / "nope.toml"))
    assert done.returncode == 2 and f"cannot read config file {tmp_path / 'nope.toml'}" in done.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('[run]\ntarget_batch = "many"\n')
    done = relay_server("serve", "--config", str(bad))
    assert done.returncode == 2 and done.stderr == (
        "relay-server: configuration error: run.target_batch must be "
        'an integer, got "many" (a string): write it without quotes\n'
    )


@pytest.mark.parametrize(
    "toml, env, message",
    [
        (
            '[server]\ndata_dir = "relay-data"\n' + SMALL_RUN,
            {"RELAY_RUN_TARGET_BACTH": "64"},
            "environment variable RELAY_RUN_TARGET_BACTH names no setting (did you mean RELAY_RUN_TARGET_BATCH?): fix or "
            "unset it (overrides are RELAY_<SECTION>_<FIELD>, e.g. RELAY_RUN_TARGET_BATCH)",
        ),
        (
            '[server]\ndata_dir = "relay-data"\n' + SMALL_RUN,
            {"RELAY_MOE_GRID": "4x4"},
            "RELAY_MOE_GRID='4x4' is not a list of integers for moe.grid ('4x4' is not an integer): write RELAY_MOE_GRID "
            "as an array ('[4, 4]') or comma-separated (4,4)",
        ),
        (
            '[server]\ndata_dir = "relay-data"\n' + SMALL_RUN + 'init_checkpoint = "missing.safetensors"\n',
            {},
            "model.init_checkpoint: no file {org}/missing.safetensors (relative paths start at the config file's directory)",
        ),
        (
            SMALL_RUN,
            {},
            'server.data_dir is not set: add data_dir = "relay-data" under [server] in ../org/run.toml '
            "(relative to that file), or pass --data-dir DIR",
        ),
    ],
)
def test_a_refused_config_leaves_nothing_behind(tmp_path: Path, toml: str, env: dict[str, str], message: str) -> None:
    """One line naming the setting and the fix, before any data dir or admin token exists."""
    org, elsewhere = tmp_path / "org", tmp_path / "elsewhere"
    org.mkdir()
    elsewhere.mkdir()
    (org / "run.toml").write_text(toml)
    done = relay_server("serve", "--config", "../org/run.toml", "--port", "0", cwd=elsewhere, env=env)
    assert done.returncode == 2
    assert done.stderr == f"relay-server: configuration error: {message.format(org=org.resolve())}\n"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["elsewhere", "org", "run.toml"]


def test_serve_from_another_directory_uses_the_config_files_directory(tmp_path: Path) -> None:
    """``cd elsewhere && relay-server serve --config ../org/run.toml`` continues the run next to the
    config instead of starting a new one (new admin token, step 0) in the working directory."""
    org, elsewhere = tmp_path / "org", tmp_path / "elsewhere"
    org.mkdir()
    elsewhere.mkdir()
    (org / "run.toml").write_text('[server]\ndata_dir = "relay-data"\n' + SMALL_RUN)
    ready = tmp_path / "ready"
    relay = zygote.Popen(
        [
            sys.executable,
            "-m",
            "relay_server.cli",
            "serve",
            "--config",
            "../org/run.toml",
            "--port",
            "0",
            "--ready-file",
            str(ready),
        ],
        cwd=elsewhere,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and relay.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), relay.communicate(timeout=10)[0] if relay.poll() is not None else "relay did not start"
        assert (org / "relay-data" / "admin_token").is_file()
        assert list(elsewhere.iterdir()) == []
    finally:
        relay.terminate()
        relay.wait(timeout=30)


def test_init_writes_a_commented_config_with_login_on_and_an_allowlist_to_fill(tmp_path: Path, capsys) -> None:
    path = tmp_path / "my-run.toml"
    assert main(["init", str(path)]) == 0
    assert f"relay-server serve --config {path}" in capsys.readouterr().out
    text = path.read_text()
    assert 'mode = "hf"' in text and "allow_users = []" in text and text.count("#") > 10
    assert 'host = "127.0.0.1"' in text and '"0.0.0.0" only for a test on a private network' in text
    with pytest.raises(ConfigError, match="auth.mode = 'hf' needs auth.allow_users"):
        load_config(path)  # serve refuses until someone may join
    path.write_text(text.replace("allow_users = []", 'allow_users = ["alice"]'))
    config = load_config(path)
    assert config.auth.mode == "hf" and config.auth.allow_users == ["alice"]
    assert config.server.host == "127.0.0.1" and config.server.data_dir == str(tmp_path / "relay-data")
    assert main(["init", str(path)]) == 2  # never overwrites an edited file
    assert "exists: edit it, or pass --force" in capsys.readouterr().err
    assert main(["init", str(path), "--force"]) == 0 and "allow_users = []" in path.read_text()


def test_a_config_missing_only_its_allowlist_is_refused_before_the_model_is_built(tmp_path: Path) -> None:
    """The file ``init`` writes, served as is: the missing allowlist is a check of the file's own
    settings, so it is refused before the model checks build the model (seconds of CPU) --
    measured as the CLI process's CPU time, whatever the machine's load."""
    path = tmp_path / "run.toml"
    assert main(["init", str(path)]) == 0
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = relay_server("serve", "--config", str(path))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert done.returncode == 2 and done.stderr == (
        "relay-server: configuration error: auth.mode = 'hf' needs auth.allow_users, auth.allow_orgs or "
        "auth.allow_any_hf_user = true (or auth.mode = 'open' for a local experiment)\n"
    )
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu_s < 1.0, f"{cpu_s:.2f} s of CPU to refuse a missing allowlist"
    assert not (tmp_path / "relay-data").exists()


def _options(parser: argparse.ArgumentParser, where: str = "relay-server"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{where} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield where, action


def test_every_option_has_help() -> None:
    missing = [
        f"{where} {'/'.join(a.option_strings) or a.dest}" for where, a in _options(build_parser()) if not a.help
    ]
    assert not missing, missing


def test_admin_never_guesses_where_the_token_is(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No silent ``./relay-data``: the organizer names the relay's config, data dir or token file."""
    with pytest.raises(SystemExit) as usage:
        main(["admin", "--url", "http://127.0.0.1:9", "bans"])
    assert usage.value.code == 2
    assert "one of the arguments --config --data-dir --token-file is required" in capsys.readouterr().err
    data = tmp_path / "where-the-relay-keeps-state"
    config = tmp_path / "run.toml"
    config.write_text(f'[server]\ndata_dir = "{data}"\n[auth]\nmode = "open"\n')
    assert main(["admin", "--url", "http://127.0.0.1:9", "--config", str(config), "bans"]) == 2
    err = capsys.readouterr().err
    assert f"no admin token in {data / 'admin_token'}" in err
    assert "pass the --config or --data-dir it runs with, or --token-file with a copy" in err
