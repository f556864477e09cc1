"""The relay's W&B run, written by the real wandb client in offline mode and read back from disk.

No network and no API key: ``WANDB_MODE=offline`` writes the run to
``$WANDB_DIR/wandb/offline-run-*/run-<id>.wandb``. wandb (0.2x+) no longer ships a Python reader
for that file, so :func:`read_wandb_records` reads its framing -- the LevelDB log format: 32 KiB
blocks of CRC-checked records behind a 7-byte ``:W&B`` header -- and decodes each record with
wandb's own protobuf schema (``wandb.proto.wandb_internal_pb2.Record``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path

import pytest

from relay_server.core.config import load_config
from relay_server.observers.events import StepEvent
from relay_server.observers.wandb_observer import WandbObserver, measured_samples_per_s, step_metrics
from relay_server.rounds.traffic import Traffic
from tests.support.wandb_records import finished_run_records, history_rows, run_config
from toolkit.wire.protocol import (
    LeaderboardEntry,
    LocalSgdStatus,
    PlanInfo,
    PlanSlice,
    RoundRecord,
    RunSummary,
    StatusReport,
    TrafficStatus,
)


def test_relay_logs_every_step_to_an_offline_wandb_run(offline_wandb, start_relay, launch_peer):
    relay = start_relay(
        {"run": {"name": "wandb-run", "target_batch": 24}, "wandb": {"project": "collab-test", "mode": "offline"}}
    )
    peers = [
        launch_peer(relay.url, f"p{i}", seed=i, batch_size=4, steps=3, extra=("--wait-peers", "2")) for i in range(2)
    ]
    for peer in peers:
        assert peer.wait() == 0, peer.log_path.read_text()[-2000:]
    final = relay.status()
    relay.stop()  # close() finishes the run: everything is on disk after this

    run_id = (relay.data_dir / "wandb-run-id").read_text().strip()
    files = list(offline_wandb.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 1, list(offline_wandb.rglob("*"))
    records = finished_run_records(files[0])

    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.display_name, run.project, run.run_id) == ("wandb-run", "collab-test", run_id)
    config = run_config(records)
    assert config["run_name"] == "wandb-run"
    for key, value in final["config"].items():  # the run summary, as the dashboard shows it
        assert config[key] == value, key

    rows = {row["step"]: row for row in history_rows(records)}
    rounds = {r["step"]: r for r in final["recent_rounds"]}
    assert sorted(rows) == sorted(rounds) and len(rows) >= 3  # one row per step, none twice
    for step, row in rows.items():
        r = rounds[step]
        assert row["loss"] == pytest.approx(r["loss"])
        assert (row["samples"], row["contributors"], row["finalized_by"]) == (
            r["samples"],
            r["contributors"],
            r["finalized_by"],
        )
        assert row["step_duration_s"] == pytest.approx(r["duration_s"])
        assert row["deadline_s"] == pytest.approx(r["deadline_s"])
        assert row["lr"] == pytest.approx(0.01)  # conftest's constant schedule
        assert (row["plan/aggregators"], row["plan/version"]) == (
            len(final["plan"]["slices"]),
            final["plan"]["version"],
        )
        assert row["peers_online"] in (1, 2) and row["samples_per_s"] >= 0
    last = rows[max(rows)]
    assert last["samples_total"] == sum(e["samples"] for e in final["leaderboard"])
    assert last["samples_per_s_measured"] > 0

    # Bytes per sample, both ways, since the relay started: at each row the uploads are exactly the
    # rounds' contributions so far, each the float32 vector plus a container header.
    vector, contributions = 4 * final["num_params"], 0
    for step in sorted(rows):
        row, contributions = rows[step], contributions + rows[step]["contributors"]
        up = row["bytes_per_sample/up"] * row["samples_total"]
        assert contributions * vector < up <= contributions * (vector + 1024) + 1e-6 * up, (step, up)
        assert row["bytes_per_sample/down"] > 0
    assert up <= final["traffic"]["up_bytes"] and "local_sgd/busy_fraction" not in last  # a sync run


# --- the observer in-process --------------------------------------------------------------------
def _event(step: int, rounds: list[RoundRecord]) -> StepEvent:
    summary = RunSummary(
        model="toolkit.models:MLP",
        num_params=161,
        optimizer="sgd",
        lr=0.5,
        schedule="linear",
        target_batch=8,
        max_staleness=0,
        precision=None,
        compression="none",
        auth_mode="open",
    )
    plan = PlanInfo(
        version="lp-7",
        steps_per_s=0.25,
        slices=[
            PlanSlice(aggregator_id="relay", name="relay", start=0, end=100, fraction=0.62),
            PlanSlice(aggregator_id="agg-1", name="agg-1", start=100, end=161, fraction=0.38),
        ],
    )
    status = StatusReport(
        run_name="r",
        step=step,
        total_steps=10,
        finished=False,
        target_batch=8,
        num_params=161,
        samples_accumulated=0,
        samples_per_s=12.5,
        eta_s=None,
        loss=rounds[-1].loss,
        num_peers=3,
        peers=[],
        recent_rounds=rounds,
        round=None,
        auth_mode="open",
        uptime_s=9.0,
        leaderboard=[LeaderboardEntry(username="u", samples=40, rounds=4, peers_online=1)],
        plan=plan,
        config=summary,
    )
    return StepEvent(step=step, record=rounds[-1], status=status, state_path=Path("unused"))


def _rounds(n: int) -> list[RoundRecord]:
    return [
        RoundRecord(
            step=s,
            contributors=2,
            samples=10,
            loss=1.0 / s,
            duration_s=0.5,
            deadline_s=2.0,
            finalized_by="all_arrived",
            finalized_at=100.0 + 2 * s,
        )
        for s in range(1, n + 1)
    ]


def test_step_metrics_follow_the_schedule_and_the_plan():
    config = load_config(
        None,
        env={},
        overrides={"optimizer": {"name": "sgd", "lr": 0.5, "schedule": "linear"}, "run": {"total_steps": 10}},
    )
    row = step_metrics(_event(4, _rounds(4)), config)
    assert row["lr"] == pytest.approx(0.5 * (1 - 3 / 10))  # version 4 came from the update at step 3
    assert (row["plan/aggregators"], row["plan/version"], row["plan/steps_per_s"]) == (2, "lp-7", 0.25)
    assert row["samples_per_s_measured"] == pytest.approx(30 / 6)  # 3 rounds of 10 samples in 6 s
    assert (row["loss"], row["samples_total"], row["peers_online"]) == (0.25, 40, 3)


def test_step_metrics_carry_bytes_per_sample_and_the_local_sgd_figures():
    config = load_config(None, env={}, overrides={"run": {"mode": "local_sgd", "max_staleness": 0}})
    event = _event(4, _rounds(4))
    quiet = step_metrics(
        dataclasses.replace(
            event,
            status=dataclasses.replace(event.status, traffic=TrafficStatus(up_bytes=0, down_bytes=700, samples=0)),
        ),
        config,
    )
    assert not any(k.startswith(("bytes_per_sample/", "local_sgd/")) for k in quiet)  # nothing applied yet
    status = dataclasses.replace(
        event.status,
        traffic=Traffic(up_bytes=4000, down_bytes=1000, samples=40).report(),
        local_sgd=LocalSgdStatus(
            outer_round=4, inner_steps=30, inner_seconds=0.0, busy_fraction=0.9, inner_steps_last_round=27.5
        ),
    )
    row = step_metrics(dataclasses.replace(event, status=status), config)
    assert (row["bytes_per_sample/up"], row["bytes_per_sample/down"]) == (100.0, 25.0)
    assert (row["local_sgd/busy_fraction"], row["local_sgd/inner_steps"]) == (0.9, 27.5)


def test_measured_rate_needs_two_rounds_and_uses_a_window():
    rounds = _rounds(12)
    assert measured_samples_per_s(rounds[:1]) is None
    assert measured_samples_per_s(rounds[:2]) == pytest.approx(10 / 2)
    assert measured_samples_per_s(rounds, window=5) == pytest.approx(50 / 10)


def test_a_wandb_failure_turns_logging_off_without_blocking(tmp_path, monkeypatch, caplog):
    import wandb

    started, released, starting = [], [], threading.Event()

    def broken_init(**kwargs):
        started.append(kwargs)
        released.append(starting.wait(60))  # still starting until on_step returned: it must not wait for this
        raise wandb.errors.UsageError("api_key not configured (no-tty)")

    monkeypatch.setattr(wandb, "init", broken_init)
    config = load_config(None, env={}, overrides={"wandb": {"project": "p"}, "server": {"data_dir": str(tmp_path)}})
    with caplog.at_level(logging.INFO, logger="relay_server"):
        observer = WandbObserver(config)
        observer.on_step(_event(1, _rounds(1)))
        starting.set()  # W&B "finishes" starting only now, after the step was handed over
        observer.close()
        assert released and all(released), "on_step waited for wandb.init"
        observer.on_step(_event(2, _rounds(2)))  # after a failure: dropped, quietly
    assert started[0]["project"] == "p" and started[0]["name"] == config.run.name
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "W&B logging is off" in errors[0].getMessage()
    assert "WANDB_API_KEY" in errors[0].getMessage()
