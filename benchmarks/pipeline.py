"""Table 2 of the heterogeneous-pipeline paper (cases 1 and 4) in miniature, through the real relay:
seconds per batch of the task pool (ours) against a static pipeline and a SWARM-like baseline.

    python benchmarks/pipeline.py                       # ~7 minutes on 2 shared cores
    python benchmarks/pipeline.py --batches 2 --cases 1,4   # quicker

Processes per run: one ``relay-server serve`` with ``[pipeline]`` (a ByteTransformer of 4 blocks
cut into 2 stages, ``--microbatches`` micro-batches of ``--microbatch-size`` per batch) and 6 stage
workers (``benchmarks/pipeline_rig.py``: the toolkit's StageWorker with emulated compute, an
emulated slow link and emulated disconnections). Each case runs three times on the same seeds,
only ``[pipeline] dispatch`` differing:

* ``pool`` (ours): any worker of a stage takes any of its tasks; a lost task is re-dispatched at
  its lease deadline or when its worker leaves, a lost stage gradient recomputed;
* ``static``: each micro-batch pinned per stage to one worker, which it waits for (a static 1F1B
  pipeline, Dapple-like);
* ``restart``: a micro-batch whose forward pass lost its worker restarts from stage 0 (SWARM-like).

The cases:

* **case 1** (one datacentre): 6 fast workers, no added link delay, no disconnection;
* **case 4** (case 3 plus disconnections): 2 fast reliable workers (the paper's HPC servers) and
  4 "2080"s, 55% slower, each with 100-150 ms added to every request, each disconnecting with
  probability ``--disconnect-p`` (0.9) per batch at a random moment in the batch's first
  ``--window-s`` seconds, for ``--offline-s`` and then coming back with the same peer id.

How long a disconnection lasts decides what the relay can do about it:

* default, ``--offline-s 5 --peer-ttl-s 10``: longer than a lease (4 x the stage's measured task
  time, at least 2 s), shorter than the peer TTL. The relay keeps the worker and its stage; a task
  it held is re-dispatched at its lease deadline (pool), restarted from stage 0 if it was a
  forward (restart) or waits for it (static); stage gradients it held are recomputed once it has
  been silent that long (pool and restart; static waits for it).
* ``--offline-s 3.5 --peer-ttl-s 2``: the relay drops the worker; on its return it is re-admitted
  (static gives it its former stage back, where its pinned micro-batches wait for it).

Seconds per batch are the relay's own (each round's ``duration_s``: from the batch's first lease
to its step), the first batch of each run left out (warm-up: downloads, first measurements).
Bytes per sample are the relay's ``boundary_bytes_per_sample`` for ours in case 1 (the boundary
traffic in and out over the samples trained) against the model in docs/benchmarks.md (:func:`bytes_model`):
per sample and boundary, the activation in and out and its gradient in and out; a middle stage's
backward re-fetches its stored input unless its worker still holds it (the last stage's forward
and backward are one task); the micro-batch's tokens (int64) go in from the first stage and out
to the last and to an uncached stage-0 backward.

How far a batch is from the compute-bound ideal: ``overhead_ratio`` per case and dispatch is the
measured seconds per batch over ``ideal_batch_s``, the sum of emulated compute on the critical
path of a batch (:func:`ideal_batch_s`: the pool's own schedule with nothing but compute -- no
requests, no round, no download -- each worker free the moment its task's compute ends; in case 1
first 80 ms -> last 240 ms -> last 240 ms (three stage-1 workers, six micro-batches) -> backward
240 ms = 0.8 s). Everything above 1 is overhead: HTTP, serialization, the round's upload and
step, parameter downloads, and in case 4 the emulated links and disconnections. ``compute_s`` /
``real_compute_s`` per run say how much of the emulated compute the real (tiny) computation took
(the rig counts it as part of the emulated time), ``requests`` the workers' requests by route.

Last line: one JSON object with ``case1_vs_static``, ``case4_vs_static``, ``case4_vs_swarm``,
``planner_error`` (null while the relay publishes no prediction), ``seconds_per_batch`` and
``overhead_ratio`` per case and dispatch, ``ideal_batch_s`` per case, ``bytes_per_sample`` (measured and modelled), the bars and what failed.
"""

from __future__ import annotations

import argparse
import heapq
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_rig import REPO, stop_all, wait_until  # noqa: E402

from relay_server.harness.process import start_relay  # noqa: E402

RIG = Path(__file__).resolve().parent / "pipeline_rig.py"
DISPATCH = {"ours": "pool", "static": "static", "swarm": "restart"}
SLOW = 1 / 1.55  # a "2080": 55% slower
BARS = {"case1_vs_static": 1.3, "case4_vs_static": 0.75, "case4_vs_swarm": 0.9, "planner_error": 0.25}
CODEC_BYTES = {"none": 4.0, "float16": 2.0, "int8": 1.0}


def model_kwargs(args) -> dict:
    return {
        "d_model": args.width,
        "n_layer": 4,
        "n_head": 2,
        "d_ff": 2 * args.width,
        "seq_len": args.seq_len,
        "tie_embeddings": False,
    }


def relay_config(args, dispatch: str) -> dict:
    return {
        "run": {
            "name": "pipeline-bench",
            "target_batch": args.microbatch_size * args.microbatches,
            "total_steps": 0,
            "max_staleness": getattr(args, "max_staleness", 0),  # benchmarks/pipeline_staleness.py sets 1
            "seed": 0,
        },
        "model": {"factory": "toolkit.models:ByteTransformer", "kwargs": model_kwargs(args)},
        "optimizer": {"name": "sgd", "lr": 0.05, "weight_decay": 0.0, "clip_grad_norm": 0.0, "schedule": "constant"},
        "rounds": {"heartbeat_interval_s": 0.3, "peer_ttl_s": args.peer_ttl_s},
        "server": {"host": "127.0.0.1", "keep_checkpoints": 1000},
        "auth": {"mode": "open"},
        "pipeline": {
            "enabled": True,
            "stages": 2,
            "microbatch_size": args.microbatch_size,
            "microbatches_per_batch": args.microbatches,
            "boundary_codec": args.codec,
            "dispatch": dispatch,
        },
    }


def workers_of(case: int, args) -> list[dict]:
    """The 6 workers of a case, in the order they take stages (alternating fast and slow, so
    that each stage gets one fast reliable worker in case 4)."""
    if case == 1:
        return [{"speed": 1.0, "delay_ms": 0.0, "disconnect_p": 0.0} for _ in range(6)]
    fast = {"speed": 1.0, "delay_ms": 0.0, "disconnect_p": 0.0}
    slow = [{"speed": SLOW, "delay_ms": delay, "disconnect_p": args.disconnect_p} for delay in (100, 150, 120, 130)]
    return [fast, fast, *slow]


def pipeline(url: str) -> dict:
    return requests.get(url + "/api/pipeline", timeout=10).json()


def run_once(case: int, name: str, args, folder: Path) -> dict:
    """One relay and 6 workers until ``--batches`` + 1 batches were stepped (or the time limit)."""
    folder.mkdir(parents=True)
    relay = start_relay(folder, relay_config(args, DISPATCH[name]))
    procs = []
    try:
        go = folder / "go"
        for i, spec in enumerate(workers_of(case, args)):
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(RIG),
                        "--relay",
                        relay.url,
                        "--name",
                        f"w{i}",
                        "--seed",
                        str(args.seed + i),
                        "--speed",
                        str(spec["speed"]),
                        "--unit-ms",
                        str(args.unit_ms),
                        "--delay-ms",
                        str(spec["delay_ms"]),
                        "--disconnect-p",
                        str(spec["disconnect_p"]),
                        "--offline-s",
                        str(args.offline_s),
                        "--window-s",
                        str(args.window_s),
                        "--stats",
                        str(folder / f"w{i}.json"),
                        "--ready",
                        str(folder / f"w{i}.ready"),
                        "--go",
                        str(go),
                        *(["--after", str(folder / f"w{i - 1}.ready")] if i else []),
                    ],
                    cwd=REPO,
                    stdout=open(folder / f"w{i}.log", "w"),
                    stderr=subprocess.STDOUT,
                )
            )
        wait_until(
            lambda: (folder / "w5.ready").exists() or any(p.poll() is not None for p in procs),
            300,
            "6 workers holding stages",
        )
        for i, p in enumerate(procs):
            if p.poll() is not None:
                log = (folder / f"w{i}.log").read_text()[-3000:]
                raise RuntimeError(f"worker w{i} exited with {p.returncode}:\n{log}")
        go.write_text("go")
        started = time.monotonic()
        want = args.batches + 1
        try:
            wait_until(
                lambda: relay.proc.poll() is not None or relay_status(relay.url)["step"] >= want,
                args.run_limit_s,
                f"{want} batches",
            )
            completed = True
        except TimeoutError:
            completed = False
        if relay.proc.poll() is not None:
            log = (folder / "relay.log").read_text()[-4000:]
            raise RuntimeError(f"the relay exited with {relay.proc.returncode}:\n{log}")
        status, pipe = relay_status(relay.url), pipeline(relay.url)
        layers = [stage["layers"][1] - stage["layers"][0] for stage in pipe["stages"]]
    finally:
        stop_all(procs)
        relay.stop()
    rounds = sorted((r for r in status["recent_rounds"] if r["finalized_by"] == "pipeline"), key=lambda r: r["step"])
    times = [r["duration_s"] for r in rounds]
    workers = [json.loads((folder / f"w{i}.json").read_text()) for i in range(6) if (folder / f"w{i}.json").exists()]
    measured = times[1:]
    specs = workers_of(case, args)
    placed = [(w["stages"][-1], specs[int(w["name"][1:])]["speed"]) for w in workers if w["stages"]]
    ideal = ideal_batch_s(placed, layers, args.microbatches, args.unit_ms / 1000)
    out = {
        "seconds_per_batch": round(sum(measured) / len(measured), 3) if measured and completed else None,
        "batch_s": [round(t, 2) for t in times],
        "finalized_at": [r["finalized_at"] for r in rounds],
        "completed": completed,
        "ideal_batch_s": round(ideal, 3),
        "overhead_ratio": None,
        "steps": status["step"],
        "wall_s": round(time.monotonic() - started, 1),
        "relay_measured_batch_s": pipe.get("measured_batch_s"),
        "predicted_batch_s": pipe.get("predicted_batch_s"),
        "boundary_bytes_per_sample": pipe.get("boundary_bytes_per_sample"),
        "redispatched": pipe.get("redispatched"),
        "redone": pipe.get("redone"),
        "restarted": pipe.get("restarted"),
        "refused_results": pipe.get("refused_results"),
        # per committed batch, oldest first: [re-dispatched tasks, recomputed stage gradients, refused duplicates]
        "wasted_per_batch": [[w["redispatched"], w["recomputed"], w["refused"]] for w in pipe.get("wasted", [])],
        "traffic_bytes_per_sample": {
            "up": (status.get("traffic") or {}).get("up_bytes_per_sample"),
            "down": (status.get("traffic") or {}).get("down_bytes_per_sample"),
        },
        "counted": pipe.get("counted"),
        "disconnections": sum(w["disconnections"] for w in workers),
        "lost_results": sum(w["lost_results"] for w in workers),
        "stage_changes": sum(len(set(w["stages"])) - 1 for w in workers),
        "compute_s": round(sum(w.get("compute_s", 0.0) for w in workers), 2),
        "real_compute_s": round(sum(w.get("real_compute_s", 0.0) for w in workers), 2),
        "requests": requests_by_route(workers),
    }
    out["overhead_ratio"] = ratio(out["seconds_per_batch"], ideal)
    print(
        f"case {case} {name:6s} ({DISPATCH[name]}): {out['seconds_per_batch']} s/batch over {len(measured)} "
        f"batches {out['batch_s']} (ideal {ideal:.3f}: overhead ratio {out['overhead_ratio']}); completed={completed}; redispatched={out['redispatched']} "
        f"redone={out['redone']} restarted={out['restarted']} disconnections={out['disconnections']} "
        f"stage_changes={out['stage_changes']}",
        flush=True,
    )
    return out


WORK = {"first": 1, "forward": 1, "last": 3, "backward": 3}  # as the rig emulates it


def ideal_batch_s(workers: list[tuple[int, float]], layers: list[int], microbatches: int, unit_s: float) -> float:
    """Seconds per batch with nothing but compute: the pool's schedule (each free worker takes its
    stage's best ready task, 1F1B: backward work first, then the oldest micro-batch; the fastest
    free worker first) where a task's successor is ready the moment its compute ends and nothing
    else (requests, the round, downloads) takes time. ``workers``: (stage, speed) each. The
    result is the sum of emulated compute along the batch's critical path (the chain of tasks each
    of which began when its input or its worker became free)."""
    stages = len(layers)
    ready: dict[int, list[tuple[tuple[int, int], str, int]]] = {k: [] for k in range(stages)}
    for mb in range(microbatches):
        heapq.heappush(ready[0], ((1, mb), "first" if stages > 1 else "last", mb))
    idle = set(range(len(workers)))
    running: list[tuple[float, int, int, str, int]] = []  # (done at, worker, stage, kind, micro-batch)
    now = 0.0
    while True:
        for i in sorted(idle, key=lambda w: -workers[w][1]):
            stage, speed = workers[i]
            if ready[stage]:
                _, kind, mb = heapq.heappop(ready[stage])
                heapq.heappush(running, (now + unit_s * layers[stage] * WORK[kind] / speed, i, stage, kind, mb))
                idle.discard(i)
        if not running:
            return now
        now, i, stage, kind, mb = heapq.heappop(running)
        idle.add(i)
        if kind in ("first", "forward"):
            heapq.heappush(ready[stage + 1], ((1, mb), "last" if stage + 2 == stages else "forward", mb))
        elif stage > 0:
            heapq.heappush(ready[stage - 1], ((0, mb), "backward", mb))


def requests_by_route(workers: list[dict]) -> dict[str, list[float]]:
    """The workers' requests by route, summed: [count, seconds]."""
    total: dict[str, list[float]] = {}
    for w in workers:
        for route, (n, seconds) in w.get("requests", {}).items():
            entry = total.setdefault(route, [0, 0.0])
            entry[0] += n
            entry[1] = round(entry[1] + seconds, 3)
    return total


def relay_status(url: str) -> dict:
    return requests.get(url + "/api/status", timeout=10).json()


def bytes_model(args, stages: int = 2) -> dict:
    """Bytes per sample the relay moves across its boundaries, from docs/benchmarks.md's model:
    ``(K - 1) x 4a + (K - 2) x a x (1 - c) + t x (3 - c)``, with ``a = tokens x width x bytes per
    element`` (the codec's: 4, 2, ~1), ``t = 8 x (tokens + 1)`` (the int64 micro-batch) and ``c``
    the share of backwards whose worker still held the input (1: ``cached``, 0: ``uncached``)."""
    a = args.seq_len * args.width * CODEC_BYTES[args.codec]
    t = 8 * (args.seq_len + 1)
    return {
        "activation_bytes": a,
        "tokens_bytes": t,
        "cached": (stages - 1) * 4 * a + 2 * t,
        "uncached": (stages - 1) * 4 * a + (stages - 2) * a + 3 * t,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", default="1,4")
    parser.add_argument("--batches", type=int, default=3, help="measured batches per run (after one warm-up)")
    parser.add_argument("--microbatches", type=int, default=6)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--width", type=int, default=64, help="the model's width (the boundary's)")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--codec", default="none", choices=sorted(CODEC_BYTES))
    parser.add_argument("--unit-ms", type=float, default=40.0, help="emulated forward ms per layer, fast worker")
    parser.add_argument("--disconnect-p", type=float, default=0.9)
    parser.add_argument(
        "--offline-s",
        type=float,
        default=5.0,
        help="a disconnection's length: above the "
        "lease deadline (2-4 s here), below the peer TTL (see the module docstring)",
    )
    parser.add_argument("--window-s", type=float, default=2.0)
    parser.add_argument("--peer-ttl-s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dispatch", default="ours,static,swarm", help="which of ours, static, swarm to run")
    parser.add_argument("--logs", help="keep every process's log in this folder (default: a temporary one)")
    parser.add_argument("--run-limit-s", type=float, default=180.0, help="per run, after the workers are ready")
    args = parser.parse_args(argv)
    cases = [int(c) for c in args.cases.split(",")]
    results: dict[str, dict[str, dict]] = {}
    names = args.dispatch.split(",")
    with tempfile.TemporaryDirectory(prefix="pipeline-bench-") as tmp:
        logs = Path(args.logs) if args.logs else Path(tmp)
        for case in cases:
            results[f"case{case}"] = {name: run_once(case, name, args, logs / f"case{case}-{name}") for name in names}

    def spb(case: int, name: str) -> float | None:
        return results.get(f"case{case}", {}).get(name, {}).get("seconds_per_batch")

    ours = [r["ours"] for r in results.values() if "ours" in r]
    errors = [
        abs(r["predicted_batch_s"] - r["seconds_per_batch"]) / r["seconds_per_batch"]
        for r in ours
        if r["predicted_batch_s"] is not None and r["seconds_per_batch"]
    ]
    measured_bytes = results.get("case1", {}).get("ours", {}).get("boundary_bytes_per_sample")
    summary = {
        "case1_vs_static": ratio(spb(1, "ours"), spb(1, "static")),
        "case4_vs_static": ratio(spb(4, "ours"), spb(4, "static")),
        "case4_vs_swarm": ratio(spb(4, "ours"), spb(4, "swarm")),
        "planner_error": round(max(errors), 3) if errors else None,
        "seconds_per_batch": {
            case: {name: r["seconds_per_batch"] for name, r in runs.items()} for case, runs in results.items()
        },
        "overhead_ratio": {
            case: {name: r["overhead_ratio"] for name, r in runs.items()} for case, runs in results.items()
        },
        "ideal_batch_s": {case: next(iter(runs.values()))["ideal_batch_s"] for case, runs in results.items()},
        "bytes_per_sample": {"measured": round(measured_bytes) if measured_bytes else None, **bytes_model(args)},
        "ours_completed": all(r["completed"] for r in ours),
        "settings": {
            "stages": 2,
            "workers": 6,
            "microbatches": args.microbatches,
            "microbatch_size": args.microbatch_size,
            "width": args.width,
            "seq_len": args.seq_len,
            "codec": args.codec,
            "unit_ms": args.unit_ms,
            "batches": args.batches,
            "disconnect_p": args.disconnect_p,
            "offline_s": args.offline_s,
            "peer_ttl_s": args.peer_ttl_s,
        },
        "runs": results,
    }
    summary["bars_failed"] = [k for k, bar in BARS.items() if summary.get(k) is not None and summary[k] > bar]
    if summary["planner_error"] is None:
        summary["planner_error_note"] = "the relay published no predicted_batch_s"
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
