"""Peak memory of a peer and of the relay, for the demo model and a ~100M-parameter one.

    python benchmarks/memory.py --steps 4 --batch 2 --target-batch 4   # the reported run (~13 min here)
    python benchmarks/memory.py --models small --steps 3 # a quick look

Each case runs a real relay process and a real peer process on 127.0.0.1: the peer trains with
CollaborativeOptimizer (random byte batches, one thread) until the relay has taken ``--steps``
optimizer steps. Peak memory is each process's RSS high-water mark (``VmHWM`` in
/proc/<pid>/status, what ``getrusage`` reports as ``ru_maxrss``), minus the same process's RSS
once its imports were done (python + torch + aiohttp: the runtime, not the model). The mark is
reset once startup is over (``reset_peak``), so "startup" (build the model, join, first download;
the relay: initial parameters, master, version 0 written) and "train" peaks are apart. The peer also
itemizes what it holds (tensors of P elements it owns, bytes autograd saved for backward in one
micro-batch); the relay the bytes of its optimizer state and its step time. With CUDA, the
peer also reports ``torch.cuda.max_memory_allocated`` (the allocator's view of the accelerator).

``--bits 8`` runs the relay with 8-bit AdamW state (:mod:`relay_server.rounds.optim8bit`, bitsandbytes
on CPU): through ``optimizer.state_bits = 8`` once config/master support it, else by swapping
``relay_server.rounds.master._make_optimizer`` in the relay process this script starts.
``--local-sgd`` runs ``run.mode = "local_sgd"`` (2 inner steps per outer round) instead: AdamW then
runs on the peer, and ``--bits`` sets *its* moments (:mod:`toolkit.optimizer.inner`); the relay
holds the outer SGD's momentum. The peer reports its inner optimizer's state bytes.

What a peer holds per parameter (bytes), and where:
  training device: parameters 4, gradients 4, accumulator (sum of gradient x samples) 4;
                   plus activations, proportional to batch x seq_len, not to P
  host:            the downloaded public parameters 4; a copy of the accumulator while a
                   round uploads it 4; with a lossy codec, the error-feedback residual 4
  optimizer state: none -- the backbone holds it (DESIGN.md s3), so "optimizer state off the
                   accelerator" is built in: a volunteer GPU never carries AdamW's 8 B/param.
What the relay holds per parameter: master parameters 4, averaged-gradient buffer 4, AdamW
moments 8 (2.03 with 8-bit state); with a lossy codec also the public copy peers hold 4.
Published versions are served from the state files with sendfile (page cache, not RSS).

Output: a table, then one JSON line ``{"cases": [...]}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout, uninstalled

MODELS: dict[str, dict[str, int]] = {
    # relay_server/defaults/demo.toml
    "small": {"seq_len": 64, "d_model": 256, "n_layer": 4, "n_head": 4, "d_ff": 1024},
    # GPT-2-small widths; 14 layers because the byte vocabulary (256) has no 38.6M-parameter
    # embedding: 12 layers would be 85.5M, 14 are 99.6M.
    "100m": {"seq_len": 256, "d_model": 768, "n_layer": 14, "n_head": 12, "d_ff": 3072},
}
MB = 1 << 20


def reset_peak(pid: int | str = "self") -> None:
    """Start a new RSS high-water mark (Linux >= 4.0: write 5 to clear_refs), so a process's
    training peak is measured apart from its startup peak."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS / VmHWM (bytes) of a process, from /proc (Linux)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


# --- the peer process ------------------------------------------------------------------------------
def peer_main(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from toolkit.client import RelayClient
    from toolkit.models import build_model
    from toolkit.optimizer import CollaborativeOptimizer

    torch.set_num_threads(args.threads)
    runtime = proc_status()["VmRSS"]
    client = RelayClient(args.relay, read_timeout_s=600)
    run = client.get_run()
    model = build_model(run.model)
    P = sum(p.numel() for p in model.parameters())
    opt = CollaborativeOptimizer(
        model, client=client, batch_size_per_step=args.batch, peer_name="memory", round_wait_s=600
    )
    startup = proc_status()  # model built, joined, first parameters downloaded
    reset_peak()
    seq_len = int(run.model.kwargs.get("seq_len", 64))
    gen = torch.Generator().manual_seed(0)
    activations = 0
    step_s: list[float] = []
    grads = 0
    while opt.version < args.steps and not opt.finished:
        batch = torch.randint(0, 256, (args.batch, seq_len + 1), generator=gen)
        opt.zero_grad()
        if not activations:  # one extra forward, outside the timing
            activations = _saved_for_backward(model, batch)
        started = time.perf_counter()
        loss = model.loss(batch)
        loss.backward()
        grads = max(
            grads, sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
        )
        step_s.append(time.perf_counter() - started)
        opt.step(loss=loss.item())
        del loss
    held = {}
    for name, value in vars(opt).items():  # what the optimizer owns at P scale, by attribute name
        if isinstance(value, np.ndarray) and value.size >= P // 2:
            held[name] = value.nbytes
        elif torch.is_tensor(value) and value.numel() >= P // 2:
            held[name] = value.numel() * value.element_size()
    feedback = getattr(opt, "_feedback", None)
    if feedback is not None:
        held["_feedback.residual"] = feedback.residual.nbytes
    report = {
        "params": P,
        "runtime_rss": runtime,
        "startup_hwm": startup["VmHWM"],
        **proc_status(),
        "param_bytes": 4 * P,
        "grad_bytes": grads,
        "optimizer_buffers": held,
        "activations_saved": activations,
        "batch": args.batch,
        "seq_len": seq_len,
        "fwd_bwd_s": sorted(step_s)[len(step_s) // 2] if step_s else None,
        "version": opt.version,
    }
    if opt.local_sgd is not None:
        from relay_server.rounds.optim8bit import state_nbytes

        report["inner_state_bytes"] = state_nbytes(opt.local_sgd.optimizer)
    if torch.cuda.is_available():
        report["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    opt.close()
    Path(args.out).write_text(json.dumps(report))
    return 0


def _saved_for_backward(model: Any, batch: Any) -> int:
    """Bytes autograd keeps for backward in one forward of ``batch`` (parameters excluded: they
    are counted as parameters), measured in a forward whose graph is then dropped."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.loss(batch)
    return sum(storages.values())


# --- the relay process -----------------------------------------------------------------------------
def relay_main(args: argparse.Namespace) -> int:
    from relay_server.api.server import serve
    from relay_server.core.config import OptimizerSection, load_config
    from relay_server.rounds import master

    runtime = proc_status()["VmRSS"]
    bnb_import = 0
    if args.state_bits == 8:  # bitsandbytes' own libraries: a fixed cost of the option, reported apart
        from relay_server.rounds.optim8bit import bitsandbytes_cpu

        bitsandbytes_cpu()
        bnb_import, runtime = proc_status()["VmRSS"] - runtime, proc_status()["VmRSS"]
    config = load_config(args.config, overrides={"server": {"port": args.port, "data_dir": args.data_dir}})
    if args.state_bits == 8:
        if "state_bits" in OptimizerSection.__dataclass_fields__:
            config.optimizer.state_bits = 8  # type: ignore[attr-defined]
        else:
            from relay_server.rounds import optim8bit

            master._make_optimizer = optim8bit.make_adamw8bit  # the proposed 2-line switch
    apply = master.MasterState.apply_gradient
    timings = open(args.timings, "a", buffering=1)

    def timed(self: Any) -> Any:
        from relay_server.rounds.optim8bit import state_nbytes

        started = time.perf_counter()
        report = apply(self)
        timings.write(
            json.dumps({"step_s": time.perf_counter() - started, "state_bytes": state_nbytes(self.optimizer)}) + "\n"
        )
        return report

    master.MasterState.apply_gradient = timed
    timings.write(json.dumps({"runtime_rss": runtime, "bnb_import": bnb_import}) + "\n")
    asyncio.run(serve(config, ready_file=args.ready_file))
    return 0


# --- one case ----------------------------------------------------------------------------------------
def run_case(model: str, bits: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    case = workdir / f"{model}-{bits}"
    case.mkdir()
    kwargs = MODELS[model]
    local = ['mode = "local_sgd"'] if args.local_sgd else []
    (case / "run.toml").write_text(
        "\n".join(
            [
                "[run]",
                'name = "memory"',
                f"target_batch = {args.target_batch}",
                "max_staleness = 0",
                *local,
                "[model]",
                'factory = "toolkit.models:ByteTransformer"',
                "kwargs = { " + ", ".join(f"{k} = {v}" for k, v in kwargs.items()) + " }",
                "[optimizer]",
                'name = "adamw"',
                "lr = 0.0003",
                "weight_decay = 0.01",
                *([f"state_bits = {bits}", "[local_sgd]", "inner_steps = 2"] if args.local_sgd else []),
                "[rounds]",
                "deadline_initial_s = 600.0",
                "deadline_ceiling_s = 600.0",
                "peer_ttl_s = 600.0",
                "[server]",
                "keep_checkpoints = 2",
                "[auth]",
                'mode = "open"',
                "",
            ]
        )
    )
    ready, timings = case / "ready", case / "timings.jsonl"  # the relay binds port 0 and writes its URL there
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    me = [sys.executable, str(Path(__file__).resolve())]
    relay = subprocess.Popen(
        me
        + [
            "_relay",
            "--config",
            str(case / "run.toml"),
            "--port",
            "0",
            "--data-dir",
            str(case / "data"),
            "--ready-file",
            str(ready),
            "--timings",
            str(timings),
            "--state-bits",
            str(32 if args.local_sgd else bits),
        ],
        stdout=open(case / "relay.log", "w"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    peer = None
    try:
        while not ready.exists():
            if relay.poll() is not None:
                raise RuntimeError(f"relay exited:\n{(case / 'relay.log').read_text()[-2000:]}")
            time.sleep(0.1)
        startup = proc_status(relay.pid)  # model built, master + optimizer objects, version 0 written
        reset_peak(relay.pid)
        peer = subprocess.Popen(
            me
            + [
                "_peer",
                "--relay",
                ready.read_text().strip(),
                "--steps",
                str(args.steps),
                "--batch",
                str(args.batch),
                "--threads",
                str(args.threads),
                "--out",
                str(case / "peer.json"),
            ],
            stdout=open(case / "peer.log", "w"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        if peer.wait(timeout=args.timeout) != 0:
            raise RuntimeError(f"peer failed:\n{(case / 'peer.log').read_text()[-3000:]}")
        relay_status = proc_status(relay.pid)
    finally:
        for proc in (peer, relay):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    lines = [json.loads(line) for line in timings.read_text().splitlines()]
    steps = [x for x in lines if "step_s" in x]
    return {
        "model": model,
        "state_bits": bits,
        "peer": json.loads((case / "peer.json").read_text()),
        "relay": {
            "runtime_rss": lines[0]["runtime_rss"],
            "bnb_import": lines[0]["bnb_import"],
            "startup_hwm": startup["VmHWM"],
            "started_rss": startup["VmRSS"],
            **relay_status,
            "state_bytes": steps[-1]["state_bytes"] if steps else None,
            "step_s": sorted(x["step_s"] for x in steps)[len(steps) // 2] if steps else None,
        },
    }


def print_table(cases: list[dict[str, Any]]) -> None:
    """MB; "train" = the high-water mark while training (reset after startup); B/param = (train
    peak - the process's RSS after its imports) / P."""
    print(
        f"{'model':>6} {'params':>7} {'relay':>5} | {'peer startup':>12} {'train':>6} {'B/param':>7} {'acts':>5} | "
        f"{'relay startup':>13} {'train':>6} {'B/param':>7} {'opt state':>9} {'step s':>6}"
    )
    for c in cases:
        p, r, n = c["peer"], c["relay"], c["peer"]["params"]
        print(
            f"{c['model']:>6} {n / 1e6:>6.1f}M {c['state_bits']:>4}b | {p['startup_hwm'] / MB:>12.0f} "
            f"{p['VmHWM'] / MB:>6.0f} {(p['VmHWM'] - p['runtime_rss']) / n:>7.1f} {p['activations_saved'] / MB:>5.0f} | "
            f"{r['startup_hwm'] / MB:>13.0f} {r['VmHWM'] / MB:>6.0f} {(r['VmHWM'] - r['runtime_rss']) / n:>7.1f} "
            f"{(r['state_bytes'] or 0) / MB:>9.0f} {r['step_s'] or 0:>6.2f}"
        )
    for c in cases:
        p, r = c["peer"], c["relay"]
        print(
            f"{c['model']} {c['state_bits']}-bit: runtime (after imports) peer {p['runtime_rss'] / MB:.0f} MB, relay "
            f"{r['runtime_rss'] / MB:.0f} MB (bitsandbytes import {r['bnb_import'] / MB:.0f} MB); peer tensors: "
            + ", ".join(f"{k} {v / MB:.0f}" for k, v in p["optimizer_buffers"].items())
            + f", params {p['param_bytes'] / MB:.0f}, grads {p['grad_bytes'] / MB:.0f} MB"
            + (
                f"; inner optimizer state {p['inner_state_bytes'] / MB:.0f} MB "
                f"({p['inner_state_bytes'] / p['params']:.2f} B/param)"
                if "inner_state_bytes" in p
                else ""
            )
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="role")
    peer = sub.add_parser("_peer")
    peer.add_argument("--relay", required=True)
    peer.add_argument("--steps", type=int, required=True)
    peer.add_argument("--batch", type=int, required=True)
    peer.add_argument("--threads", type=int, default=1)
    peer.add_argument("--out", required=True)
    relay = sub.add_parser("_relay")
    for flag in ("--config", "--data-dir", "--ready-file", "--timings"):
        relay.add_argument(flag, required=True)
    relay.add_argument("--port", type=int, required=True)
    relay.add_argument("--state-bits", type=int, choices=(8, 32), default=32)
    parser.add_argument("--models", default="small,100m", help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument(
        "--bits",
        default="32,8",
        help="relay optimizer state bits to run: 32, 8 or both (with --local-sgd: the peer's inner optimizer)",
    )
    parser.add_argument("--local-sgd", action="store_true", help='run.mode = "local_sgd": AdamW on the peer')
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per case")
    parser.add_argument("--batch", type=int, default=4, help="peer micro-batch (sequences)")
    parser.add_argument("--target-batch", type=int, default=8, help="samples per optimizer step")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    if args.role == "_peer":
        return peer_main(args)
    if args.role == "_relay":
        return relay_main(args)
    cases = []
    with tempfile.TemporaryDirectory(prefix="collab-memory-") as tmp:
        for model in args.models.split(","):
            for bits in (int(b) for b in args.bits.split(",")):
                cases.append(run_case(model, bits, args, Path(tmp)))
                print(f"done: {model} {bits}-bit", file=sys.stderr)
    print_table(cases)
    print(json.dumps({"cases": cases}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
