"""Learning@home's Figure 4 through the real relay: trainer throughput against network latency,
J micro-batches in flight (DMoE) against one at a time (the model-parallel baseline).

    python benchmarks/moe_latency.py                          # ~3 minutes on 2 cores
    python benchmarks/moe_latency.py --seconds 6 --deltas 0,200  # quicker

Processes: one relay with ``[moe]`` (``relay-server serve``), ``--hosts`` expert host processes
(``benchmarks/moe_rig.py host``: the real ExpertHost with ``--compute-ms`` of emulated compute per
task), and this process as the trainer: a registered peer whose expert calls go through
``benchmarks/latency_proxy.py`` (its own process) in front of the relay, which delays every
forwarded chunk by delta/2 each way. Every call is real: RelayExpertCaller -> HTTP -> the relay's
broker -> a host's task long poll -> the result back through the relay.

Where the latency sits. By default only the trainer's link is delayed; hosts reach the relay
directly, so one expert call costs delta more. That is the paper's emulation (a delay per
request between trainer and expert). ``--hosts-through-proxy`` delays the hosts' link as well (a
second proxy), so a call costs 2 x delta, and the host's own loop meets the latency: it sends
results from other threads (a host that sent them from its runtime thread served at most
1 / (compute + delta) tasks/s: 0 micro-batches in 18 s at 200 ms), but its task polls and its
lease renewals (every second) still wait a round trip each on the runtime's loop, so at 200 ms
the hosts, not the trainer, set the throughput (about 0.4 of the 0 ms figure, J = 24 or 48 alike).

The trainer runs a DMoEMLP (``--layers`` mixtures of ``--grid`` experts, top ``--k``) on random
batches: forward and backward through every mixture, no optimizer step (throughput is the
point). DMoE: ``--jobs`` threads share the model and one caller, so J micro-batches are in flight;
model parallel: one thread, one micro-batch, each layer's calls waiting on the previous layer's.
Per delta, each mode runs ``--warmup-s`` then counts micro-batches finished in ``--seconds``.

Bound (A9): a micro-batch waits for 2 x layers sequential call rounds, each delta longer at delta,
so keeping throughput X0 (micro-batches/s at delta = 0) needs about X0 x 2 x layers x delta
batches in flight on top of those computing; the benchmark prints J and
``j_bound = 2 x X0 x path_latency_s`` with ``path_latency_s = 2 x layers x delta_max`` (x 2 with
hosts behind the proxy).

Last line: ``{"jobs", "j_bound", "samples_per_s": {"dmoe": {delta: ...}, "model_parallel": {...}},
"keep_200ms", "vs_model_parallel_200ms", "mp_keep_200ms", "failures", ...}``: ``keep_200ms`` is
DMoE's throughput at the last delta (200 ms by default) over the first (0 ms),
``vs_model_parallel_200ms`` DMoE over the baseline at the last delta, ``failures`` the expert
calls that failed or timed out (a failed call ends early, so a run with failures overstates).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency_proxy import ProxyProcess, spawn  # noqa: E402
from moe_rig import (Member, caller_for, directory, relay_overrides, start_hosts, start_relay,  # noqa: E402
                     stop_all, wait_until)

from toolkit.models import DMoEMLP  # noqa: E402


def measure(model: DMoEMLP, jobs: int, batch: int, warmup_s: float, seconds: float) -> dict:
    """``jobs`` trainer threads through ``model`` for ``warmup_s + seconds``; micro-batches/s:
    completions in the measured window over its length (one thread: between its first and last
    completion in the window, as a slow sequential trainer finishes only a few)."""
    stop, lock, finished = threading.Event(), threading.Lock(), []
    width = model.inp.in_features

    def worker(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        while not stop.is_set():
            out = model(torch.randn(batch, width, generator=gen))
            out.square().mean().backward()
            with lock:
                finished.append(time.monotonic())

    before = [(m.stats.failures, m.stats.backward_failures) for m in model.moe]
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(jobs)]
    start = time.monotonic()
    for i, t in enumerate(threads):  # spread over the warm-up, or the J micro-batches move in lockstep
        time.sleep(max(0.0, start + i * warmup_s / (2 * jobs) - time.monotonic()))
        t.start()
    time.sleep(max(0.0, start + warmup_s + seconds - time.monotonic()))
    stop.set()
    for t in threads:
        t.join(120)
    window = sorted(t for t in finished if start + warmup_s <= t <= start + warmup_s + seconds)
    if jobs == 1:  # sequential: first to last completion is exact, whatever the window's edges
        rate = (len(window) - 1) / (window[-1] - window[0]) if len(window) >= 2 else 0.0
    else:          # completions may come in bursts: count them over the whole window
        rate = len(window) / seconds
    failures = sum(m.stats.failures + m.stats.backward_failures - f - b for m, (f, b) in zip(model.moe, before))
    codes = {code: n for code, n in sum((m.stats.failure_codes for m in model.moe), Counter()).items()}
    return {"batches_per_s": rate, "samples_per_s": rate * batch, "batches": len(window), "failures": failures,
            "failure_codes_so_far": codes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deltas", default="0,50,100,200", help="injected round-trip latencies, ms")
    parser.add_argument("--jobs", type=int, default=24, help="DMoE micro-batches in flight (trainer threads)")
    parser.add_argument("--batch", type=int, default=32, help="rows per micro-batch")
    parser.add_argument("--layers", type=int, default=4, help="DMoE layers (sequential call rounds)")
    parser.add_argument("--grid", type=int, default=2, help="experts per layer (a 1-d grid)")
    parser.add_argument("--k", type=int, default=2, help="experts per row")
    parser.add_argument("--d", type=int, default=64, help="expert width")
    parser.add_argument("--hosts", type=int, default=2, help="expert host processes")
    parser.add_argument("--compute-ms", type=float, default=20.0, help="emulated compute per task on a host")
    parser.add_argument("--warmup-s", type=float, default=6.0, help="per (mode, delta): J micro-batches "
                        "must have gone round once (J x 2 x layers x grid tasks over the hosts' rate)")
    parser.add_argument("--seconds", type=float, default=12.0, help="measured window per (mode, delta)")
    parser.add_argument("--hosts-through-proxy", action="store_true", help="delay the hosts' link too")
    args = parser.parse_args(argv)
    deltas = [float(d) for d in args.deltas.split(",")]
    torch.set_num_threads(1)
    experts = args.layers * args.grid
    config = relay_overrides(d=args.d, expert_hidden=args.d, layers=args.layers, grid=[args.grid], k=args.k)

    with tempfile.TemporaryDirectory(prefix="moe-latency-") as tmp_name:
        tmp = Path(tmp_name)
        relay = start_relay(tmp, config)
        proxies: list[ProxyProcess] = [spawn(relay.port, 0.0)]
        if args.hosts_through_proxy:
            proxies.append(spawn(relay.port, 0.0))
        hosts = start_hosts(proxies[-1].url if args.hosts_through_proxy else relay.url, args.hosts,
                            math.ceil(experts / args.hosts), tmp, compute_ms=args.compute_ms)
        trainer = None
        try:
            wait_until(lambda: len(directory(relay.url)["live"]) == experts, 120, f"{experts} experts hosted")
            trainer = Member(relay.url, "bench-trainer")
            model = DMoEMLP(**config["model"]["kwargs"])
            caller = caller_for(proxies[0].url, trainer.peer_id, max_workers=max(16, 2 * args.jobs * args.grid))
            model.attach_caller(caller)
            results: dict[str, dict[str, dict]] = {"dmoe": {}, "model_parallel": {}}
            for delta in deltas:
                for proxy in proxies:
                    proxy.set_delay(delta / 1000)
                for mode, jobs in (("dmoe", args.jobs), ("model_parallel", 1)):
                    out = measure(model, jobs, args.batch, args.warmup_s, args.seconds)
                    results[mode][f"{delta:g}"] = out
                    print(f"delta {delta:g} ms  {mode:15s} J={jobs:3d}  {out['samples_per_s']:8.1f} samples/s "
                          f"({out['batches']} micro-batches, {out['failures']} failed calls; {out['failure_codes_so_far']})",
                          flush=True)
            caller.close()
        finally:
            if trainer is not None:
                trainer.close()
            stop_all(hosts)
            for proxy in proxies:
                proxy.stop()
            relay.stop()

    def rate(mode: str, delta: float) -> float:
        return results[mode][f"{delta:g}"]["samples_per_s"]

    lo, hi = deltas[0], deltas[-1]
    x0 = results["dmoe"][f"{lo:g}"]["batches_per_s"]
    path_latency_s = 2 * args.layers * hi / 1000 * (2 if args.hosts_through_proxy else 1)
    j_bound = 2 * x0 * path_latency_s
    per_task_s = args.compute_ms / 1000
    summary = {
        "jobs": args.jobs, "j_bound": round(j_bound, 1), "j_meets_bound": args.jobs >= j_bound,
        "path_latency_s": path_latency_s, "delta_ms": deltas, "batch": args.batch, "layers": args.layers,
        "grid": args.grid, "k": args.k, "hosts": args.hosts, "compute_ms": args.compute_ms,
        "hosts_through_proxy": args.hosts_through_proxy,
        "host_bound_tasks_per_s": round(args.hosts / per_task_s, 1),
        "samples_per_s": {mode: {d: round(r["samples_per_s"], 1) for d, r in runs.items()}
                          for mode, runs in results.items()},
        "failures": sum(r["failures"] for runs in results.values() for r in runs.values()),
        "keep_200ms": round(rate("dmoe", hi) / max(rate("dmoe", lo), 1e-9), 3),
        "mp_keep_200ms": round(rate("model_parallel", hi) / max(rate("model_parallel", lo), 1e-9), 3),
        "vs_model_parallel_200ms": round(rate("dmoe", hi) / max(rate("model_parallel", hi), 1e-9), 2),
    }
    print(f"J = {args.jobs}; the bound 2 x X0 x path latency = 2 x {x0:.2f}/s x {path_latency_s:.2f} s = "
          f"{j_bound:.1f}", flush=True)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
