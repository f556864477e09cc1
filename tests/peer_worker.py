"""A real peer process for integration tests: trains the run's model with the real
CollaborativeOptimizer and logs, as JSON lines, which samples went into which round: rows of a
deterministic MLP dataset, or, for a run with an [objective], rows of the batches the run's own
input pipeline made (kept in ``<events>.batches.pt`` so a test can replay them)."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import sys
import time

import torch

DATASET_SIZE, IN_DIM = 4096, 8


def make_dataset(n: int = DATASET_SIZE, in_dim: int = IN_DIM) -> torch.Tensor:
    """Rows [x (in_dim), y]; identical in every process (fixed seed)."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, in_dim, generator=g)
    w = torch.randn(in_dim, generator=g)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(n, generator=g)
    return torch.cat([x, y[:, None]], dim=1)


def params_sha(model: torch.nn.Module) -> str:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def main() -> int:
    from toolkit.client import RelayClient
    from toolkit.data.input_pipeline import peer_batches
    from toolkit.models import build_model, loss_of
    from toolkit.optimizer import CollaborativeOptimizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--relay", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True, help="stop once the global step reaches this")
    parser.add_argument("--events", required=True)
    parser.add_argument("--delayed", action="store_true")
    parser.add_argument("--sleep-per-batch", type=float, default=0.0, help="simulate a slower device")
    parser.add_argument("--wait-peers", type=int, default=0, help="start computing once this many peers joined")
    parser.add_argument(
        "--wait-aggregators",
        type=int,
        default=0,
        help="start computing once this many aggregators registered with the relay",
    )
    parser.add_argument("--hf-token-env", default=None, help="log in with the HF token in this environment variable")
    parser.add_argument(
        "--freeze-before-upload",
        type=int,
        default=None,
        metavar="STEP",
        help="SIGSTOP this process just before uploading to round STEP or later (the test kills it)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.name} %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    # SIGUSR1: stop between micro-batches, so every round this peer took part in is in its events
    # (SIGTERM may land while a round's result downloads: applied, but never logged).
    stopping: list[int] = []
    signal.signal(signal.SIGUSR1, lambda *_: stopping.append(1))
    torch.set_num_threads(1)
    events = open(args.events, "a", buffering=1)

    def emit(**event) -> None:
        events.write(json.dumps(event) + "\n")

    client = RelayClient(args.relay, retries=6, backoff_s=0.3)
    if args.hf_token_env:
        client.login(os.environ[args.hf_token_env])
    run = client.get_run()
    model = build_model(run.model)
    data = make_dataset()
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed))
    # Pay the first step's lazy imports (torch._dynamo through torch.optim: seconds when cold) before
    # joining, so peers that wait for each other (--wait-peers) then compute at their real pace.
    warm = torch.nn.Parameter(torch.zeros(1))
    warm.grad = torch.zeros(1)
    torch.optim.SGD([warm], lr=0.0).step()
    opt = CollaborativeOptimizer(
        model,
        client=client,
        batch_size_per_step=args.batch_size,
        peer_name=args.name,
        delayed_updates=args.delayed,
        report_interval_s=0.05,
    )
    emit(event="joined", step=opt.version, sha=params_sha(model))
    if args.freeze_before_upload is not None:
        upload = client.upload_gradient

        def frozen_upload(tensors, meta, codec):
            if meta.step >= args.freeze_before_upload:
                emit(event="freezing", step=meta.step)
                os.kill(os.getpid(), signal.SIGSTOP)  # reported its samples, so the round expects it
            return upload(tensors, meta, codec)

        client.upload_gradient = frozen_upload
    # Poll finely: the last peer to join sees the others at once and a tiny model computes a
    # micro-batch per millisecond, so at 50 ms the others could miss the first round entirely.
    while args.wait_peers and client.get_status().num_peers < args.wait_peers:
        time.sleep(0.005)
    while args.wait_aggregators and sum(a.alive for a in client.get_status().plan.aggregators) < args.wait_aggregators:
        time.sleep(0.05)
    pending: list = []
    cursor, version = 0, opt.version
    # A run with an [objective]: the run's own input pipeline (its tokenizer, packing, masking),
    # every batch kept so the test can replay the rows each round received.
    pipeline = (
        peer_batches(run, client, opt.peer_id, batch_size=args.batch_size, seed=args.seed) if run.objective else None
    )
    kept: list[dict] = []
    try:
        while opt.version < args.steps and not opt.finished and not stopping:
            if pipeline is not None:
                batch = next(pipeline)
                ids = [f"{args.name}/{len(kept)}/{r}" for r in range(len(batch["input_ids"]))]
                kept.append(batch)
            else:
                ids = [int(i) for i in order[cursor : cursor + args.batch_size]]
                cursor = (cursor + args.batch_size) % (len(order) - args.batch_size)
                batch = data[ids]
            time.sleep(args.sleep_per_batch)
            loss = loss_of(model, batch)
            opt.zero_grad()
            loss.backward()
            before = opt.contributed_samples
            pending += ids
            opt.step(loss=loss.item())
            sent = opt.contributed_samples - before
            if sent:
                emit(event="round", step=opt.last_applied_round, ids=pending[:sent])
                pending = pending[sent:]
            elif opt.samples == 0 and pending:
                emit(event="dropped", ids=pending)
                pending = []
            if opt.version != version:
                version = opt.version
                emit(event="version", step=version, sha=params_sha(model))
    except KeyboardInterrupt:
        pass
    finally:
        opt.close()
        if pipeline is not None:
            pipeline.close()
            torch.save(kept, args.events + ".batches.pt")
    emit(event="done", step=opt.version, sha=params_sha(model))
    return 0


if __name__ == "__main__":
    # What it wrote is closed or flushed below: skip the interpreter's teardown of torch (~0.6 s of
    # CPU a process, and the suite starts hundreds of them).
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
