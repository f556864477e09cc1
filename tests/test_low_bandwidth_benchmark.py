"""``benchmarks/low_bandwidth.py`` (issue 26) at its shortest: two peers, sync int8 vs local SGD
with H = 10 on the demo model. It checks the lines' shape and that every byte count is real; the
ratios themselves are the benchmark's to report at full settings, not asserted on a shared machine.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

KEYS = {"best", "bytes_ratio", "loss_gap", "shaped_speedup", "busy_fraction", "down_bits_per_param"}


@pytest.mark.slow
def test_low_bandwidth_benchmark_reports_bytes_per_sample_of_each_variant():
    done = subprocess.run([sys.executable, "benchmarks/low_bandwidth.py", "--peers", "2", "--steps", "20",
                           "--batch", "4", "--h", "10"], cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    print(done.stdout)
    lines = [json.loads(line) for line in done.stdout.strip().splitlines()]
    variants, summary = lines[:-1], lines[-1]
    assert [v["variant"] for v in variants] == ["sync", "local_sgd H=10"]
    for v in variants:
        assert v["up_bytes_per_sample"] > 0 and v["down_bytes_per_sample"] > 0 and v["final_loss"] > 0, v
    assert KEYS <= set(summary) and summary["best"] == "local_sgd H=10" and summary["bytes_ratio"] > 0, summary
