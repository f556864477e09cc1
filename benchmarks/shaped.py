"""Seconds per averaging round over shaped links: the plan vs one relay vs an equal split.

    sudo python benchmarks/shaped.py                     # ~4 minutes
    sudo python benchmarks/shaped.py --mb 10 --rounds 3  # quicker

Every server and peer is a real process in its own network namespace (``relay_server/harness/netns.py``:
a star of veth links with ``tbf`` rate limits), sending real bytes over real HTTP. Defaults:

* the relay (coordinator) at 200 Mbit/s, two ``relay-server aggregator`` servers at 1 Gbit/s;
* four computing peers at 100, 125, 150 and 200 Mbit/s, each with a float32 gradient of ``--mb``
  MiB per round.

Three runs of the same rounds (each peer uploads its gradient, the owners step, every peer
downloads the new parameters; timed from the first upload's start to the last download's end):

* ``single_relay``: no aggregators, everything goes through the relay;
* ``equal_split``: the relay and both aggregators own a third each (the plan solved from equal
  priors before any transfer, re-planning off);
* ``plan``: the same start, then the relay re-solves DeDLOC's LP from what it measured in the
  warm-up rounds (its own link, the aggregators' reports, every peer's transfers) and moves the
  slices; only rounds under the final plan are timed.

Why no 50 Mbit/s peer by default: each peer must send and receive the whole vector whatever the
plan, so a 50 Mbit/s peer (2 x V / 50) takes exactly as long as a 200 Mbit/s relay serving four
peers (8 x V / 200): no plan can then beat the single relay (try ``--peer-mbit 50,100,150,200``).

Needs root (or CAP_NET_ADMIN) and iproute2; elsewhere the last line is ``{"skipped": reason}``.
Last line: ``{"plan_s", "single_relay_s", "equal_split_s", "plan_vs_single", "fractions", ...}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from allreduce import REPO, relay_config, run_peer  # noqa: E402

sys.path.insert(0, str(REPO))

from relay_server.harness.netns import Host, Star, unavailable  # noqa: E402
from relay_server.harness.process import wait_ready  # noqa: E402

RELAY_PORT, AGG_PORT = 8750, 8751
SAMPLES_PER_S = 1000.0  # compute never binds, so the LP's shares follow the links


def run_mode(
    mode: str,
    star: Star,
    relay_host: Host,
    agg_hosts: list[Host],
    peer_hosts: list[Host],
    numel: int,
    warmup: int,
    rounds: int,
) -> dict:
    """One collaboration in ``mode``; returns the timed rounds' seconds and the final shares."""
    aggregators = [] if mode == "single_relay" else agg_hosts
    total = warmup + rounds
    with tempfile.TemporaryDirectory(prefix=f"shaped-{mode}-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "run.toml").write_text(relay_config(numel, len(peer_hosts), replan=mode == "plan"))
        procs: list[subprocess.Popen] = []
        try:
            relay = subprocess.Popen(
                relay_host.command(
                    [
                        sys.executable,
                        "-m",
                        "relay_server.cli",
                        "serve",
                        "--config",
                        str(tmp / "run.toml"),
                        "--host",
                        relay_host.address,
                        "--port",
                        str(RELAY_PORT),
                        "--data-dir",
                        str(tmp / "data"),
                        "--ready-file",
                        str(tmp / "relay.ready"),
                    ]
                ),
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=open(tmp / "relay.log", "w"),
            )
            procs.append(relay)
            url = wait_ready(relay, tmp / "relay.ready", tmp / "relay.log", "relay")
            for i, host in enumerate(aggregators):
                procs.append(
                    subprocess.Popen(
                        host.command(
                            [
                                sys.executable,
                                "-m",
                                "relay_server.cli",
                                "aggregator",
                                "--coordinator",
                                url,
                                "--host",
                                host.address,
                                "--port",
                                str(AGG_PORT),
                                "--data-dir",
                                str(tmp / f"agg{i}"),
                                "--admin-token-file",
                                str(tmp / "data" / "admin_token"),
                                "--name",
                                host.name,
                                "--ready-file",
                                str(tmp / f"agg{i}.ready"),
                            ]
                        ),
                        cwd=REPO,
                        stdout=subprocess.DEVNULL,
                        stderr=open(tmp / f"agg{i}.log", "w"),
                    )
                )
                wait_ready(procs[-1], tmp / f"agg{i}.ready", tmp / f"agg{i}.log", host.name)
            peers = []
            for i, host in enumerate(peer_hosts):
                peers.append(
                    subprocess.Popen(
                        host.command(
                            [
                                sys.executable,
                                __file__,
                                "peer",
                                "--url",
                                url,
                                "--index",
                                str(i),
                                "--numel",
                                str(numel),
                                "--rounds",
                                str(total),
                                "--peers",
                                str(len(peer_hosts)),
                                "--slices",
                                str(len(aggregators) + 1 if aggregators else 0),
                            ]
                        ),
                        cwd=REPO,
                        stdout=subprocess.PIPE,
                        stderr=open(tmp / f"peer{i}.log", "w"),
                        text=True,
                    )
                )
            procs.extend(peers)
            # while they run, keep the plan's inputs (the driver reaches the relay over the bridge)
            measured, deadline = {}, time.monotonic() + 60 + 120 * total
            while any(proc.poll() is None for proc in peers) and time.monotonic() < deadline:
                measured = _measured_rates(url, len(peer_hosts)) or measured
                time.sleep(1.0)
            reports = []
            for i, proc in enumerate(peers):
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                if proc.returncode != 0:
                    raise SystemExit(f"{mode}: peer {i} failed:\n{(tmp / f'peer{i}.log').read_text()[-3000:]}")
                reports.extend(json.loads(line) for line in out.splitlines() if line.startswith("{"))
        finally:
            for proc in reversed(procs):
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    by_step: dict[int, list[dict]] = {}
    for r in reports:
        by_step.setdefault(r["step"], []).append(r)
    seconds = {step: max(r["ended"] for r in rs) - min(r["started"] for r in rs) for step, rs in by_step.items()}
    final_owners = by_step[total - 1][0]["owners"]
    # the timed rounds: the last ``rounds``, and of those only ones under the final plan
    timed = [s for s in range(warmup, total) if by_step[s][0]["owners"] == final_owners]
    return {
        "round_s": statistics.median(seconds[s] for s in timed),
        "timed_rounds": len(timed),
        "all_rounds_s": [round(seconds[s], 3) for s in sorted(seconds)],
        "fractions": final_owners or {"relay": 1.0},
        "measured_mbit": measured,
    }


def _measured_rates(url: str, peers: int) -> dict[str, list]:
    """What the current plan was solved from, once it covers all ``peers``: per node, [upload,
    download] in Mbit/s and whether each was measured or the prior ({} before that)."""
    from toolkit.client import RelayClient

    client = RelayClient(url, retries=0)
    try:
        inputs = client.get_plan().inputs
    except Exception:  # noqa: BLE001 - the relay may be busy or starting; keep the last one
        return {}
    finally:
        client.close()
    if sum(i.role == "peer" for i in inputs) < peers:
        return {}
    return {
        i.name: [round(i.upload * 8e-6, 1), round(i.download * 8e-6, 1), i.upload_source, i.download_source]
        for i in inputs
    }


def bench(args: argparse.Namespace) -> dict:
    reason = unavailable()
    if reason:
        return {"skipped": reason}
    numel = int(args.mb * 2**20) // 4
    peer_mbit = [float(x) for x in args.peer_mbit.split(",")]
    star = Star()
    relay_host = star.add("relay", args.relay_mbit)
    agg_hosts = [star.add(f"agg{i}", args.aggregator_mbit) for i in range(2)]
    peer_hosts = [star.add(f"peer{i}", mbit) for i, mbit in enumerate(peer_mbit)]
    results = {}
    with star:
        for mode in ("single_relay", "equal_split", "plan"):
            warmup = args.warmup if mode == "plan" else 1
            results[mode] = run_mode(mode, star, relay_host, agg_hosts, peer_hosts, numel, warmup, args.rounds)
            print(
                f"{mode}: {results[mode]['round_s']:.2f} s/round (rounds {results[mode]['all_rounds_s']}), "
                f"shares {results[mode]['fractions']}",
                flush=True,
            )
        print(f"the plan's inputs (Mbit/s up, down): {results['plan']['measured_mbit']}", flush=True)
    plan_s, single_s = results["plan"]["round_s"], results["single_relay"]["round_s"]
    return {
        "plan_s": round(plan_s, 3),
        "single_relay_s": round(single_s, 3),
        "equal_split_s": round(results["equal_split"]["round_s"], 3),
        "plan_vs_single": round(plan_s / single_s, 3),
        "fractions": results["plan"]["fractions"],
        "mb": args.mb,
        "relay_mbit": args.relay_mbit,
        "aggregator_mbit": args.aggregator_mbit,
        "peer_mbit": peer_mbit,
    }


def peer(args: argparse.Namespace) -> None:
    """One peer inside its namespace: a JSON line per round on stdout."""

    def report(item: tuple) -> None:
        if item[0] == "params":
            return
        index, step, started, ended, version, owners, _ = item
        print(
            json.dumps(
                {
                    "index": index,
                    "step": step,
                    "started": started,
                    "ended": ended,
                    "version": version,
                    "owners": owners,
                }
            ),
            flush=True,
        )

    run_peer(
        args.url, args.index, args.numel, args.rounds, args.peers, args.slices, report, samples_per_s=SAMPLES_PER_S
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("peer", help="internal: one peer process")
    for name in ("--url",):
        p.add_argument(name, required=True)
    for name in ("--index", "--numel", "--rounds", "--peers", "--slices"):
        p.add_argument(name, type=int, required=True)
    parser.add_argument("--mb", type=float, default=20.0, help="gradient size in MiB (float32; default 20)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per mode (default 3)")
    parser.add_argument("--warmup", type=int, default=4, help="rounds the plan mode measures first (default 4)")
    parser.add_argument("--relay-mbit", type=float, default=200.0)
    parser.add_argument("--aggregator-mbit", type=float, default=1000.0)
    parser.add_argument("--peer-mbit", default="100,125,150,200", help="comma-separated, one per peer")
    args = parser.parse_args()
    if args.command == "peer":
        peer(args)
        return
    print(json.dumps(bench(args)))


if __name__ == "__main__":
    main()
