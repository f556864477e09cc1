"""What the relay's checks of expert hosts cost: per call, the monitor (every call) and a spot
check (the relay's own computation of the call), against what the host computes for it.

    python benchmarks/moe_checks.py                       # d 1024, hidden 4096, 64 rows, ~1 min
    python benchmarks/moe_checks.py --d 256 --hidden 1024 --calls 40

Runs the relay's real review path (:meth:`relay_server.trust.expert_checks.ExpertTrust.review` on
the relay's DMoE state, ``Experts.create``) and a host's runtime (:class:`toolkit.moe.calls.LoopbackCaller`
with the run's SGD, as ``toolkit.moe.host`` runs it) in this process, one torch thread, call by
call alternating (forward, then backward): host, review unchecked (``check_share = 0``: decoding
the answer and the monitor), review checked (``check_share = 1``, version 0: the relay computes the
call). The relay's extra CPU at a share ``s`` is ``monitor + s x check`` per call.

Last line: ``{"d", "hidden", "rows", "calls", "host_ms", "monitor_ms", "check_ms", "monitor_vs_host",
"check_vs_host", "relay_vs_host_at_5pct"}`` (milliseconds per call, medians).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from relay_server.moe.moe_config import MoeSection  # noqa: E402
from relay_server.moe.state import Experts  # noqa: E402
from relay_server.trust.expert_checks import build_trust  # noqa: E402
from toolkit.moe.calls import LoopbackCaller  # noqa: E402
from toolkit.moe.experts import build_expert, make_optimizer  # noqa: E402
from toolkit.wire import payloads  # noqa: E402

UID = "ffn0.0"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--calls", type=int, default=20, help="forward and backward calls each")
    args = parser.parse_args()
    torch.set_num_threads(1)
    section = {
        "enabled": True,
        "layers": 1,
        "grid": [1],
        "expert": {"kind": "ffn", "d": args.d, "hidden": args.hidden},
        "optimizer": {"name": "none"},  # every call at the seed's version: every check computable
        "max_rows_per_call": args.rows,
    }
    module = build_expert(section["expert"], UID)
    host = LoopbackCaller({UID: module}, optimizer_factory=lambda m: make_optimizer(section["optimizer"], m))
    rng = np.random.default_rng(0)
    times: dict[str, list[float]] = {"host": [], "monitor": [], "check": []}
    with tempfile.TemporaryDirectory() as tmp:
        states = {
            share: Experts.create(MoeSection(**section, check_share=share), Path(tmp) / str(share))
            for share in (0.0, 1.0)
        }
        reviews = {share: build_trust(experts, lambda host, reason: None) for share, experts in states.items()}

        async def run() -> None:
            for i in range(2 * args.calls + 2):
                kind = "forward" if i % 2 == 0 else "backward"
                x = rng.standard_normal((args.rows, args.d)).astype(np.float32)
                g = rng.standard_normal((args.rows, args.d)).astype(np.float32) if kind == "backward" else None
                started = time.perf_counter()
                if g is None:
                    out = host.forward(UID, torch.from_numpy(x)).result().numpy()
                else:
                    out = host.backward(UID, torch.from_numpy(x), torch.from_numpy(g)).result().numpy()
                host_s = time.perf_counter() - started
                name = "y" if g is None else "g"
                answer = payloads.encode(payloads.encode_rows(name, out), {payloads.RESULT_VERSION: "0"})
                took = {}
                for share, label in ((0.0, "monitor"), (1.0, "check")):
                    started = time.perf_counter()
                    await reviews[share].review(f"t{i}", UID, kind, "host", x, g, answer)
                    took[label] = time.perf_counter() - started
                if i >= 2:  # the first forward and backward warm up (torch's first calls, the copy's build)
                    times["host"].append(host_s)
                    times["monitor"].append(took["monitor"])
                    times["check"].append(took["check"])
            status = reviews[1.0].status()
            assert status["agreed"] == status["checks"] and status["disagreed"] == 0, status

        asyncio.run(run())
    host.close()
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    print(
        f"per call (median of {len(times['host'])}): host {ms['host']:.2f} ms, relay monitor {ms['monitor']:.3f} ms, "
        f"relay check {ms['check']:.2f} ms",
        file=sys.stderr,
    )
    print(
        json.dumps(
            {
                "d": args.d,
                "hidden": args.hidden,
                "rows": args.rows,
                "calls": len(times["host"]),
                "host_ms": round(ms["host"], 3),
                "monitor_ms": round(ms["monitor"], 3),
                "check_ms": round(ms["check"], 3),
                "monitor_vs_host": round(ms["monitor"] / ms["host"], 4),
                "check_vs_host": round(ms["check"] / ms["host"], 3),
                "relay_vs_host_at_5pct": round((ms["monitor"] + 0.05 * ms["check"]) / ms["host"], 4),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
