"""What host batching gains (Learning@home s3.3, Appendix D): tasks/s of one expert host with 8
concurrent callers, its queued calls run as one batch per expert and kind, against the same host
running every call alone.

    python benchmarks/moe_batching.py                  # ~2 min: --callers 8, --seconds 20 per mode
    python benchmarks/moe_batching.py --seconds 8      # quicker

Processes: a relay with ``[moe]`` (one expert, ``ffn0.0``, of width ``--d`` and hidden
``--hidden``), one real expert host process (``benchmarks/moe_rig.py host``: the production
ExpertHost computing the real expert on CPU, one torch thread, SGD step per backward batch), and
this process with ``--callers`` registered trainers, each on its own thread calling forward then
backward (``--rows`` rows) one after another, as a trainer's mixture layer does, for
``--seconds`` after ``--warmup`` seconds. Both modes run on a fresh relay and host; the order is
unbatched first, then batched.

A task is one call answered (a forward or a backward). On CPU, an expert's compute grows with its
rows, so what batching saves here is the per-call work of the host (one optimizer step per
backward batch instead of per call, one autograd pass, one dispatch): on a GPU, where a batch of
8 small calls costs about what one does, the gain is larger.

Last line: ``{"callers", "d", "hidden", "rows", "unbatched_tasks_per_s", "batched_tasks_per_s",
"ratio", "calls_per_batch"}`` (``ratio``: batched / unbatched).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_rig import Member, caller_for, directory, relay_overrides, start_hosts, stop_all, wait_until  # noqa: E402

from relay_server.harness.process import start_relay  # noqa: E402

UID = "ffn0.0"


def measure(args: argparse.Namespace, batching: bool) -> dict:
    config = relay_overrides(d=args.d, expert_hidden=args.hidden, layers=1, grid=[1], k=1)
    with tempfile.TemporaryDirectory(prefix="moe-batching-") as tmp_name:
        tmp = Path(tmp_name)
        relay = start_relay(tmp, config)
        hosts = start_hosts(relay.url, 1, 1, tmp, batching=batching)
        members = [Member(relay.url, f"caller{i}") for i in range(args.callers)]
        callers = [caller_for(relay.url, m.peer_id, max_workers=2) for m in members]
        done, failed = [0] * args.callers, [0] * args.callers
        counting, stop = threading.Event(), threading.Event()

        def loop(i: int) -> None:
            gen = torch.Generator().manual_seed(i)
            while not stop.is_set():
                x, g = torch.randn(args.rows, args.d, generator=gen), torch.randn(args.rows, args.d, generator=gen)
                for call in (lambda: callers[i].forward(UID, x), lambda: callers[i].backward(UID, x, g)):
                    try:
                        call().result(timeout=60)
                        done[i] += counting.is_set()
                    except Exception:  # a failed call is counted, not a task done
                        failed[i] += counting.is_set()

        threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(args.callers)]
        try:
            wait_until(lambda: directory(relay.url)["live"] == [UID], 120, f"a host for {UID}")
            for thread in threads:
                thread.start()
            time.sleep(args.warmup)
            counting.set()
            start = time.perf_counter()
            time.sleep(args.seconds)
            counting.clear()
            elapsed = time.perf_counter() - start
            stop.set()
            for thread in threads:
                thread.join(90)
        finally:
            for caller, member in zip(callers, members):
                caller.close()
                member.close()
            stop_all(hosts)
            relay.stop()
        tail = (tmp / "host0.log").read_text()
    served = re.search(r"(\d+) tasks in (\d+) batches", tail)
    tasks, batches = (int(served.group(1)), int(served.group(2))) if served else (0, 0)
    result = {
        "tasks_per_s": round(sum(done) / elapsed, 2),
        "failed": sum(failed),
        "calls_per_batch": round(tasks / batches, 2) if batches else None,
    }
    print(
        f"{'batched' if batching else 'unbatched'}: {result['tasks_per_s']} tasks/s "
        f"({result['calls_per_batch']} calls per batch, {result['failed']} failed)",
        flush=True,
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--callers", type=int, default=8)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    unbatched, batched = measure(args, batching=False), measure(args, batching=True)
    print(
        json.dumps(
            {
                "callers": args.callers,
                "d": args.d,
                "hidden": args.hidden,
                "rows": args.rows,
                "unbatched_tasks_per_s": unbatched["tasks_per_s"],
                "batched_tasks_per_s": batched["tasks_per_s"],
                "ratio": round(batched["tasks_per_s"] / unbatched["tasks_per_s"], 3)
                if unbatched["tasks_per_s"]
                else None,
                "calls_per_batch": batched["calls_per_batch"],
                "failed": {"unbatched": unbatched["failed"], "batched": batched["failed"]},
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
