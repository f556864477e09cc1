"""How fast the relay can (re)plan: ``solve_plan`` on two swarm shapes.

    python benchmarks/planner.py            # ~5 s
    python benchmarks/planner.py --reps 9

* ``64_full``: 64 peers that can all receive (a hivemind-style swarm of public hosts), 50-500
  samples/s each, links 10 Mb/s - 1 Gb/s, upload 30-100% of download, c chosen by the planner.
* ``1000_x16``: 1000 peers of which 16 can receive (the relay plus aggregator servers, 0.1-10
  Gb/s, half of them with a GPU) and 984 client-mode notebooks (5-200 Mb/s, 20-400 samples/s).

Model: 125M parameters in fp32, target batch 4096 / 32768. Instances are seeded; each is solved
``--reps`` times and the median wall time (validation, search, both LPs, plan assembly) is
reported, because the machine may be shared. Targets (issue 3): 64_full < 50 ms, 1000_x16 <
200 ms. Human lines first, then one JSON line ``{"solve_ms": {"64_full": ..., "1000_x16": ...}}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from relay_server.planning.planner import solve_plan
from relay_server.planning.problem import PeerCapacity

MBIT = 1e6 / 8  # bytes/s per Mb/s


def swarm(n: int, n_recv: int, seed: int) -> list[PeerCapacity]:
    """A seeded random swarm; the first ``n_recv`` peers can receive."""
    rng = np.random.default_rng(seed)
    peers = []
    for i in range(n):
        if n_recv == n:  # every peer is a public host
            down, gpu = 10 ** rng.uniform(1, 3) * MBIT, True
        elif i < n_recv:  # relay / aggregator servers
            down, gpu = 10 ** rng.uniform(2, 4) * MBIT, i % 2 == 0
        else:  # client-mode notebooks
            down, gpu = 10 ** rng.uniform(np.log10(5), np.log10(200)) * MBIT, True
        speed = float(rng.uniform(50, 500) if n_recv == n else rng.uniform(20, 400)) if gpu else 0.0
        peers.append(PeerCapacity(f"peer{i:04d}", speed, float(down * rng.uniform(0.3, 1.0)), float(down), i < n_recv))
    return peers


def bench(name: str, n: int, n_recv: int, batch: int, reps: int) -> float:
    times = []
    for seed in range(3):
        peers = swarm(n, n_recv, seed)
        for _ in range(reps):
            t0 = time.perf_counter()
            plan = solve_plan(peers, 125_000_000, batch)
            times.append((time.perf_counter() - t0) * 1e3)
        print(
            f"{name} seed {seed}: {plan.steps_per_s:.4f} steps/s, {len(plan.computing)} of {n} "
            f"compute, {len(plan.fractions)} aggregators, round {plan.predicted_round_s:.2f} s"
        )
    median = statistics.median(times)
    print(f"{name}: median {median:.1f} ms over {len(times)} solves (min {min(times):.1f}, max {max(times):.1f})")
    return median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="solves per instance")
    args = parser.parse_args()
    solve_plan(swarm(8, 8, 99), 1000, 16)  # warm imports and HiGHS
    result = {
        "64_full": bench("64_full", 64, 64, 4096, args.reps),
        "1000_x16": bench("1000_x16", 1000, 16, 32768, args.reps),
    }
    print(json.dumps({"solve_ms": {k: round(v, 2) for k, v in result.items()}}))


if __name__ == "__main__":
    main()
