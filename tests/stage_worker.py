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


def hoarder(base, relay: str, log):
    """Holds the stage gradients the relay accepted from it and keeps heartbeating and polling,
    but never asks for a ticket: without a deadline on held gradients the round waits forever."""

    class Hoarder(base):
        def _upload(self, call) -> None:
            log(event="hoarding", step=call.step, microbatches=call.microbatches)
            time.sleep(0.2)

    return Hoarder


def ticket_reuser(base, relay: str, log):
    """Gets its ticket, then asks for a second one naming other micro-batches (refused: they are
    recomputed), then uploads with the first ticket anyway."""
    import dataclasses

    from toolkit.errors import RelayRejected

    class Reuser(base):
        def _upload(self, call) -> None:
            client, real = self.client, self.client.pipeline.ticket

            def twice(peer_id, step, req):
                ticket = real(peer_id, step, req)
                try:
                    real(peer_id, step, dataclasses.replace(req, microbatches=[10**6]))
                except RelayRejected as exc:
                    log(event="second_ticket_refused", code=exc.code)
                return ticket

            client.pipeline.ticket = twice
            try:
                super()._upload(call)
            finally:
                client.pipeline.ticket = real

    return Reuser


def lease_hog(base, relay: str, log):
    """Polls for work from four connections at once and never answers: every task it gets sits
    out its lease, and without a cap and a no-re-lease rule it takes each again as it lapses."""
    import threading

    from toolkit.client import RelayClient

    class Hog(base):
        def _serve_once(self, wait_s: int) -> None:
            if not getattr(self, "_hogs", None):
                self._hogs = [threading.Thread(target=self._hog, daemon=True) for _ in range(4)]
                for thread in self._hogs:
                    thread.start()
            time.sleep(0.5)

        def _hog(self) -> None:
            client = RelayClient(relay)
            while not self._stop.is_set():
                try:
                    work, _ = client.pipeline.work(self.peer_id, wait_s=2, cached=[])
                    for task in work.tasks:
                        log(
                            event="hogged",
                            task=task.task_id,
                            kind=task.kind,
                            stage=task.stage,
                            microbatch=task.microbatch,
                        )
                except Exception as exc:  # noqa: BLE001 -- an attacker shrugs
                    log(event="hog_error", error=str(exc)[:200])
                    time.sleep(0.2)

    return Hog


def liar(base, relay: str, log):
    """Claims 1e12 samples/s for its stage and never asks for work (it only heartbeats): placed
    by self-reports, every honest joiner would go to the other stages and its own is never served."""

    class Liar(base):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.samples_per_s = 1e12

        def _serve_once(self, wait_s: int) -> None:
            time.sleep(0.5)

    return Liar


def trickler(base, relay: str, log):
    """Uploads its stage gradient honestly up to its last 200 bytes, then sends one byte every
    2 s: never silent for ``body_idle_timeout_s``, and an upload in flight is not recomputed, so
    without a bound on an upload's duration it holds the round 400 s per batch."""
    import toolkit.transfer

    def slowly(self):
        body = b"".join(toolkit.transfer.iter_encoded(self.tensors, self.metadata))
        yield body[:-200]
        log(event="trickling", size=len(body))
        for i in range(len(body) - 200, len(body)):
            time.sleep(2.0)
            yield body[i : i + 1]

    class Trickler(base):
        def _upload(self, call) -> None:
            honest = toolkit.transfer.SizedBody.__iter__
            toolkit.transfer.SizedBody.__iter__ = slowly
            try:
                super()._upload(call)
            finally:
                toolkit.transfer.SizedBody.__iter__ = honest

    return Trickler


HOSTILE = {"hoard": hoarder, "reuse": ticket_reuser, "hog": lease_hog, "liar": liar, "trickle": trickler}


def main() -> int:
    from relay_server.harness.dishonest import ATTACKS, dishonest
    from toolkit.client import RelayClient
    from toolkit.errors import RelayRejected
    from toolkit.pipeline.worker import StageWorker
    from toolkit.run_membership import Membership
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
    ap.add_argument(
        "--hostile",
        choices=sorted(HOSTILE),
        default="",
        help="misbehave as one of the hostile workers of tests/test_hostile_pipeline.py",
    )
    ap.add_argument(
        "--corrupt",
        choices=ATTACKS,
        default="",
        help="send wrong results as one of the dishonest workers of tests/test_trust_pipeline.py",
    )
    args = ap.parse_args()
    # one thread: four workers, a relay and pytest share two cores (two threads each oversubscribe
    # them: tests/test_pipeline.py, test_trust_pipeline.py and test_hostile_pipeline.py took 98 and
    # 101 s with torch's default against 57 and 56 s with this), and a worker's result does not
    # depend on which worker computed it with how many threads (bf16 matmuls round differently)
    torch.set_num_threads(1)
    started = time.monotonic()
    events = open(args.events, "a", buffering=1)

    def log(**event) -> None:
        events.write(json.dumps({**event, "t": time.time()}) + "\n")

    client = RelayClient(args.relay)
    if args.hf_token_env:
        client.login(os.environ[args.hf_token_env])
    run = client.get_run()
    membership = Membership(
        client,
        JoinRequest(peer_name=args.name, protocol=PROTOCOL_VERSION, device={}, precision=run.precision or None),
        what="stage worker",
    )
    peer_id = membership.join().peer_id
    size = int(run.pipeline["microbatch_size"])

    def on_first(microbatch: int, batch) -> None:
        plain = {k: v.tolist() for k, v in batch.items()} if isinstance(batch, dict) else batch.tolist()
        log(event="first", microbatch=microbatch, batch=plain)

    class Logged(StageWorker):
        def _do(self, task, inputs) -> None:
            log(
                event="leased",
                task=task.task_id,
                kind=task.kind,
                stage=task.stage,
                microbatch=task.microbatch,
                batch=task.batch,
                version=task.version,
                cached=task.input_cached,
                replay=task.replay,
            )
            time.sleep(args.sleep_per_task)
            before = self.tasks_done
            super()._do(task, inputs)
            log(
                event="accepted" if self.tasks_done > before else "refused",
                task=task.task_id,
                kind=task.kind,
                stage=task.stage,
                microbatch=task.microbatch,
                redo=task.redo,
            )

        def _upload(self, call) -> None:
            super()._upload(call)
            log(event="uploaded", step=call.step, microbatches=call.microbatches, stage=call.stage)

    kind = HOSTILE[args.hostile](Logged, args.relay, log) if args.hostile else Logged
    kind = dishonest(kind, args.corrupt, lambda **lie: log(event="corrupted", **lie)) if args.corrupt else kind
    worker = kind(membership, run, data(run, size, args.seed), on_first=on_first)
    log(event="joined", peer_id=peer_id, step=client.get_state().step, precision=worker.precision.name)

    def until() -> bool:
        return client.get_state().step >= args.until_step or time.monotonic() - started > args.max_seconds

    try:
        worker.run(until=until, wait_s=1)
    except RelayRejected as exc:
        if exc.code != "banned":
            raise
        log(event="banned", message=exc.message)
        membership.leave()
        client.close()
        return 3
    # None: the run reached --until-step before this worker took a stage (a late starter on a busy machine)
    stage = worker.assignment.stage if worker.assignment is not None else None
    log(event="done", step=client.get_state().step, stage=stage)
    membership.leave()
    client.close()
    return 0


if __name__ == "__main__":
    # What it wrote is closed or flushed below: skip the interpreter's teardown of torch (~0.6 s of
    # CPU a process, and the suite starts hundreds of them).
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
