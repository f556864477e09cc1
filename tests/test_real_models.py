"""benchmarks/real_models.py at its smallest (albert-tiny, one relay step, no demo; ~10 s): the
relay's bytes/param follow from the state it really holds, the peer's accounting is 8 B/param with
the accumulator on the host and 12 on the device for both precisions, and the last line is JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from relay_server.harness import zygote

pytestmark = pytest.mark.integration  # starts relay, peer or tool processes

REPO = Path(__file__).resolve().parent.parent


def test_real_models_smallest():
    proc = zygote.run(
        [sys.executable, "benchmarks/real_models.py", "--models", "albert-tiny", "--steps", "1", "--skip-demo"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["demo"] is None
    relay = {(r["optimizer"], r["state_bits"]): r for r in out["relay"]}
    for key in (("adamw", 32), ("lamb", 32)):
        assert abs(relay[key]["B_per_param"] - 16.0) < 0.01  # master 4 + grad 4 + two fp32 moments 8
        assert relay[key]["step_s"] > 0
    eight = relay[("adamw", 8)]
    if "skipped" not in eight:  # bitsandbytes on CPU: 8-bit codes + absmax, small tensors in fp32
        assert 10.0 < eight["B_per_param"] < 11.0 and eight["bytes_ratio_vs_adamw"] < 0.7
    peer = out["peer"]
    assert len(peer) == 4 and {r["precision"] for r in peer} == {"fp32", "bf16"}
    for row in peer:
        assert row["measured"] == "accounted" and row["grad_dtype"] == "float32"
        assert row["B_per_param"] == (8.0 if row["accumulator"] == "host" else 12.0)
