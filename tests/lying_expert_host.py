"""An expert host that lies, as a real process: the unmodified :class:`toolkit.moe.host.ExpertHost`
whose runtime answers wrong, finite, well-shaped results.

``python tests/lying_expert_host.py URL CAPACITY LIE [--from-version V]``

* ``identity``: every call returns its input unchanged (a forward ``x``, a backward ``g``) and
  the expert never trains: the expert attack of a host that saves its compute;
* ``scale``: every forward's honest output times 1.3 (backwards honest, the expert trains).

Calls on an expert version below ``V`` (default 0: every call) are answered honestly, so the lie
starts after the expert trained (its checks then need the host's checkpoint of that version).
Prints one JSON line per lie (``{"lied": uid, "kind": ..., "version": ...}``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("capacity", type=int)
    parser.add_argument("lie", choices=("identity", "scale"))
    parser.add_argument("--from-version", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from toolkit.moe.host import ExpertHost

    host = ExpertHost(args.url, capacity=args.capacity, name=f"liar-{args.lie}", device="cpu")
    runtime = host.runtime
    honest_forward, honest_backward = runtime.forward, runtime.backward

    def told(uid: str, kind: str, value: torch.Tensor) -> concurrent.futures.Future[torch.Tensor]:
        print(json.dumps({"lied": uid, "kind": kind, "version": host.updates.get(uid, 0)}), flush=True)
        future: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
        future.set_result(value)
        return future

    def forward(uid: str, x: torch.Tensor) -> concurrent.futures.Future[torch.Tensor]:
        if host.updates.get(uid, 0) < args.from_version:
            return honest_forward(uid, x)
        if args.lie == "identity":
            return told(uid, "forward", x.clone())
        return told(uid, "forward", honest_forward(uid, x).result() * 1.3)

    def backward(uid: str, x: torch.Tensor, g: torch.Tensor) -> concurrent.futures.Future[torch.Tensor]:
        if args.lie == "identity" and host.updates.get(uid, 0) >= args.from_version:
            return told(uid, "backward", g.clone())
        return honest_backward(uid, x, g)

    runtime.forward, runtime.backward = forward, backward  # type: ignore[method-assign]
    host.run(max_seconds=300)
    print(json.dumps({"stopped": host.waiting or ""}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
