"""Learning@home's Figure 4 through the real relay and the shipped trainer: micro-batches/s of
``toolkit.join()`` against network latency, J micro-batches in flight (join's own sizing) against
one at a time (``join(moe_in_flight=1)``).

    python benchmarks/moe_latency.py                              # ~4 minutes on 2 idle cores
    python benchmarks/moe_latency.py --seconds 8 --deltas 0,200   # quicker

Processes: one relay with ``[moe]`` (``relay-server serve``), ``--hosts`` expert host processes
(``benchmarks/moe_rig.py host``: the real ExpertHost with ``--compute-ms`` of emulated compute per
task), ``relay_server/harness/latency_proxy.py`` in front of the relay, which delays every forwarded chunk
by delta/2 each way, and per (delta, mode) one trainer process (this file's ``trainer``
subcommand) that calls ``toolkit.join()`` through the proxy, exactly as a volunteer's notebook
would: its relay traffic (join, heartbeats, parameters) and every expert call pay delta. Every call
is real: RelayExpertCaller -> HTTP -> the relay's broker -> a host's task long poll -> the result
back through the relay.

What is counted: join() reports each micro-batch it trained to its panel; the trainer's panel
records when. After ``--warmup-s`` from the first report (J grows from 1 as join measures its
compute and waits), the reports in the next ``--seconds`` give micro-batches/s (one at a time:
first to last report in the window, as a slow trainer finishes only a few). The run's
``target_batch`` is set far beyond what a trainer computes here, so no round falls in the window:
this measures the trainer's pipeline, not the rounds. ``--target-batch N`` gives the run real
rounds (strict, ``max_staleness = 0``): the trainer then drains at each round's end, holding back
the micro-batches that would be computed on parameters about to be replaced
(toolkit/moe/inflight.py), and each round's own time counts too.

Where the latency sits. By default only the trainer's link is delayed; hosts reach the relay
directly, so one expert call costs delta more. That is the paper's emulation (a delay per
request between trainer and expert). ``--hosts-through-proxy`` delays the hosts' link as well (a
second proxy), so a call costs 2 x delta, and the host's own loop meets the latency (its task
polls and lease renewals wait a round trip each: at 200 ms the hosts, not the trainer, set the
throughput).

Bound (docs/experts.md): a micro-batch waits for 2 x layers sequential call rounds, each delta
longer at delta; join keeps J = ceil((c + w) / c) in flight (c: its compute per micro-batch,
w: its waits for expert calls), so throughput holds while J <= J_max (32). The benchmark prints
the J join used and ``j_little = X0 x path_latency_s``, the extra micro-batches in flight that
keeping X0 (micro-batches/s at delta = 0) over ``path_latency_s = 2 x layers x delta_max`` needs
(Little's law; x 2 with hosts behind the proxy).

Last line: ``{"in_flight", "j_little", "batches_per_s": {"dmoe": {delta: ...}, "one_at_a_time":
{...}}, "keep_200ms", "vs_one_at_a_time_200ms", "failures", ...}``: ``keep_200ms`` is join's
throughput at the last delta (200 ms by default) over the first (0 ms), ``vs_one_at_a_time_200ms``
join's over join with ``moe_in_flight=1`` at the last delta, ``failures`` the expert calls that
failed or timed out (a failed call ends early, so a run with failures overstates).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_rig import directory, relay_overrides, start_hosts, stop_all, wait_until  # noqa: E402

from relay_server.harness.latency_proxy import ProxyProcess, spawn  # noqa: E402
from relay_server.harness.process import start_relay  # noqa: E402


def trainer_main(argv: list[str]) -> int:
    """One trainer: ``toolkit.join()`` on random batches until the measured window has passed;
    prints one JSON line (micro-batches/s in the window, the J join used, failed calls)."""
    parser = argparse.ArgumentParser(prog="python benchmarks/moe_latency.py trainer")
    parser.add_argument("--relay", required=True)
    parser.add_argument("--in-flight", type=int, default=None, help="join's moe_in_flight (default: its own)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup-s", type=float, default=6.0)
    parser.add_argument("--seconds", type=float, default=12.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from toolkit import join
    from toolkit.client import RelayClient
    from toolkit.models import DMoEMLP

    model = DMoEMLP(**RelayClient(args.relay).get_run().model.kwargs)
    reports: list[float] = []
    end = [math.inf]  # the window's end, once the first report fixed its start

    class Clock:  # a panel: join reports every micro-batch it trained
        def update(self, progress) -> None:
            reports.append(time.monotonic())
            if len(reports) == 1:
                end[0] = reports[0] + args.warmup_s + args.seconds

        def close(self) -> None:
            pass

    def data():
        gen = torch.Generator().manual_seed(0)
        while time.monotonic() < end[0]:
            yield torch.randn(args.batch, model.inp.in_features + 1, generator=gen)

    result = join(
        args.relay,
        model=model,
        data=data(),
        batch_size=args.batch,
        panel=Clock(),
        peer_name="bench-trainer",
        moe_in_flight=args.in_flight,
    )
    start = reports[0] + args.warmup_s
    window = [t for t in reports if start <= t <= start + args.seconds]
    if args.in_flight == 1:  # sequential: first to last report is exact, whatever the window's edges
        rate = (len(window) - 1) / (window[-1] - window[0]) if len(window) >= 2 else 0.0
    else:  # reports may come in bursts: count them over the whole window
        rate = len(window) / args.seconds
    failures = sum(m.stats.failures + m.stats.backward_failures for m in model.moe)
    codes = dict(sum((m.stats.failure_codes for m in model.moe), Counter()))
    print(
        json.dumps(
            {
                "batches_per_s": rate,
                "batches": len(window),
                "in_flight": result.in_flight,
                "micro_batches": result.local_steps,
                "failures": failures,
                "failure_codes": codes,
            }
        ),
        flush=True,
    )
    return 0


def run_trainer(url: str, in_flight: int | None, args: argparse.Namespace) -> dict:
    """A trainer process (:func:`trainer_main`) against ``url``; its JSON line."""
    extra = [] if in_flight is None else ["--in-flight", str(in_flight)]
    done = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "trainer",
            "--relay",
            url,
            "--batch",
            str(args.batch),
            "--warmup-s",
            str(args.warmup_s),
            "--seconds",
            str(args.seconds),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120 + 4 * (args.warmup_s + args.seconds),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if done.returncode != 0:
        raise RuntimeError(f"the trainer failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["trainer"]:
        return trainer_main(argv[1:])
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--deltas", default="0,50,100,200", help="injected round-trip latencies, ms")
    parser.add_argument("--batch", type=int, default=32, help="rows per micro-batch")
    parser.add_argument("--layers", type=int, default=4, help="DMoE layers (sequential call rounds)")
    parser.add_argument("--grid", type=int, default=2, help="experts per layer (a 1-d grid)")
    parser.add_argument("--k", type=int, default=2, help="experts per row")
    parser.add_argument("--d", type=int, default=64, help="expert width")
    parser.add_argument("--hosts", type=int, default=2, help="expert host processes")
    parser.add_argument("--compute-ms", type=float, default=20.0, help="emulated compute per task on a host")
    parser.add_argument(
        "--warmup-s",
        type=float,
        default=6.0,
        help="per (mode, delta), from the trainer's first "
        "micro-batch: J grows as join measures, and J micro-batches must have gone round once",
    )
    parser.add_argument("--seconds", type=float, default=12.0, help="measured window per (mode, delta)")
    parser.add_argument("--hosts-through-proxy", action="store_true", help="delay the hosts' link too")
    parser.add_argument(
        "--target-batch",
        type=int,
        default=None,
        help="the run's target_batch, for real rounds "
        "in the window (max_staleness 0: the trainer drains at each round's end); default: beyond "
        "reach, no round",
    )
    args = parser.parse_args(argv)
    deltas = [float(d) for d in args.deltas.split(",")]
    experts = args.layers * args.grid
    config = relay_overrides(d=args.d, expert_hidden=args.d, layers=args.layers, grid=[args.grid], k=args.k)
    # by default no round in the window: the trainer's pipeline is measured
    config["run"]["target_batch"] = args.target_batch or 1 << 30
    # random data through many steps: at the tests' dense lr (0.05) the gate and head grew until the
    # experts' updates overflowed (NaN results, every call failing); the experts' small lr, as theirs
    config["optimizer"]["lr"] = config["moe"]["optimizer"]["lr"]
    load = os.getloadavg()[0]

    with tempfile.TemporaryDirectory(prefix="moe-latency-") as tmp_name:
        tmp = Path(tmp_name)
        relay = start_relay(tmp, config)
        proxies: list[ProxyProcess] = [spawn(relay.port, 0.0)]
        if args.hosts_through_proxy:
            proxies.append(spawn(relay.port, 0.0))
        hosts = start_hosts(
            proxies[-1].url if args.hosts_through_proxy else relay.url,
            args.hosts,
            math.ceil(experts / args.hosts),
            tmp,
            compute_ms=args.compute_ms,
        )
        try:
            wait_until(lambda: len(directory(relay.url)["live"]) == experts, 120, f"{experts} experts hosted")
            results: dict[str, dict[str, dict]] = {"dmoe": {}, "one_at_a_time": {}}
            for delta in deltas:
                for proxy in proxies:
                    proxy.set_delay(delta / 1000)
                for mode, in_flight in (("dmoe", None), ("one_at_a_time", 1)):
                    out = run_trainer(proxies[0].url, in_flight, args)
                    results[mode][f"{delta:g}"] = out
                    print(
                        f"delta {delta:g} ms  {mode:13s} J={out['in_flight']:3d}  {out['batches_per_s']:6.2f} "
                        f"micro-batches/s ({out['batches']} in the window, {out['failures']} failed calls; "
                        f"{out['failure_codes']})",
                        flush=True,
                    )
        finally:
            stop_all(hosts)
            for proxy in proxies:
                proxy.stop()
            relay.stop()

    def rate(mode: str, delta: float) -> float:
        return results[mode][f"{delta:g}"]["batches_per_s"]

    lo, hi = deltas[0], deltas[-1]
    x0 = rate("dmoe", lo)
    path_latency_s = 2 * args.layers * hi / 1000 * (2 if args.hosts_through_proxy else 1)
    j_little = x0 * path_latency_s
    in_flight = results["dmoe"][f"{hi:g}"]["in_flight"]
    summary = {
        "in_flight": in_flight,
        "in_flight_by_delta": {d: r["in_flight"] for d, r in results["dmoe"].items()},
        "j_little": round(j_little, 1),
        "j_meets_bound": in_flight >= j_little,
        "path_latency_s": path_latency_s,
        "delta_ms": deltas,
        "batch": args.batch,
        "layers": args.layers,
        "grid": args.grid,
        "k": args.k,
        "hosts": args.hosts,
        "compute_ms": args.compute_ms,
        "hosts_through_proxy": args.hosts_through_proxy,
        "target_batch": args.target_batch,
        "load_1min_before": round(load, 2),
        "load_1min_after": round(os.getloadavg()[0], 2),
        "batches_per_s": {
            mode: {d: round(r["batches_per_s"], 2) for d, r in runs.items()} for mode, runs in results.items()
        },
        "samples_per_s": {
            mode: {d: round(r["batches_per_s"] * args.batch, 1) for d, r in runs.items()}
            for mode, runs in results.items()
        },
        "failures": sum(r["failures"] for runs in results.values() for r in runs.values()),
        "keep_200ms": round(rate("dmoe", hi) / max(rate("dmoe", lo), 1e-9), 3),
        "one_at_a_time_keep_200ms": round(rate("one_at_a_time", hi) / max(rate("one_at_a_time", lo), 1e-9), 3),
        "vs_one_at_a_time_200ms": round(rate("dmoe", hi) / max(rate("one_at_a_time", hi), 1e-9), 2),
    }
    print(
        f"join kept J = {in_flight} in flight at {hi:g} ms; Little's law: X0 x path latency = {x0:.2f}/s x "
        f"{path_latency_s:.2f} s = {j_little:.1f} more than at 0 ms",
        flush=True,
    )
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
