"""The relay's broker overhead (A8): round trip of one expert call, and relay bytes per call.

    python benchmarks/moe_broker.py                     # ~70 s (an open run, then a signed one)
    python benchmarks/moe_broker.py --calls 200 --auth open   # quicker

Processes: a relay with ``[moe]`` (one expert of width ``--d``), one real expert host process
(``benchmarks/moe_rig.py host --echo``: the production ExpertHost, whose expert answers the call's
``x`` unchanged, so no compute is timed), and this process as a registered trainer calling through
:class:`toolkit.moe.remote.RelayExpertCaller`.

1. Round trip: ``--calls`` forward calls one after another, each of ``--payload-kib`` of float32
   rows (64 KiB = 128 rows x 128 floats), timed from ``caller.forward`` to the future's result:
   trainer -> relay (PUT, validated, queued) -> the host's task long poll -> the host's result PUT
   (validated) -> the relay's answer to the held PUT -> trainer. Median and p99.
2. Bytes: the same calls again with the trainer and a second host behind byte-counting proxies
   (``relay_server/harness/latency_proxy.py``, no delay): everything the relay sent and received for them,
   per call, against the model 4 x payload (x in and out, y in and out; MODEL_PARALLEL.md
   s2.4.6). The measured side includes every HTTP header, the containers' headers, the host's
   polls, heartbeats and lease renewals over the same seconds (``idle_bytes_per_s``, measured
   before the calls, says how much of it is background).

``--auth both`` (the default) measures an open run, then a run with ``[auth] mode = "hf"``: logins
through ``tests/hf_standin.py`` (the local Hugging Face stand-in), every request and every answer
signed (Ed25519), as MODEL_PARALLEL.md's risks section asks for A8.

Last line: ``{"rtt_median_ms", "rtt_p99_ms", "bytes_per_call", "bytes_per_call_ratio", ...,
"hf": {the same for the signed run}}`` (the top level is the first mode measured).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_rig import Member, caller_for, relay_overrides, start_hosts, stop_all, wait_until  # noqa: E402

from relay_server.harness.latency_proxy import spawn  # noqa: E402
from relay_server.harness.process import start_relay  # noqa: E402
from toolkit.wire.protocol import ROUTES  # noqa: E402

UID = "ffn0.0"


def round_trips(caller, x: torch.Tensor, calls: int) -> list[float]:
    """Seconds per sequential forward call; every answer checked (an echo returns ``x``)."""
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        y = caller.forward(UID, x).result(timeout=30)
        out.append(time.perf_counter() - start)
        if not torch.equal(y, x):
            raise AssertionError("the echo expert's answer differs from the call's x")
    return out


def hosted(trainer: Member) -> list[str]:
    """The relay's live uids, asked as the trainer (a run with logins answers signed requests only)."""
    return trainer.client.transport.request("GET", ROUTES["moe_directory"]).json()["live"]


TOKENS = {"bench-trainer": "hf_bench_trainer_token_1", "bench-host": "hf_bench_host_token_123"}


def measure(auth: str, args: argparse.Namespace) -> dict:
    """Round trips and bytes per call in a run whose ``[auth] mode`` is ``auth`` (open or hf)."""
    rows = args.payload_kib * 1024 // (4 * args.d)
    payload = rows * args.d * 4
    config = relay_overrides(d=args.d, expert_hidden=8, layers=1, grid=[1], k=1)
    x = torch.randn(rows, args.d, generator=torch.Generator().manual_seed(0))
    standin, env = None, {}
    if auth == "hf":  # logins through the local Hugging Face stand-in; every request signed
        from relay_server.harness.hf_standin import HfStandin

        standin = HfStandin().start()
        for name, token in TOKENS.items():
            standin.add_user(token, name)
        config["auth"] = {"mode": "hf", "hf_endpoint": standin.url, "allow_users": sorted(TOKENS)}
        env = {"HF_TOKEN": TOKENS["bench-host"]}

    with tempfile.TemporaryDirectory(prefix="moe-broker-") as tmp_name:
        tmp = Path(tmp_name)
        relay = start_relay(tmp, config)
        trainer = Member(relay.url, "bench-trainer", token=TOKENS["bench-trainer"] if auth == "hf" else None)
        signer = trainer.client.session.auth
        hosts = start_hosts(relay.url, 1, 1, tmp, echo=True, env=env)
        proxies = []
        try:
            wait_until(lambda: hosted(trainer) == [UID], 120, f"a host for {UID}")
            caller = caller_for(relay.url, trainer.peer_id, max_workers=4, auth=signer)
            round_trips(caller, x, args.warmup)
            rtt = sorted(round_trips(caller, x, args.calls))
            caller.close()

            # Bytes: a fresh host behind one counting proxy, the trainer behind another.
            stop_all(hosts)
            wait_until(lambda: not hosted(trainer), 60, "the first host to leave")
            proxies = [spawn(relay.port, 0.0), spawn(relay.port, 0.0)]
            (tmp / "counted").mkdir()
            hosts = start_hosts(proxies[1].url, 1, 1, tmp / "counted", echo=True, env=env)
            wait_until(lambda: hosted(trainer) == [UID], 120, f"a host for {UID}")
            caller = caller_for(proxies[0].url, trainer.peer_id, max_workers=4, auth=signer)
            round_trips(caller, x, args.warmup)
            time.sleep(1.0)
            idle_start = [p.counts() for p in proxies]
            time.sleep(args.idle_s)
            idle_end = [p.counts() for p in proxies]
            start = time.perf_counter()
            round_trips(caller, x, args.calls)
            elapsed = time.perf_counter() - start
            end = [p.counts() for p in proxies]
            caller.close()
        finally:
            trainer.close()
            stop_all(hosts)
            for proxy in proxies:
                proxy.stop()
            relay.stop()
            if standin is not None:
                standin.stop()

    def moved(a: list[dict], b: list[dict]) -> int:
        return sum(e["bytes_up"] + e["bytes_down"] - s["bytes_up"] - s["bytes_down"] for s, e in zip(a, b))

    per_call = moved(idle_end, end) / args.calls
    idle_per_s = moved(idle_start, idle_end) / args.idle_s
    net = (moved(idle_end, end) - idle_per_s * elapsed) / args.calls
    ms = [t * 1000 for t in rtt]
    return {
        "auth": auth,
        "calls": args.calls,
        "payload_bytes": payload,
        "rows": rows,
        "d": args.d,
        "rtt_median_ms": round(statistics.median(ms), 2),
        "rtt_p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 2),
        "rtt_mean_ms": round(statistics.fmean(ms), 2),
        "rtt_min_ms": round(ms[0], 2),
        "calls_per_s_through_proxies": round(args.calls / elapsed, 1),
        "bytes_per_call": round(per_call),
        "model_bytes_per_call": 4 * payload,
        "bytes_per_call_ratio": round(per_call / (4 * payload), 4),
        "idle_bytes_per_s": round(idle_per_s),
        "bytes_per_call_net_of_idle": round(net),
        "bytes_per_call_ratio_net_of_idle": round(net / (4 * payload), 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=1000, help="timed calls (and as many for the bytes)")
    parser.add_argument("--warmup", type=int, default=30, help="untimed calls first")
    parser.add_argument("--payload-kib", type=int, default=64, help="x per call (float32 rows of --d)")
    parser.add_argument("--d", type=int, default=128, help="expert width")
    parser.add_argument("--idle-s", type=float, default=3.0, help="background traffic measured this long")
    parser.add_argument(
        "--auth",
        choices=("open", "hf", "both"),
        default="both",
        help="the run's auth mode: open, hf (signed requests after a login), or both",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    modes = ("open", "hf") if args.auth == "both" else (args.auth,)
    results = {mode: measure(mode, args) for mode in modes}
    for mode, r in results.items():
        print(
            f"{mode:4s}: round trip median {r['rtt_median_ms']} ms, p99 {r['rtt_p99_ms']} ms; "
            f"{r['bytes_per_call']} bytes per call = {r['bytes_per_call_ratio']} x (4 x payload)",
            flush=True,
        )
    summary = dict(results[modes[0]])
    if len(modes) > 1:
        summary["hf"] = results["hf"]
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
