"""``benchmarks/allreduce.py`` (the round figure of the README and docs/benchmarks.md) in its smallest setting, so its code path
cannot rot: two peers, 1 MiB each, through a real relay, beside raw TCP with and without the checked
floor. Checks the last line's keys and that the relay's parameters are the exact mean's steps; the
timings are the benchmark's to report at full settings, never asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.processes import REPO

pytestmark = pytest.mark.integration  # starts relay, peer or tool processes


def test_allreduce_benchmark_smallest_setting_reports_the_round_and_the_checked_floor() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/allreduce.py", "--peers", "2", "--mb", "1", "--rounds", "2", "--floor"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"round_s", "raw_tcp_s", "ratio", "checked_tcp_s", "floor_ratio", "max_abs_err"} <= set(result), result
    assert result["floor_hash"] == "sha256" and result["peers"] == 2
    assert min(result["round_s"], result["raw_tcp_s"], result["checked_tcp_s"]) > 0, result
    assert result["max_abs_err"] < 1e-6, result  # two SGD steps of the float64 mean, float32 parameters
