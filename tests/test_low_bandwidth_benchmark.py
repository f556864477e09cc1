"""``benchmarks/low_bandwidth.py`` (issue 26) in its smallest setting, so its code path cannot rot:
two peers, four micro-batches each, on the demo model over 127.0.0.1 (``--no-shape``): sync int8
and local SGD with H = 2 and topk2-64 both ways (``--no-dense``: the float32 variant's code path is
the same with another codec). Checks the lines' keys and that every byte count is real; the figures themselves
are the benchmark's to report at full settings, never asserted here (no timings either).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import REPO

pytestmark = pytest.mark.integration  # starts relay, peer or tool processes

SUMMARY_KEYS = {
    "bytes_ratio",
    "loss_gap",
    "shaped_speedup",
    "busy_fraction",
    "down_bits_per_param",
    "bars",
    "variants",
    "best",
    "refused",
    "shaped",
    "models",
}
VARIANT_KEYS = {
    "up_bytes_per_sample",
    "down_bytes_per_sample",
    "join_down_bytes",
    "final_loss",
    "public_loss",
    "samples_per_s",
    "busy_fraction",
    "down_bits_per_param",
    "rounds",
}


def test_low_bandwidth_benchmark_smallest_setting_reports_every_variant(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/low_bandwidth.py",
            "--models",
            "demo",
            "--no-shape",
            "--peers",
            "2",
            "--steps",
            "4",
            "--batch",
            "2",
            "--h",
            "2",
            "--sparse-down",
            "same",
            "--no-dense",
            "--work-dir",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.strip().splitlines()]
    variants, model, summary = lines[:-2], lines[-2], lines[-1]
    assert [v["variant"] for v in variants] == ["sync", "local_sgd+topk2-64 H=2"]
    for v in variants:
        assert VARIANT_KEYS <= set(v), v
        assert v["up_bytes_per_sample"] > 0 and v["down_bytes_per_sample"] > 0 and v["join_down_bytes"] > 0, v
        assert v["final_loss"] > 0 and v["public_loss"] > 0 and v["samples"] == 2 * 4 * 2, v
        # local SGD: 4 steps / H = 2 outer rounds; sync: as many rounds as the samples' arrival made
        assert v["rounds"] == 2 if v["variant"].startswith("local_sgd") else v["rounds"] >= 1, v
        assert v["down_bits_per_param"] > 0, v
    assert variants[0]["busy_fraction"] is None and 0 <= variants[1]["busy_fraction"] <= 1
    assert summary["refused"] == {}
    # the sparse variant's broadcast: topk2-64 deltas, 0.29 bits per parameter and outer round (sync: int8, 8.1)
    assert variants[1]["down_bits_per_param"] < variants[0]["down_bits_per_param"] / 20, variants
    assert model["model"] == "demo" and model["sync"] == "sync"
    assert SUMMARY_KEYS <= set(summary), summary
    assert summary["bytes_ratio"] > 0 and summary["down_bits_per_param"] > 0, summary
    assert summary["shaped_speedup"] is None and "--no-shape" in summary["shaped"], summary
    assert set(summary["bars"]) == {
        "bytes_ratio",
        "loss_gap",
        "shaped_speedup",
        "down_bits_per_param",
        "busy_fraction",
    }
    assert summary["bars"]["shaped_speedup"].endswith("not measured"), summary["bars"]
