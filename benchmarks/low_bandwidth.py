"""Low-bandwidth mode (issue 26): bytes per sample, final loss and samples/s on volunteers' links,
sync mode vs local SGD, with real relays and peers.

    python benchmarks/low_bandwidth.py                                   # the reported run (~40 min)
    python benchmarks/low_bandwidth.py --models demo --no-shape --steps 4 --peers 2 --h 2   # smallest
    python benchmarks/low_bandwidth.py --sparse topk2-64                 # the sparse row (default on)

**Models.** ``demo``: the byte-level transformer of ``relay_server/defaults/demo.toml`` (3.2M
parameters). ``gpt2``: a transformers config (``AutoModelForCausalLM``, GPT-2, 256 wide, 4 layers,
the 256 byte values as its vocabulary; built from the config, nothing downloaded), 3.2M parameters:
either is large enough that parameter bytes, not heartbeats or JSON, make up a volunteer's traffic.

**Variants**, each one relay process and ``--peers`` peer processes, every peer ``--steps``
micro-batches of ``--batch`` samples (so every variant processes the same samples):

* ``sync``: ``run.compression = "int8"`` (``--sync-compression``), the relay's AdamW, a round as
  soon as ``peers * batch`` samples arrived (peers keep computing while a round is in flight, so a
  round often holds two micro-batches of each: the lines say how many rounds there were);
* ``local_sgd H=<h>`` for each ``--h``: ``run.mode = "local_sgd"``, the same AdamW as the inner
  optimizer on every peer, DiLoCo's outer SGD (lr 0.7, Nesterov momentum 0.9), float32 both ways;
* ``local_sgd+<codec>[/<down>] H=<h>`` (``--sparse``, H = the largest ``--h``), one per
  ``--sparse-down``: ``run.compression = <codec>`` (``topk2-64``: the top 64 of each 4096-value
  chunk, 2-bit values, error feedback on the peer) with the relay broadcasting deltas in the same
  code or in ``run.download_compression = <down>`` (``topk2-256``: the mean of sparse uploads is
  denser than one of them), SparseLoCo's outer step (lr 1.0, no momentum) and
  ``run.download_feedback = --download-feedback`` (0.5: the master keeps half the broadcast's
  residual per round). A relay that refuses a configuration gives a line ``{"variant", "refused": <the relay's sentence>}`` and the
  benchmark goes on without it. ``--no-dense`` skips the float32 variants, ``--overlap`` sets
  ``local_sgd.overlap`` in every local SGD variant.

**What is measured.** Each peer counts the bytes its sockets send and receive (every request:
joins, heartbeats, uploads, downloads): what a volunteer's link carries, both ways. Bytes per
sample are counted from the moment every peer has joined (a barrier) to the end: a join's full
download is the same in every mode and paid once per session, not per sample, so it is reported
apart (``join_down_bytes``) and ``bytes_ratio_with_join`` says what it would change on a run this
short. samples/s is the collaboration's, from the barrier to the last peer's last step.
``busy_fraction`` is the peers' mean ``opt.local_sgd.busy_fraction`` (time not spent waiting in
outer rounds). ``down_bits_per_param`` is the relay's broadcast per outer round: download bytes
per peer per outer round (after the join) * 8 / parameters. The final global parameters are
evaluated on fixed batches of the corpus drawn with a seed no peer uses: ``final_loss`` is the
master's (the run's model: what a checkpoint exports), ``public_loss`` the copy peers hold.

**Shaped links** (``relay_server/harness/netns.py``; root and iproute2): the relay and every peer are
processes in network namespaces of their own; peers upload at ``--peer-up`` (10) and download at
``--peer-down`` (50) Mbit/s, the relay at ``--relay-mbit`` (200) both ways. ``shaped_speedup`` =
the best local SGD variant's samples/s / sync's, both on those links. ``--no-shape`` (or a machine
without namespaces) runs everything on 127.0.0.1: bytes and losses are the same, ``shaped_speedup``
is null and ``shaped`` says why.

Output: one JSON line per variant, one summary line per model, and last one JSON object:
``bytes_ratio`` (sync bytes per sample up + down / the best local SGD variant's), ``loss_gap``
(that variant's relative final-loss difference from sync), ``shaped_speedup``, ``busy_fraction``,
``down_bits_per_param`` (of the variant with the fewest), each the worst over ``--models`` (the
per-model values are under ``models``), and ``bars``: the issue's bars and whether each is met.

``--repeat R`` draws the same comparison again: initial parameters from ``run.seed = R``, peer
i's data from seed ``100 R + i``, the same held-out batches (R < 100).

Internal: ``--peer`` runs one peer (the benchmark starts it).
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from low_bandwidth_figures import bars, summarize_model, summarize_variant, worst  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from relay_server.harness.netns import Host, Star, unavailable  # noqa: E402
from relay_server.harness.process import ServerFailed, ServerProcess, toml_text  # noqa: E402

EVAL_SEED, EVAL_BATCHES = 10_000, 4
GPT2_BYTES = {
    "model_type": "gpt2",
    "vocab_size": 256,
    "n_positions": 64,
    "n_embd": 256,
    "n_layer": 4,
    "n_head": 4,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}
MODELS: dict[str, dict[str, Any]] = {
    "demo": {
        "factory": "toolkit.models:ByteTransformer",
        "kwargs": {"seq_len": 64, "d_model": 256, "n_layer": 4, "n_head": 4, "d_ff": 1024},
    },
    "gpt2": {"kind": "transformers", "architecture": "AutoModelForCausalLM", "config": GPT2_BYTES},
}
SEQ_LEN = 64
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


# --- one peer ------------------------------------------------------------------------------------
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


def batches(model: str, batch: int, seed: int) -> Iterator[Any]:
    """Byte windows of the shipped corpus: tensors for the demo model, ``input_ids``/``labels``
    dicts for the transformers one (its causal LM shifts the labels itself)."""
    from toolkit.corpus import demo_batches

    for x in demo_batches(batch, SEQ_LEN, seed=seed):
        yield x if model == "demo" else {"input_ids": x[:, :SEQ_LEN], "labels": x[:, :SEQ_LEN]}


def run_peer(args: argparse.Namespace) -> None:
    """One volunteer: join, wait at the barrier, ``--steps`` micro-batches, then what it counted."""
    counts = count_socket_bytes()
    import torch

    from toolkit.client import RelayClient
    from toolkit.models import build_model, loss_of
    from toolkit.optimizer import CollaborativeOptimizer

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    client = RelayClient(args.relay)
    run = client.get_run()
    model = build_model(run.model)
    opt = CollaborativeOptimizer(model, client=client, batch_size_per_step=args.batch, peer_name=f"peer{args.seed}")
    data = batches(args.model, args.batch, args.seed)
    barrier = Path(args.barrier)
    (barrier / f"joined-{args.seed}").touch()
    while not (barrier / "go").exists():
        time.sleep(0.02)
    joined, version0, started = dict(counts), opt.version, time.time()
    for _ in range(args.steps):
        batch = next(data)
        opt.zero_grad()
        loss = loss_of(model, batch)
        loss.backward()
        opt.step(loss=loss.item())
    ended, local = time.time(), opt.local_sgd
    report = {
        "samples": args.steps * args.batch,
        "started": started,
        "ended": ended,
        "rounds": opt.version - version0,
        "num_params": run.num_params,
        "busy_fraction": local.busy_fraction if local is not None else None,
        "late_rounds": local.late_rounds if local is not None else 0,
    }
    opt.close()
    report.update(
        join_up=joined["up"],
        join_down=joined["down"],
        up=counts["up"] - joined["up"],
        down=counts["down"] - joined["down"],
    )
    print(json.dumps(report), flush=True)


# --- one variant ---------------------------------------------------------------------------------
def write_run(path: Path, model: str, overrides: dict[str, dict[str, Any]]) -> Path:
    """The demo run with ``model``'s [model] and ``overrides`` merged in, as a TOML file."""
    config = tomllib.loads((REPO / "relay_server/defaults/demo.toml").read_text())
    config["model"] = dict(MODELS[model])
    for section, values in overrides.items():
        config.setdefault(section, {}).update(values)
    path.write_text(toml_text(config))
    return path


def evaluate(url: str, model_name: str, data_dir: Path) -> tuple[float, float]:
    """Mean loss on fixed held-out batches of the corpus of the run's model -- the relay's master
    parameters, which a checkpoint exports -- and of the public copy peers hold (the same with a
    lossless broadcast; with a lossy one it follows the master through error-fed deltas)."""
    import numpy as np
    import torch

    from relay_server.observers.pretrained import master_params
    from relay_server.rounds.store import Store
    from toolkit.client import RelayClient
    from toolkit.models import build_model, loss_of
    from toolkit.models.flat import load_flat

    client = RelayClient(url)
    run = client.get_run()
    public = np.empty(run.num_params, dtype=np.float32)
    step = client.params.download_params(public)
    client.close()
    store = Store(data_dir)
    try:
        master = master_params(store.state_path(step)).numpy()
    finally:
        store.close()
    model = build_model(run.model)
    model.eval()
    losses = []
    for flat in (master, public):
        load_flat(model, flat)
        data = batches(model_name, 16, EVAL_SEED)
        with torch.no_grad():
            losses.append(sum(float(loss_of(model, next(data))) for _ in range(EVAL_BATCHES)) / EVAL_BATCHES)
    return losses[0], losses[1]


class Links:
    """Where the relay and the peers run: one shaped namespace each (``relay_server/harness/netns.py``), or
    plain processes on 127.0.0.1 (``star`` None)."""

    def __init__(self, star: Star | None, relay: Host | None, peers: list[Host]) -> None:
        self.star, self.relay, self.peers = star, relay, peers

    def relay_argv(self, argv: list[str]) -> list[str]:
        if self.relay is None:
            return [*argv, "--host", "127.0.0.1"]
        return self.relay.command([*argv, "--host", self.relay.address])

    def peer_argv(self, i: int, argv: list[str]) -> list[str]:
        return self.peers[i].command(argv) if self.peers else argv


def run_variant(
    name: str, model: str, overrides: dict[str, dict[str, Any]], args: argparse.Namespace, links: Links, work: Path
) -> dict[str, Any]:
    """One relay and ``--peers`` peers; the variant's line (or ``refused`` with the relay's reason)."""
    tmp = Path(
        tempfile.mkdtemp(prefix=f"{model}-{name.replace(' ', '_').replace('=', '').replace('/', '_')}-", dir=work)
    )
    seeded = {**overrides, "run": {**overrides.get("run", {}), "seed": args.repeat}}
    config = write_run(tmp / "run.toml", model, seeded)
    try:
        relay = ServerProcess(
            ["serve", "--config", str(config), "--data-dir", str(tmp / "data")],
            tmp / "data",
            tmp / "relay.log",
            wrap=links.relay_argv,
        ).start()
    except ServerFailed as failed:
        if not failed.returncode:  # it hung, or exited cleanly without listening: not a refusal
            raise
        lines = [line for line in (tmp / "relay.log").read_text().splitlines() if line.strip()]
        return {"variant": name, "model": model, "refused": lines[-1] if lines else f"exit {failed.returncode}"}
    url = relay.url
    peers: list[subprocess.Popen] = []
    try:
        barrier = tmp / "barrier"
        barrier.mkdir()
        for i in range(args.peers):
            peers.append(
                subprocess.Popen(
                    links.peer_argv(
                        i,
                        [
                            sys.executable,
                            __file__,
                            "--peer",
                            "--relay",
                            url,
                            "--seed",
                            str(100 * args.repeat + i),
                            "--model",
                            model,
                            "--batch",
                            str(args.batch),
                            "--steps",
                            str(args.steps),
                            "--barrier",
                            str(barrier),
                        ],
                    ),
                    stdout=subprocess.PIPE,
                    stderr=open(tmp / f"peer{i}.log", "w"),
                    text=True,
                    cwd=REPO,
                )
            )
        deadline = time.monotonic() + 600
        while len(list(barrier.glob("joined-*"))) < args.peers:
            failed = [i for i, p in enumerate(peers) if p.poll() is not None]
            if failed or time.monotonic() > deadline:
                log_of = tmp / f"peer{failed[0] if failed else 0}.log"
                raise SystemExit(f"{name}: peer {failed or 'all'} did not join:\n{log_of.read_text()[-3000:]}")
            time.sleep(0.05)
        (barrier / "go").touch()
        results = []
        for i, peer in enumerate(peers):
            out, _ = peer.communicate()
            if peer.returncode != 0:
                raise SystemExit(
                    f"{name}: peer {i} failed (exit {peer.returncode}):\n{(tmp / f'peer{i}.log').read_text()[-3000:]}"
                )
            results.append(json.loads(out.strip().splitlines()[-1]))
        loss, public_loss = evaluate(url, model, tmp / "data")
    finally:
        for proc in peers:
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        relay.stop()
    return {**summarize_variant(name, model, results, loss, shaped=links.star is not None), "public_loss": public_loss}


# --- the benchmark -------------------------------------------------------------------------------
def variants(args: argparse.Namespace) -> list[tuple[str, dict[str, dict[str, Any]]]]:
    common = {"rounds": {"peer_ttl_s": 60.0, "deadline_floor_s": 60.0, "deadline_initial_s": 120.0}}
    inner = {"optimizer": {"lr": args.inner_lr, "clip_grad_norm": 1.0}}
    local = {"mode": "local_sgd", "target_batch": 10**9, "max_staleness": 0}
    out = [
        (
            "sync",
            {
                **common,
                "run": {
                    "target_batch": args.peers * args.batch,
                    "max_staleness": 0,
                    "compression": args.sync_compression,
                },
            },
        )
    ]
    hs = [int(x) for x in args.h.split(",")]
    overlap = {"overlap": True} if args.overlap else {}
    for h in hs:
        if args.dense:
            out.append(
                (
                    f"local_sgd H={h}",
                    {
                        **common,
                        **inner,
                        "run": {**local, "compression": "none"},
                        "local_sgd": {
                            "inner_steps": h,
                            "outer_lr": 0.7,
                            "outer_momentum": 0.9,
                            "nesterov": True,
                            **overlap,
                        },
                    },
                )
            )
    if args.sparse != "none":
        for down in args.sparse_down.split(","):
            down = "" if down in ("", "same") else down
            out.append(
                (
                    f"local_sgd+{args.sparse}{'/' + down if down else ''} H={max(hs)}",
                    {
                        **common,
                        **inner,
                        "run": {
                            **local,
                            "compression": args.sparse,
                            "download_compression": down,
                            "download_feedback": args.download_feedback,
                        },
                        "local_sgd": {
                            "inner_steps": max(hs),
                            "outer_lr": 1.0,
                            "outer_momentum": 0.0,
                            "nesterov": False,
                            **overlap,
                        },
                    },
                )
            )
    return out


def open_links(args: argparse.Namespace, stack: ExitStack) -> tuple[Links, str | None]:
    """Shaped namespaces when asked for and possible; else loopback and the reason."""
    reason = "--no-shape" if args.no_shape else unavailable()
    if reason:
        return Links(None, None, []), f"not shaped ({reason}): samples/s on 127.0.0.1, shaped_speedup null"
    star = Star(subnet=f"10.77.{random.randrange(1, 250)}")  # another shaped run on this machine keeps its own
    relay = star.add("relay", args.relay_mbit)
    peers = [star.add(f"peer{i}", args.peer_up, args.peer_down) for i in range(args.peers)]
    stack.enter_context(star)
    return Links(star, relay, peers), None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="demo,gpt2", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100, help="micro-batches per peer (the same in every variant)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--h", default="10,50", help="inner steps per outer round, comma-separated")
    parser.add_argument("--sync-compression", default="int8", choices=("none", "float16", "int8"))
    parser.add_argument("--sparse", default="topk2-64", help='the sparse variant\'s run.compression ("none": skip it)')
    parser.add_argument(
        "--sparse-down",
        default="same,topk2-256",
        help="comma-separated run.download_compression of the sparse variants (same: --sparse's)",
    )
    parser.add_argument(
        "--download-feedback",
        type=float,
        default=0.5,
        help="run.download_feedback of the sparse variants (1: the master keeps the whole residual)",
    )
    parser.add_argument(
        "--no-dense", dest="dense", action="store_false", help="skip the float32 local SGD variants (one per --h)"
    )
    parser.add_argument("--overlap", action="store_true", help="local_sgd.overlap = true in every local SGD variant")
    parser.add_argument("--inner-lr", type=float, default=0.003)
    parser.add_argument("--no-shape", action="store_true", help="run on 127.0.0.1 (no namespaces needed)")
    parser.add_argument("--peer-up", type=float, default=10.0, help="Mbit/s each peer sends")
    parser.add_argument("--peer-down", type=float, default=50.0, help="Mbit/s each peer receives")
    parser.add_argument("--relay-mbit", type=float, default=200.0, help="Mbit/s the relay sends and receives")
    parser.add_argument(
        "--repeat",
        type=int,
        default=0,
        help="another draw of the same comparison: run.seed (the initial parameters) = REPEAT, "
        "peer i's data seed 100 * REPEAT + i (the held-out batches stay the same)",
    )
    parser.add_argument("--work-dir", help="keep configs and logs here (default: a temporary directory)")
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--relay", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--model", default="demo", help=argparse.SUPPRESS)
    parser.add_argument("--barrier", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        run_peer(args)
        return
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    per_model = []
    with ExitStack() as stack:
        work = (
            Path(args.work_dir)
            if args.work_dir
            else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="low-bandwidth-")))
        )
        work.mkdir(parents=True, exist_ok=True)
        links, shaped_note = open_links(args, stack)
        for model in models:
            lines = []
            for name, overrides in variants(args):
                line = run_variant(name, model, overrides, args, links, work)
                if "refused" in line:
                    line["note"] = "the relay refused this configuration (pending the codec branch?); continuing"
                print(json.dumps(line), flush=True)
                lines.append(line)
            per_model.append(summarize_model(model, lines, shaped_note))
            print(json.dumps(per_model[-1]), flush=True)
    figures = worst(per_model)
    print(
        json.dumps(
            {
                **figures,
                "bars": bars(figures),
                "shaped": shaped_note or "yes",
                "variants": per_model[0]["variants"],
                "best": {m["model"]: m["best"] for m in per_model},
                "refused": per_model[0]["refused"],
                "models": {m["model"]: m for m in per_model},
            }
        )
    )


if __name__ == "__main__":
    main()
