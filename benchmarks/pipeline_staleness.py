"""Delayed parameter updates against none, side by side, through the real relay: seconds per
batch of the staged pipeline with ``run.max_staleness = 0`` and ``= 1``, everything else equal.

    python benchmarks/pipeline_staleness.py                    # ~3 minutes on 2 shared cores
    python benchmarks/pipeline_staleness.py --delay-ms 100     # every worker request 100 ms late

It runs :func:`benchmarks.pipeline.run_once` (one ``relay-server serve`` with ``[pipeline]``, a
ByteTransformer of 4 blocks cut into 2 stages, 6 stage workers of ``benchmarks/pipeline_rig.py``
with emulated compute) twice: ``pool`` dispatch, case 1's six reliable workers (with
``--delay-ms`` added to every request of each, an internet round trip), only the staleness
differing. With staleness 0 a batch's first task waits for the previous batch's round (every
holder's ticket, upload and done, every stage's optimizer step, the publish, the workers'
downloads); with 1 it starts when that round opens, on the version before.

Seconds per batch here are wall time between consecutive steps (the relay's ``finalized_at``),
the first step left out (warm-up), their median (one step slowed by the shared machine moves a
mean of five by a fifth of its delay; the mean is reported too): with delayed updates batches
overlap, so a batch's own first lease to commit (``duration_s``, what ``benchmarks/pipeline.py``
averages) no longer adds up to the run's time.

Last line: one JSON object: ``staleness1_vs_0`` (median seconds per batch, < 1 is faster),
``seconds_per_batch`` (median) and ``mean_seconds_per_batch`` for each, every interval, and the
settings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipeline as bench  # noqa: E402


def intervals(run: dict) -> list[float]:
    """Seconds between consecutive steps, after the first (warm-up) one."""
    stamps = run.get("finalized_at") or []
    return [round(b - a, 3) for a, b in zip(stamps[1:], stamps[2:])] if run["completed"] else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, default=6, help="measured batches per run (after one warm-up)")
    parser.add_argument("--microbatches", type=int, default=6)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--unit-ms", type=float, default=40.0, help="emulated forward ms per layer")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="added to every request of every worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logs", help="keep every process's log in this folder (default: a temporary one)")
    parser.add_argument("--run-limit-s", type=float, default=240.0)
    args = parser.parse_args(argv)
    # what benchmarks/pipeline.py's run_once reads besides these (no disconnections in case 1)
    args.codec, args.disconnect_p, args.offline_s, args.window_s, args.peer_ttl_s = "none", 0.0, 5.0, 2.0, 10.0
    delay = args.delay_ms
    bench_workers = bench.workers_of

    def workers_of(case: int, a) -> list[dict]:
        return [{**w, "delay_ms": delay} for w in bench_workers(case, a)]

    bench.workers_of = workers_of
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="pipeline-staleness-") as tmp:
        logs = Path(args.logs) if args.logs else Path(tmp)
        for staleness in (0, 1):
            args.max_staleness = staleness
            runs[f"staleness{staleness}"] = bench.run_once(1, "ours", args, logs / f"staleness{staleness}")
    between = {name: intervals(run) for name, run in runs.items()}
    spb = {name: round(statistics.median(ts), 3) if ts else None for name, ts in between.items()}
    mean = {name: round(statistics.fmean(ts), 3) if ts else None for name, ts in between.items()}
    for name in runs:
        print(
            f"{name}: median {spb[name]} s, mean {mean[name]} s per batch (between steps: {between[name]})", flush=True
        )
    summary = {
        "staleness1_vs_0": bench.ratio(spb["staleness1"], spb["staleness0"]),
        "seconds_per_batch": spb,
        "mean_seconds_per_batch": mean,
        "between_steps_s": between,
        "batch_first_lease_to_step_s": {name: run["seconds_per_batch"] for name, run in runs.items()},
        "completed": all(run["completed"] for run in runs.values()),
        "counted": {name: run["counted"] for name, run in runs.items()},
        "settings": {
            "stages": 2,
            "workers": 6,
            "microbatches": args.microbatches,
            "microbatch_size": args.microbatch_size,
            "width": args.width,
            "seq_len": args.seq_len,
            "unit_ms": args.unit_ms,
            "delay_ms": args.delay_ms,
            "batches": args.batches,
        },
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
