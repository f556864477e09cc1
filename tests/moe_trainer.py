"""A trainer of a mixture-of-experts run, as a real process: ``toolkit.join`` on fixed batches.

``python tests/moe_trainer.py URL STEPS [--sleep S] [--batches N] [--in-flight J] [--repeat R]``
trains on the first N (default STEPS) of :func:`batches` (or its first R, over and over) (seeded, so the test's in-process reference sees the
same data), with at most J micro-batches in flight (default: join's own sizing), and prints one
JSON line: the result, the loss of every micro-batch in data order, the most micro-batches kept in
flight and, per mixture layer, its call counters and the uids whose calls failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

IN_FEATURES, BATCH = 6, 16


def batches(steps: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, BATCH, IN_FEATURES, generator=gen)
    y = torch.sin(x.sum(-1, keepdim=True))
    return list(torch.cat([x, y], -1))


class Paced:
    """The batches with a pause before each: a run long enough for a host to die mid-way."""

    def __init__(self, data: list[torch.Tensor], sleep_s: float) -> None:
        self.data, self.sleep_s = data, sleep_s

    def __iter__(self):
        for batch in self.data:
            time.sleep(self.sleep_s)
            yield batch


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("steps", type=int)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--batches", type=int, default=None)
    parser.add_argument("--in-flight", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=None, help="cycle the first R batches (a task to learn)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from toolkit import join
    from toolkit.models import DMoEMLP

    failed: dict[str, int] = {}
    model_box: list[DMoEMLP] = []

    class Recorder(DMoEMLP):  # the run's model, remembering its layers so their counters can be printed
        def attach_caller(self, caller):
            model_box.append(self)
            original = caller._call

            def call(uid, kind, x, g):
                try:
                    return original(uid, kind, x, g)
                except Exception:
                    failed[uid] = failed.get(uid, 0) + 1
                    raise

            caller._call = call
            return super().attach_caller(caller)

    from toolkit.client import RelayClient

    kwargs = RelayClient(args.url).get_run().model.kwargs
    losses: list[float] = []

    class Losses:  # a panel: join reports every micro-batch's loss to it
        def update(self, progress) -> None:
            losses.append(progress.loss)

        def close(self) -> None:
            pass

    count = args.batches or args.steps
    data = batches(count) if args.repeat is None else [batches(args.repeat)[i % args.repeat] for i in range(count)]
    result = join(
        args.url,
        model=Recorder(**kwargs),
        data=Paced(data, args.sleep),
        batch_size=BATCH,
        max_steps=args.steps,
        panel=Losses(),
        peer_name="moe-trainer",
        moe_in_flight=args.in_flight,
    )
    stats = [
        dict(
            calls=m.stats.calls,
            failures=m.stats.failures,
            backward_failures=m.stats.backward_failures,
            dropped_rows=m.stats.dropped_rows,
        )
        for m in model_box[0].moe
    ]
    print(
        json.dumps(
            {
                "final_step": result.final_step,
                "local_steps": result.local_steps,
                "contributed": result.contributed_samples,
                "layers": stats,
                "failed_uids": failed,
                "losses": losses,
                "in_flight": result.in_flight,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    # What it wrote is closed or flushed below: skip the interpreter's teardown of torch (~0.6 s of
    # CPU a process, and the suite starts hundreds of them).
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
