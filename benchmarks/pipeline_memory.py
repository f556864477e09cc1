"""A pipeline run's memory, measured against what the relay predicts (``GET /api/pipeline`` ``memory``).

    python benchmarks/pipeline_memory.py                  # the three models below, ~4 minutes here
    python benchmarks/pipeline_memory.py --models small

Each case runs a real ``relay-server serve`` with ``[pipeline]`` (AdamW, 2 stages) and one
``python -m toolkit.peer`` volunteer per stage (the demo text, one thread each) until the relay took
``--steps`` steps. A process's memory is its RSS high-water mark (``VmHWM``, /proc) less the same
role's mark in a run of a 17k-parameter model (the runtime -- python, torch, HTTP -- not the model);
the prediction is the relay's own (``memory.relay.total``, ``memory.workers[k].total``).

Last line: one JSON object ``{"cases": [...]}`` with, per case, the parameters, and per process the
predicted and measured bytes, bytes per parameter, and ``error`` (predicted / measured - 1).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import start_relay  # noqa: E402

MODELS = {
    "tiny": {"seq_len": 16, "d_model": 32, "n_layer": 2, "n_head": 4, "d_ff": 64},  # the runtime's baseline
    "small": {"seq_len": 64, "d_model": 256, "n_layer": 4, "n_head": 4, "d_ff": 1024},  # benchmarks/memory.py's
    "deep": {"seq_len": 64, "d_model": 512, "n_layer": 8, "n_head": 4, "d_ff": 2048},
    "wide": {"seq_len": 64, "d_model": 768, "n_layer": 4, "n_head": 4, "d_ff": 3072},
}


def config(model: dict, microbatch_size: int, microbatches: int) -> dict:
    return {
        "run": {
            "name": "pipeline-memory",
            "target_batch": microbatch_size * microbatches,
            "total_steps": 0,
            "max_staleness": 0,
        },
        "model": {"factory": "toolkit.models:ByteTransformer", "kwargs": {**model, "tie_embeddings": False}},
        "optimizer": {"name": "adamw", "lr": 0.001, "schedule": "constant"},
        "rounds": {"heartbeat_interval_s": 1.0, "peer_ttl_s": 30.0},
        "server": {"host": "127.0.0.1"},
        "auth": {"mode": "open"},
        "dataset": {"kind": "demo_corpus"},
        "pipeline": {
            "enabled": True,
            "stages": 2,
            "microbatch_size": microbatch_size,
            "microbatches_per_batch": microbatches,
        },
    }


def peak(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for {pid}")


def run_case(name: str, args: argparse.Namespace, folder: Path) -> dict:
    """One run: the relay's and each worker's peak RSS, and the relay's prediction."""
    shutil.rmtree(folder, ignore_errors=True)
    relay = start_relay(folder, config(MODELS[name], args.microbatch_size, args.microbatches))
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "toolkit.peer", "--relay", relay.url, "--name", f"w{i}", "--threads", "1"],
            stdout=subprocess.DEVNULL,
            stderr=open(folder / f"w{i}.log", "w"),
        )
        for i in range(2)
    ]
    peaks = {"relay": 0, "w0": 0, "w1": 0}
    try:
        deadline = time.monotonic() + args.limit_s
        while True:
            for key, proc in (("relay", relay.proc), ("w0", workers[0]), ("w1", workers[1])):
                if proc.poll() is None:
                    peaks[key] = peak(proc.pid)
            rounds = relay.get("/api/status").get("recent_rounds") or []
            if max((r["step"] for r in rounds), default=0) >= args.steps:
                break
            if time.monotonic() > deadline or any(w.poll() is not None for w in workers):
                raise RuntimeError(f"{name}: {args.steps} steps not reached; see {folder}")
            time.sleep(0.2)
        memory = relay.get("/api/pipeline")["memory"]
        stages = [s["params"] for s in relay.get("/api/pipeline")["stages"]]
    finally:
        for w in workers:
            w.kill()
            w.wait()
        relay.stop()
    return {"name": name, "params": sum(stages), "stage_params": stages, "peaks": peaks, "memory": memory}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="small,deep,wide")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--limit-s", type=float, default=400.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pipeline-memory-") as tmp:
        base = run_case("tiny", args, Path(tmp) / "tiny")
        cases = []
        for name in args.models.split(","):
            run = run_case(name, args, Path(tmp) / name)
            rows = {}
            for key, predicted, params in (
                ("relay", run["memory"]["relay"]["total"], run["params"]),
                ("worker 0", run["memory"]["workers"][0]["total"], run["stage_params"][0]),
                ("worker 1", run["memory"]["workers"][1]["total"], run["stage_params"][1]),
            ):
                role = {"relay": "relay", "worker 0": "w0", "worker 1": "w1"}[key]
                measured = run["peaks"][role] - base["peaks"][role]
                rows[key] = {
                    "predicted": predicted,
                    "measured": measured,
                    "predicted_per_param": round(predicted / params, 2),
                    "measured_per_param": round(measured / params, 2),
                    "error": round(predicted / measured - 1, 3),
                }
                print(
                    f"{name:6s} {key:9s} params {params:>10,d}  predicted {predicted / 2**20:7.1f} MiB "
                    f"({predicted / params:5.1f} B/param)  measured {measured / 2**20:7.1f} MiB "
                    f"({measured / params:5.1f} B/param)  error {predicted / measured - 1:+.1%}",
                    flush=True,
                )
            cases.append({"model": name, "params": run["params"], **rows})
    print(json.dumps({"cases": cases}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
