"""A stage worker for ``benchmarks/trust.py``: the toolkit's real StageWorker (what ``toolkit.join``
runs on a pipeline run) on random byte data, honest or corrupting what it sends.

    python benchmarks/trust_rig.py --relay URL --name w0 --seed 0 --until-step 8
        [--corrupt ATTACK] [--after FILE --ready FILE]

``--corrupt`` names one of :mod:`relay_server.harness.dishonest`'s attacks (the trust tests' liars
are the same classes).

With ``--after``/``--ready`` it waits for the previous worker's ready file before asking for its
stage (stages are assigned in a fixed order: a joiner goes to the stage with the fewest workers,
the lower first), then writes its own. It exits 3 when the relay bans it, 0 at ``--until-step`` or on SIGTERM;
its last line is JSON: the tasks it did, the stage gradients and results it sent, and those it corrupted
(what ``benchmarks/trust.py`` compares with ``1 / (p * share)``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from relay_server.harness.dishonest import ATTACKS, dishonest  # noqa: E402
from toolkit.client import RelayClient  # noqa: E402
from toolkit.errors import RelayRejected  # noqa: E402
from toolkit.pipeline.worker import StageWorker  # noqa: E402
from toolkit.run_membership import Membership  # noqa: E402
from toolkit.wire.protocol import PROTOCOL_VERSION, JoinRequest  # noqa: E402


def data(seq_len: int, microbatch_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, 256, (microbatch_size, seq_len + 1), generator=g)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--relay", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--until-step", type=int, required=True)
    ap.add_argument("--corrupt", choices=("", *ATTACKS), default="")
    ap.add_argument("--after", help="wait for this file before asking for a stage")
    ap.add_argument("--ready", help="write this file once placed")
    args = ap.parse_args()
    if args.after:
        while not Path(args.after).exists():
            time.sleep(0.05)
    client = RelayClient(args.relay)
    run = client.get_run()
    membership = Membership(
        client, JoinRequest(peer_name=args.name, protocol=PROTOCOL_VERSION, device={}), what="stage worker"
    )
    membership.join()
    kind = dishonest(StageWorker, args.corrupt) if args.corrupt else StageWorker
    size = int(run.pipeline["microbatch_size"])
    worker = kind(membership, run, data(run.model.kwargs["seq_len"], size, args.seed))

    def until() -> bool:
        if args.ready and worker.assignment is not None and not Path(args.ready).exists():
            Path(args.ready).write_text(membership.peer_id)
        return client.get_state().step >= args.until_step

    signal.signal(signal.SIGTERM, lambda *_: worker.stop())  # the benchmark's limit: still print the counts
    code = 0
    try:
        worker.run(until=until, wait_s=1)
    except RelayRejected as exc:
        if exc.code != "banned":
            raise
        code = 3
    finally:
        if args.ready and not Path(args.ready).exists():  # never hold up the next worker
            Path(args.ready).write_text(membership.peer_id)
    membership.leave()
    client.close()
    print(
        json.dumps(
            {
                "tasks": worker.tasks_done,
                "gradients": getattr(worker, "gradients", None),
                "results": getattr(worker, "results", None),
                "lies": getattr(worker, "lies", None),
                "uploads": getattr(worker, "uploads", None),
                "exit": code,
            }
        ),
        flush=True,
    )
    return code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
