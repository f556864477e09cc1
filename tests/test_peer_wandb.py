"""The peer's own W&B run: off by default at no cost, never an interactive login, and in offline
mode the run file holds one row per global step with the metrics the volunteer cares about.

The run file (``run-<id>.wandb``) is read back with the relay W&B tests' reader (LevelDB log
framing around wandb's own protobuf ``Record`` schema; no installed wandb API reads it).
"""

from __future__ import annotations

import logging
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.support.progress import progress
from tests.support.relays import running_relay
from tests.support.wandb_records import finished_run_records, history_rows, run_config
from toolkit.notebook.wandb_run import NullRun, WandbRun, WandbTarget, open_wandb_run
from toolkit.session import join


def offline_run(wandb_dir: Path) -> tuple[Any, dict[str, Any], list[dict[str, Any]]]:
    """(the run record, its config, the history rows) of the one offline run under ``wandb_dir``."""
    files = list(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, list(wandb_dir.rglob("*"))
    records = finished_run_records(files[0])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    return run, run_config(records), history_rows(records)


def test_target_parses_project_and_entity() -> None:
    assert WandbTarget.parse(None) is None and WandbTarget.parse("") is None
    assert WandbTarget.parse("collab") == WandbTarget(project="collab")
    assert WandbTarget.parse("team/collab", mode="offline") == WandbTarget(
        project="collab", entity="team", mode="offline"
    )


def test_off_costs_nothing_and_online_without_a_key_never_prompts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import wandb

    monkeypatch.setattr(wandb, "init", lambda *a, **k: pytest.fail("wandb.init must not be called"))
    for var in ("WANDB_API_KEY", "WANDB_MODE", "COLAB_RELEASE_TAG", "KAGGLE_KERNEL_RUN_TYPE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    assert isinstance(open_wandb_run(None, name="alice", group="g", config={}), NullRun)
    assert isinstance(
        open_wandb_run(WandbTarget(project="p", mode="disabled"), name="a", group="g", config={}), NullRun
    )
    caplog.set_level(logging.WARNING)
    assert isinstance(open_wandb_run(WandbTarget(project="p"), name="alice", group="g", config={}), NullRun)
    assert "add WANDB_API_KEY to its secrets" in caplog.text


def test_a_failing_wandb_init_leaves_training_alone(
    offline_wandb: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import wandb

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise wandb.errors.CommError("entity team not found")

    monkeypatch.setattr(wandb, "init", refuse)
    run = open_wandb_run(WandbTarget(project="p", entity="team"), name="alice", group="g", config={})
    assert isinstance(run, NullRun) and "entity team not found" in caplog.text


@pytest.mark.integration
def test_offline_run_holds_one_row_per_global_step(offline_wandb: Path) -> None:
    run = open_wandb_run(
        WandbTarget(project="collab-test"), name="alice", group="demo-byte-lm", config={"peer_id": "abc"}
    )
    assert isinstance(run, WandbRun)
    # Three micro-batches on step 4, two on step 5 (the first contribution lands there), one on step 6.
    losses = {4: [3.0, 2.0, 1.0], 5: [0.5, 1.5], 6: [0.25]}
    for step, values in losses.items():
        for i, loss in enumerate(values):
            contributed = 0 if step == 4 else 16 * (step - 4)
            run.update(
                progress(
                    global_step=step,
                    loss=loss,
                    contributed_samples=contributed,
                    local_samples_per_s=10.0 + step,
                    first_contribution_s=None if step == 4 else 1.25,
                )
            )
    run.close()
    run.close()  # idempotent

    record, _, rows = offline_run(offline_wandb)
    assert record.display_name == "alice" and record.project == "collab-test" and record.run_group == "demo-byte-lm"
    assert [r["global_step"] for r in rows] == [4, 5, 6]
    assert [r["local_loss"] for r in rows] == [2.0, 1.0, 0.25]
    assert [r["contributed_samples"] for r in rows] == [0, 16, 32]
    assert [r["local_samples_per_s"] for r in rows] == [14.0, 15.0, 16.0]
    assert "first_contribution_s" not in rows[0] and rows[1]["first_contribution_s"] == 1.25


@pytest.mark.integration
def test_join_logs_the_volunteers_run_named_by_peer_in_open_mode(offline_wandb: Path, tmp_path: Path) -> None:
    with running_relay(tmp_path) as relay:
        result = join(relay.url, max_steps=2, panel="none", peer_name="volunteer-7", wandb_project="collab-test")
    record, config, rows = offline_run(offline_wandb)
    assert record.display_name == "volunteer-7" and record.run_group == "demo-byte-lm"
    assert config["peer_id"] == result.peer_id and config["batch_size"] == 8 and config["device_kind"] == "cpu"
    steps = [r["global_step"] for r in rows]
    assert steps == sorted(set(steps)) and steps[-1] == result.final_step  # one row per step, the last at close
    assert rows[-1]["contributed_samples"] == result.contributed_samples == 32
    assert rows[-1]["first_contribution_s"] == pytest.approx(result.first_contribution_s)
    assert all(r["local_loss"] > 0 for r in rows)


@pytest.mark.integration
def test_wandb_off_is_a_null_run_that_imports_nothing() -> None:
    for target in (None, WandbTarget(project=""), WandbTarget(project="p", mode="disabled")):
        run = open_wandb_run(target, name="alice", group="g", config={})
        assert isinstance(run, NullRun), target
        run.update(replace(progress(), loss=None))  # a step without a loss, then close: no error
        run.close()
    code = (
        "import sys; from toolkit.notebook.wandb_run import open_wandb_run; "
        "open_wandb_run(None, name='a', group='g', config={}).close(); print('wandb' in sys.modules)"
    )
    fresh = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert fresh.stdout.strip() == "False", fresh.stderr[-2000:]  # a notebook without W&B never pays its import
