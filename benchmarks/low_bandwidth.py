"""Bytes per sample, sync vs local SGD (issue 26), on the demo model: a skeleton.

    python benchmarks/low_bandwidth.py --peers 4 --steps 100 --h 10,50

For each variant -- sync mode (``run.compression``, int8 by default) and ``run.mode =
"local_sgd"`` with each H -- one relay process and ``--peers`` peer processes train the demo
byte-level transformer (``relay_server/defaults/demo.toml``) on the shipped corpus, each peer
``--steps`` micro-batches of ``--batch`` samples (so every variant processes the same samples).
Each peer counts the bytes its sockets send and receive (every request: joins, heartbeats,
uploads, downloads), so "bytes per sample" is what a volunteer's link carries, both ways. The
final global parameters are evaluated on fixed held-out batches of the corpus.

Prints one line per variant, then one JSON object: ``bytes_ratio`` (sync bytes per sample up +
down / the best local SGD variant's) and ``loss_gap`` (that variant's relative final-loss
difference from sync). Not measured yet (null): ``shaped_speedup`` and ``busy_fraction`` (they
need ``benchmarks/netns.py`` links and the overlap of issue 26), ``down_bits_per_param`` of a
compressed broadcast (local SGD downloads are uncompressed for now).

Internal: ``--peer`` runs one peer (the benchmark starts it).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EVAL_SEED, EVAL_BATCHES = 10_000, 4

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


def count_socket_bytes() -> dict[str, int]:
    """Count every byte this process's sockets send and receive from now on (requests and urllib3
    go through ``sendall`` / ``send`` and ``recv_into`` / ``recv``)."""
    counts = {"up": 0, "down": 0}
    cls = socket.socket
    sendall, send, recv_into, recv = cls.sendall, cls.send, cls.recv_into, cls.recv

    def counted_sendall(self, data, *args):  # type: ignore[no-untyped-def]
        counts["up"] += memoryview(data).nbytes
        return sendall(self, data, *args)

    def counted_send(self, data, *args):  # type: ignore[no-untyped-def]
        n = send(self, data, *args)
        counts["up"] += n
        return n

    def counted_recv_into(self, buffer, *args):  # type: ignore[no-untyped-def]
        n = recv_into(self, buffer, *args)
        counts["down"] += n
        return n

    def counted_recv(self, *args):  # type: ignore[no-untyped-def]
        data = recv(self, *args)
        counts["down"] += len(data)
        return data

    cls.sendall, cls.send, cls.recv_into, cls.recv = counted_sendall, counted_send, counted_recv_into, counted_recv
    return counts


def run_peer(args: argparse.Namespace) -> None:
    """One volunteer: ``--steps`` micro-batches through CollaborativeOptimizer, then its byte counts."""
    counts = count_socket_bytes()
    import torch

    from toolkit.client import RelayClient
    from toolkit.corpus import demo_batches
    from toolkit.models import build_model, loss_of
    from toolkit.optimizer import CollaborativeOptimizer

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    client = RelayClient(args.relay)
    run = client.get_run()
    model = build_model(run.model)
    opt = CollaborativeOptimizer(model, client=client, batch_size_per_step=args.batch, peer_name=f"peer{args.seed}")
    data = demo_batches(args.batch, run.model.kwargs["seq_len"], seed=args.seed)
    for _ in range(args.steps):
        if opt.finished:
            break
        batch = next(data)
        opt.zero_grad()
        loss = loss_of(model, batch)
        loss.backward()
        opt.step(loss=loss.item())
    opt.close()
    print(json.dumps({"up": counts["up"], "down": counts["down"], "samples": args.steps * args.batch}), flush=True)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)


def write_run(path: Path, overrides: dict[str, dict[str, Any]]) -> Path:
    """The demo run with ``overrides`` merged in, as a TOML file."""
    config = tomllib.loads((REPO / "relay_server/defaults/demo.toml").read_text())
    for section, values in overrides.items():
        config.setdefault(section, {}).update(values)
    lines = []
    for section, values in config.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {toml_value(value)}" for key, value in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def evaluate(url: str) -> float:
    """Mean loss of the relay's current parameters on fixed held-out batches of the corpus."""
    import numpy as np
    import torch

    from toolkit.client import RelayClient
    from toolkit.corpus import demo_batches
    from toolkit.models import build_model, loss_of

    client = RelayClient(url)
    run = client.get_run()
    flat = np.empty(run.num_params, dtype=np.float32)
    client.download_params(flat)
    model = build_model(run.model)
    for spec, p in zip(run.layout, model.parameters()):
        p.data.copy_(torch.from_numpy(flat[spec.offset:spec.offset + p.numel()]).view_as(p))
    batches = demo_batches(16, run.model.kwargs["seq_len"], seed=EVAL_SEED)
    with torch.no_grad():
        return sum(float(loss_of(model, next(batches))) for _ in range(EVAL_BATCHES)) / EVAL_BATCHES


def run_variant(name: str, overrides: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        config = write_run(Path(tmp) / "run.toml", overrides)
        ready = Path(tmp) / "ready"
        relay = subprocess.Popen([sys.executable, "-m", "relay_server.cli", "serve", "--config", str(config),
                                  "--port", "0", "--data-dir", str(Path(tmp) / "data"), "--ready-file", str(ready)],
                                 stdout=open(Path(tmp) / "relay.log", "w"), stderr=subprocess.STDOUT, cwd=REPO)
        try:
            while not ready.exists() or not ready.read_text():
                if relay.poll() is not None:
                    sys.exit(f"{name}: the relay exited:\n{(Path(tmp) / 'relay.log').read_text()[-3000:]}")
                time.sleep(0.1)
            url = ready.read_text().strip()
            started = time.monotonic()
            peers = [subprocess.Popen([sys.executable, __file__, "--peer", "--relay", url, "--seed", str(i),
                                       "--batch", str(args.batch), "--steps", str(args.steps)],
                                      stdout=subprocess.PIPE, text=True, cwd=REPO) for i in range(args.peers)]
            results = []
            for peer in peers:
                out, _ = peer.communicate()
                if peer.returncode != 0:
                    sys.exit(f"{name}: a peer failed (exit {peer.returncode})")
                results.append(json.loads(out.strip().splitlines()[-1]))
            elapsed = time.monotonic() - started
            loss = evaluate(url)
        finally:
            relay.terminate()
            relay.wait(timeout=30)
    samples = sum(r["samples"] for r in results)
    return {"variant": name, "up_bytes_per_sample": sum(r["up"] for r in results) / samples,
            "down_bytes_per_sample": sum(r["down"] for r in results) / samples,
            "final_loss": loss, "samples_per_s": samples / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100, help="micro-batches per peer (the same in every variant)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--h", default="10,50", help="inner steps per outer round, comma-separated")
    parser.add_argument("--sync-compression", default="int8", choices=("none", "float16", "int8"))
    parser.add_argument("--inner-lr", type=float, default=0.003)
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--relay", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        run_peer(args)
        return
    common = {"rounds": {"peer_ttl_s": 30.0, "deadline_floor_s": 30.0, "deadline_initial_s": 60.0}}
    sync = run_variant("sync", {**common, "run": {"target_batch": args.peers * args.batch, "max_staleness": 0,
                                                  "compression": args.sync_compression}}, args)
    print(json.dumps(sync), flush=True)
    best: dict[str, Any] | None = None
    for h in (int(x) for x in args.h.split(",")):
        variant = run_variant(f"local_sgd H={h}", {
            **common, "run": {"mode": "local_sgd", "target_batch": 10**9, "max_staleness": 0, "compression": "none"},
            "optimizer": {"lr": args.inner_lr, "clip_grad_norm": 1.0},
            "local_sgd": {"inner_steps": h, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}}, args)
        print(json.dumps(variant), flush=True)
        total = variant["up_bytes_per_sample"] + variant["down_bytes_per_sample"]
        if best is None or total < best["up_bytes_per_sample"] + best["down_bytes_per_sample"]:
            best = variant
    assert best is not None
    sync_total = sync["up_bytes_per_sample"] + sync["down_bytes_per_sample"]
    best_total = best["up_bytes_per_sample"] + best["down_bytes_per_sample"]
    print(json.dumps({"best": best["variant"], "bytes_ratio": sync_total / best_total,
                      "loss_gap": (best["final_loss"] - sync["final_loss"]) / sync["final_loss"],
                      "shaped_speedup": None, "busy_fraction": None, "down_bits_per_param": None}))


if __name__ == "__main__":
    main()
