"""Compressed pipeline boundaries on shaped links: float16 against ``lowrank-<r>``, side by side in one run,
judged by the loss reached after N samples and the time to reach float16's loss, not bytes alone.

    sudo python benchmarks/pipeline_compression.py                        # ~5 minutes on 2 shared cores
    sudo python benchmarks/pipeline_compression.py --relay-mbit 20        # where the link binds
    python benchmarks/pipeline_compression.py --no-shape                  # loopback (no root)

Processes per codec: one ``relay-server serve`` with ``[pipeline] boundary_codec`` set (a GPT-2 of
``--layers`` blocks, ``--width`` wide, cut into 2 stages) and ``--workers-per-stage`` x 2 stage
workers (the toolkit's real :class:`~toolkit.pipeline.worker.StageWorker`, started by this file's
``--worker`` mode, training on byte windows of the shipped text, ``toolkit/assets/demo_corpus.txt``).
Every process runs in its own network namespace (``relay_server/harness/netns.py``): the relay's link
at ``--relay-mbit`` (200) each way, every worker's at ``--worker-mbit`` (1000). Everything the
boundaries cost crosses the relay's link twice (a stage's output in, the next stage's input out,
and the same for its gradient), so that link is where compression can buy time.

Both codecs train the same model from the same seed on the same data for ``--batches`` batches
(N samples = batches x batch). Reported per codec:

* ``boundary_bytes_per_sample``: the relay's own figure (every boundary byte it stored, in and out,
  over the samples trained), and ``codec_bytes_per_matrix``: one micro-batch's activation as the codec
  carries it;
* ``loss_at_n``: the mean training loss of the last ``--window`` batches (the relay's rounds), and
  ``eval_loss``: the last parameters (``eval_step``: the workers finish the batch in flight, so
  N or a batch or two more) on held-out text windows -- for lowrank the model with the
  codec's round trip at the cut (:func:`toolkit.pipeline.boundary_codec.through_cuts`), the model
  the pipeline actually trained;
* ``time_to_target_s``: seconds from the first batch's first task until the windowed training loss
  first reached ``target_loss``, float16's ``loss_at_n`` within the loss bar (x 1.02), for both
  codecs (null: never within the run); ``time_to_exact_loss_s`` the same for float16's own loss.

Last line: one JSON object with both codecs' figures and ``bytes_vs_float16`` (float16's bytes per
sample over the codec's), ``loss_vs_float16`` (the codec's ``loss_at_n`` over float16's),
``time_vs_float16`` (its time to target over float16's), ``seconds_per_batch_vs_float16``, and the
bars (>= 8x, <= 1.02, <= 0.6).

What binds where (docs/benchmarks.md): with the defaults a batch's float16 boundaries are 4.3 MB
through the relay, 0.17 s at 200 Mbit/s of a 1.3 s batch on this 2-core machine; the rest is each
task's compute and HTTP overhead, so the time ratio stays near 1 whatever the codec saves.
``--relay-mbit 20`` shows the link-bound regime a GPU stage (compute 10-100x faster) meets at
200 Mbit/s; there the round's own traffic (stage gradients up, parameters down, float32) is the
floor, which ``--round-compression int8`` (``run.compression`` of both runs) lowers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import requests  # noqa: E402

from relay_server.harness.netns import Host, Star, unavailable  # noqa: E402
from relay_server.harness.process import RelayProcess, stop_process, toml_text  # noqa: E402

BARS = {"bytes_vs_float16": 8.0, "loss_vs_float16": 1.02, "time_vs_float16": 0.6}
EVAL_SEED, EVAL_BATCHES = 10_000, 8


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model_type": "gpt2",
        "vocab_size": 256,
        "n_positions": args.seq_len,
        "n_embd": args.width,
        "n_inner": args.width,  # a narrow MLP: boundaries large against a block's compute
        "n_layer": args.layers,
        "n_head": 4,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "tie_word_embeddings": False,
    }


def relay_config(args: argparse.Namespace, codec: str, host: str) -> dict[str, dict[str, Any]]:
    return {
        "run": {
            "name": "pipeline-compression",
            "target_batch": args.microbatch_size * args.microbatches,
            "total_steps": 0,
            "max_staleness": 0,
            "seed": 0,
            "compression": args.round_compression,
        },
        "model": {"kind": "transformers", "architecture": "AutoModelForCausalLM", "config": model_config(args)},
        "optimizer": {
            "name": "adam",
            "lr": args.lr,
            "weight_decay": 0.0,
            "clip_grad_norm": 1.0,
            "schedule": "constant",
        },
        "rounds": {"heartbeat_interval_s": 1.0, "peer_ttl_s": 120.0},
        "server": {"host": host, "keep_checkpoints": 2},
        "auth": {"mode": "open"},
        "pipeline": {
            "enabled": True,
            "stages": 2,
            "microbatch_size": args.microbatch_size,
            "microbatches_per_batch": args.microbatches,
            "boundary_codec": codec,
            "boundary_memory_mb": 1024,
        },
    }


# --- the worker (``--worker``): the toolkit's StageWorker on the shipped text -------------------------
def text_batches(microbatch_size: int, seq_len: int, seed: int):
    from toolkit.corpus import demo_batches

    for window in demo_batches(microbatch_size, seq_len - 1, seed):
        yield {"input_ids": window, "labels": window.clone()}


def run_worker(args: argparse.Namespace) -> None:
    import torch

    from toolkit.client import RelayClient
    from toolkit.pipeline.worker import StageWorker
    from toolkit.run_membership import Membership
    from toolkit.wire.protocol import PROTOCOL_VERSION, JoinRequest

    torch.set_num_threads(1)
    client = RelayClient(args.relay)
    run = client.get_run()
    membership = Membership(
        client, JoinRequest(peer_name=args.name, protocol=PROTOCOL_VERSION, device={}), what="stage worker"
    )
    membership.join()
    worker = StageWorker(
        membership, run, text_batches(int(run.pipeline["microbatch_size"]), run.model.config["n_positions"], args.seed)
    )
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    worker.run(wait_s=1)
    membership.leave()


# --- one codec's run ---------------------------------------------------------------------------------
def run_codec(codec: str, args: argparse.Namespace, hosts: list[Host | None], folder: Path) -> dict[str, Any]:
    folder.mkdir(parents=True)
    relay_host, worker_hosts = hosts[0], hosts[1:]
    address = relay_host.address if relay_host else "127.0.0.1"
    config = folder / "relay.toml"
    config.write_text(toml_text(relay_config(args, codec, address)))
    relay = RelayProcess(
        config,
        folder / "data",
        folder / "relay.log",
        wrap=(lambda argv: relay_host.command([*argv, "--host", address])) if relay_host else None,
    ).start(timeout_s=300)
    url = f"http://{address}:{relay.port}"
    procs: list[subprocess.Popen] = []
    want = args.batches
    try:
        for i, host in enumerate(worker_hosts):
            argv = [sys.executable, __file__, "--worker", "--relay", url, "--name", f"w{i}", "--seed", str(i)]
            procs.append(
                subprocess.Popen(
                    host.command(argv) if host else argv,
                    cwd=REPO,
                    stdout=open(folder / f"w{i}.log", "w"),
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                )
            )
        deadline = time.monotonic() + args.run_limit_s
        step = 0
        while time.monotonic() < deadline and step < want:
            if relay.proc.poll() is not None:
                raise RuntimeError(f"the relay exited:\n{(folder / 'relay.log').read_text()[-3000:]}")
            dead = [i for i, p in enumerate(procs) if p.poll() is not None]
            if dead:
                raise RuntimeError(f"worker w{dead[0]} exited:\n{(folder / f'w{dead[0]}.log').read_text()[-3000:]}")
            time.sleep(2)
            now = requests.get(url + "/api/status", timeout=30).json()["step"]
            if now != step:
                print(f"  {codec}: step {now}/{want}", flush=True)
            step = now
        for p in procs:  # first: the version evaluated is the last one, not one a worker is still making
            stop_process(p, 20)
        status = requests.get(url + "/api/status", timeout=30).json()
        pipe = requests.get(url + "/api/pipeline", timeout=30).json()
        final = final_params(url, min(step, want))
    finally:
        for p in procs:
            stop_process(p, 20)
        relay.stop()
    rounds = sorted((r for r in status["recent_rounds"] if r["finalized_by"] == "pipeline"), key=lambda r: r["step"])
    rounds = [r for r in rounds if r["step"] <= want]
    t0 = rounds[0]["finalized_at"] - rounds[0]["duration_s"] if rounds else 0.0
    curve = [(r["finalized_at"] - t0, r["loss"]) for r in rounds if r["loss"] is not None]
    return {
        "codec": codec,
        "batches": len(rounds),
        "completed": len(rounds) >= want,
        "samples": len(rounds) * args.microbatch_size * args.microbatches,
        "wall_s": round(curve[-1][0], 1) if curve else None,
        "seconds_per_batch": round(curve[-1][0] / len(curve), 2) if curve else None,
        "boundary_bytes_per_sample": pipe.get("boundary_bytes_per_sample"),
        "codec_bytes_per_matrix": matrix_bytes(codec, args),
        "curve": [[round(t, 1), round(loss, 4)] for t, loss in curve],
        "loss_at_n": windowed(curve, args.window)[-1][1] if curve else None,
        "eval_loss": evaluate(final, codec, args),
        "eval_step": status["step"],
    }


def matrix_bytes(codec: str, args: argparse.Namespace) -> int:
    from toolkit.wire.compression import LowRankCodec, boundary_codec

    c = boundary_codec(codec)
    rows = args.microbatch_size * args.seq_len
    if isinstance(c, LowRankCodec):
        return c.matrix_bytes(rows, args.width)
    return c.wire_bytes(rows * args.width)


def windowed(curve: list[tuple[float, float]], window: int) -> list[tuple[float, float]]:
    """Each batch's time and the mean loss of the last ``window`` batches up to it."""
    return [
        (t, sum(loss for _, loss in curve[max(0, i + 1 - window) : i + 1]) / min(window, i + 1))
        for i, (t, _) in enumerate(curve)
    ]


def time_to(curve: list[tuple[float, float]], target: float, window: int) -> float | None:
    return next((round(t, 1) for t, loss in windowed(curve, window)[window - 1 :] if loss <= target), None)


def final_params(url: str, step: int):
    import numpy as np

    from toolkit.client import RelayClient

    client = RelayClient(url)
    try:
        out = np.empty(client.get_run().num_params, dtype=np.float32)
        client.params.download_params(out, min_step=step, wait_s=60)
    finally:
        client.close()
    return out


def evaluate(flat, codec: str, args: argparse.Namespace) -> float:
    """Mean loss on held-out windows of the text; with a lossy codec through its cut (what was trained)."""
    import contextlib

    import torch

    from toolkit.corpus import demo_batches
    from toolkit.models import build_model, loss_of
    from toolkit.models.flat import load_flat
    from toolkit.pipeline.boundary_codec import through_cuts
    from toolkit.wire.compression import boundary_codec
    from toolkit.wire.protocol import ModelSpec

    spec = ModelSpec(kind="transformers", architecture="AutoModelForCausalLM", config=model_config(args))
    model = build_model(spec)
    load_flat(model, flat)
    model.eval()
    layers = [args.layers // 2, args.layers - args.layers // 2]
    lossy = codec not in ("none", "float16")
    data = demo_batches(args.microbatch_size, args.seq_len - 1, EVAL_SEED)
    losses = []
    with torch.no_grad(), through_cuts(model, layers, boundary_codec(codec)) if lossy else contextlib.nullcontext():
        for _ in range(EVAL_BATCHES):
            window = next(data)
            losses.append(float(loss_of(model, {"input_ids": window, "labels": window.clone()})))
    return round(sum(losses) / len(losses), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--relay", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--codec", default="lowrank-32", help="the compressor against float16 (default lowrank-32)")
    parser.add_argument("--batches", type=int, default=40, help="batches per codec (N = batches x batch samples)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--microbatch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--workers-per-stage", type=int, default=1)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--window", type=int, default=5, help="batches the training loss is averaged over")
    parser.add_argument("--relay-mbit", type=float, default=200.0)
    parser.add_argument("--worker-mbit", type=float, default=1000.0)
    parser.add_argument(
        "--round-compression",
        default="none",
        help="run.compression of both runs: the stage gradients up and the parameters down each round",
    )
    parser.add_argument("--no-shape", action="store_true", help="loopback, no namespaces")
    parser.add_argument("--run-limit-s", type=float, default=1800.0)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # tear the namespaces and processes down
    n_workers = 2 * args.workers_per_stage
    reason = "--no-shape" if args.no_shape else unavailable()
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="pipeline-compression-") as tmp:
        if reason:
            hosts: list[Host | None] = [None] * (1 + n_workers)
        else:
            star = Star(subnet=f"10.77.{random.randrange(1, 250)}")
            hosts = [star.add("relay", args.relay_mbit)]
            hosts += [star.add(f"worker{i}", args.worker_mbit) for i in range(n_workers)]
            stack.enter_context(star)
        results = {}
        for codec in ("float16", args.codec):
            print(f"{codec}: {args.batches} batches of {args.microbatch_size * args.microbatches} samples", flush=True)
            results[codec] = run_codec(codec, args, hosts, Path(tmp) / codec)
            r = results[codec]
            print(
                f"{codec}: {r['boundary_bytes_per_sample']} boundary bytes/sample, loss at N {r['loss_at_n']}, "
                f"eval {r['eval_loss']}, {r['wall_s']} s ({r['seconds_per_batch']} s/batch)",
                flush=True,
            )
    base, ours = results["float16"], results[args.codec]
    target = base["loss_at_n"] * BARS["loss_vs_float16"]  # float16's loss at N, within the loss bar
    for r in results.values():
        curve = [(t, loss) for t, loss in r["curve"]]
        r["time_to_target_s"] = time_to(curve, target, args.window)
        r["time_to_exact_loss_s"] = time_to(curve, base["loss_at_n"], args.window)
    ratio = (
        round(ours["time_to_target_s"] / base["time_to_target_s"], 3)
        if ours["time_to_target_s"] is not None and base["time_to_target_s"]
        else None
    )
    out = {
        "codec": args.codec,
        "shaped": None if reason else {"relay_mbit": args.relay_mbit, "worker_mbit": args.worker_mbit},
        "not_shaped_because": reason,
        "model": {"width": args.width, "layers": args.layers, "seq_len": args.seq_len, "vocab": 256},
        "batch": args.microbatch_size * args.microbatches,
        "round_compression": args.round_compression,
        "n_samples": args.batches * args.microbatch_size * args.microbatches,
        "bytes_vs_float16": round(base["boundary_bytes_per_sample"] / ours["boundary_bytes_per_sample"], 2),
        "codec_bytes_vs_float16": round(base["codec_bytes_per_matrix"] / ours["codec_bytes_per_matrix"], 2),
        "loss_vs_float16": round(ours["loss_at_n"] / base["loss_at_n"], 4),
        "eval_loss_vs_float16": round(ours["eval_loss"] / base["eval_loss"], 4),
        "target_loss": round(target, 4),
        "time_vs_float16": ratio,
        "seconds_per_batch_vs_float16": round(ours["seconds_per_batch"] / base["seconds_per_batch"], 3),
        "bars": BARS,
        "met": {
            "bytes": base["boundary_bytes_per_sample"] / ours["boundary_bytes_per_sample"] >= BARS["bytes_vs_float16"],
            "loss": ours["loss_at_n"] / base["loss_at_n"] <= BARS["loss_vs_float16"],
            "time": ratio is not None and ratio <= BARS["time_vs_float16"],
        },
        "runs": {k: {key: v for key, v in r.items() if key != "curve"} for k, r in results.items()},
        "curves": {k: r["curve"] for k, r in results.items()},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
