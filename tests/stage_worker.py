"""A real pipeline worker process for integration tests: the toolkit's StageWorker (what
``toolkit.join`` runs on a pipeline run) on deterministic data, logging as JSON lines which data
each accepted micro-batch carried (so a test can replay the run in one process), every task it
leased and every result the relay accepted (so a test can kill it at a chosen moment)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def data(run, microbatch_size: int, seed: int):
    """Micro-batches of the run's model: byte rows [b, seq_len + 1], or GPT-2 dicts."""
    g = torch.Generator().manual_seed(seed)
    if run.model.kind == "transformers":
        vocab, seq = run.model.config["vocab_size"], 12
        while True:
            ids = torch.randint(0, vocab, (microbatch_size, seq), generator=g)
            yield {"input_ids": ids, "labels": ids.clone()}
    seq = run.model.kwargs["seq_len"]
    while True:
        yield torch.randint(0, 256, (microbatch_size, seq + 1), generator=g)


def main() -> int:
    from toolkit.client import RelayClient
    from toolkit.pipeline.worker import StageWorker
    from toolkit.wire.protocol import PROTOCOL_VERSION, JoinRequest

    ap = argparse.ArgumentParser()
    ap.add_argument("--relay", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--events", required=True)
    ap.add_argument("--until-step", type=int, required=True)
    ap.add_argument("--sleep-per-task", type=float, default=0.0)
    ap.add_argument("--max-seconds", type=float, default=300.0)
    ap.add_argument("--hf-token-env", default="", help="log in with the token in this variable (an hf-mode run)")
    args = ap.parse_args()
    started = time.monotonic()
    events = open(args.events, "a", buffering=1)

    def log(**event) -> None:
        events.write(json.dumps({**event, "t": time.time()}) + "\n")

    client = RelayClient(args.relay)
    if args.hf_token_env:
        client.login(os.environ[args.hf_token_env])
    run = client.get_run()
    peer_id = client.join(JoinRequest(peer_name=args.name, protocol=PROTOCOL_VERSION, device={})).peer_id
    size = int(run.pipeline["microbatch_size"])

    def on_first(microbatch: int, batch) -> None:
        plain = {k: v.tolist() for k, v in batch.items()} if isinstance(batch, dict) else batch.tolist()
        log(event="first", microbatch=microbatch, batch=plain)

    class Logged(StageWorker):
        def _do(self, task, inputs) -> None:
            log(event="leased", task=task.task_id, kind=task.kind, stage=task.stage, microbatch=task.microbatch,
                batch=task.batch, cached=task.input_cached)
            time.sleep(args.sleep_per_task)
            before = self.tasks_done
            super()._do(task, inputs)
            log(event="accepted" if self.tasks_done > before else "refused", task=task.task_id, kind=task.kind,
                stage=task.stage, microbatch=task.microbatch, redo=task.redo)

        def _upload(self, call) -> None:
            super()._upload(call)
            log(event="uploaded", step=call.step, microbatches=call.microbatches, stage=call.stage)

    worker = Logged(client, peer_id, run, data(run, size, args.seed), on_first=on_first)
    log(event="joined", peer_id=peer_id, step=client.get_state().step)

    def until() -> bool:
        return client.get_state().step >= args.until_step or time.monotonic() - started > args.max_seconds

    worker.run(until=until, wait_s=1)
    log(event="done", step=client.get_state().step, stage=worker.assignment.stage)
    client.leave(peer_id)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
