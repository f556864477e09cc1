"""Learning@home's Figure 5 (failures) in miniature: a DMoE classifier trained with 10% of its
expert calls failing against the same classifier with none, final validation accuracy, 3 seeds.

    python benchmarks/moe_failures.py                          # ~6 minutes on 2 cores (6 runs)
    python benchmarks/moe_failures.py --steps 600 --seeds 0    # quicker

In process: :class:`toolkit.models.DMoEMLP` (``--layers`` mixtures of a ``--grid`` grid, top
``--k``) whose experts sit behind a :class:`toolkit.moe.calls.LoopbackCaller` -- the same runtime
semantics as an expert host (forward under no_grad, backward recomputes and steps the expert's own
Adam once per call, on one runtime thread) -- with a fail rule that drops each call, forward or
backward, with probability ``--fail-rate`` (the paper's "each expert does not respond to a request
with probability 0.1"). A failed forward masks that expert for its rows (softmax over the
survivors), a failed backward leaves the expert without that update and the input without its
gradient. The dense parts (input projection, norms, gates, head) train with Adam in this process.
Dense and expert rates follow one cosine decay to 0, so the final accuracy is a settled model's
rather than one noisy step's: without it (constant rate, the first calibration run) seed-to-seed
noise was about as large as the effect measured.

The task is synthetic and one where routing matters: points around ``--clusters`` centres in 16
dimensions, each cluster labelling its points (4 classes) by its own random linear rule, so an
expert that learns one region's rule serves those rows well. Every seed draws its own
initialisation, data order and failures; the task (its centres, rules, train and validation
sets) is the same for all.

Validation accuracy is measured in each run's own conditions (the 10% run keeps failing 10% of its
calls while evaluated: the deployed system would) and also with no failures (``clean``: what the
training produced). ``accuracy_drop_points`` is the mean over seeds of (no-failure accuracy -
10%-failure accuracy) in percentage points, in own conditions; ``accuracy_drop_points_clean`` the
same with a clean evaluation.

Last line: ``{"accuracy_drop_points", "per_seed", "accuracy", ...}``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from toolkit.models import DMoEMLP  # noqa: E402
from toolkit.moe.calls import LoopbackCaller  # noqa: E402

IN_FEATURES, CLASSES = 16, 4


def make_task(clusters: int, train: int, val: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(x_train, y_train, x_val, y_val): points around ``clusters`` centres, each cluster's labels
    from its own random linear rule (argmax of 4 projections of the offset from its centre)."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, IN_FEATURES, generator=gen) * 3.0
    rules = torch.randn(clusters, IN_FEATURES, CLASSES, generator=gen)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = torch.randint(clusters, (n,), generator=gen)
        offset = torch.randn(n, IN_FEATURES, generator=gen)
        labels = torch.einsum("nd,ndk->nk", offset, rules[c]).argmax(1)
        return centres[c] + offset, labels

    return (*draw(train), *draw(val))


def accuracy(model: DMoEMLP, x: torch.Tensor, y: torch.Tensor, batch: int = 512) -> float:
    with torch.no_grad():
        hits = sum(int((model(x[i : i + batch]).argmax(1) == y[i : i + batch]).sum()) for i in range(0, len(x), batch))
    return hits / len(x)


def run(seed: int, fail_rate: float, data: tuple[torch.Tensor, ...], args: argparse.Namespace) -> dict:
    """Train one model; its validation accuracy in its own conditions and with no failures."""
    x_train, y_train, x_val, y_val = data
    torch.manual_seed(seed)
    model = DMoEMLP(
        in_features=IN_FEATURES,
        hidden=args.hidden,
        out_features=CLASSES,
        layers=args.layers,
        grid=tuple(args.grid),
        k=args.k,
        expert_hidden=args.expert_hidden,
        expert_seed=seed,
        balancing_coef=0.01,
    )
    experts = {uid: model.make_expert(uid) for uid in model.expert_uids()}
    failing = {"rate": fail_rate}
    rng = random.Random(seed + 1000)  # the caller's one runtime thread draws from it, in call order

    def fail(uid: str, kind: str, x: torch.Tensor) -> bool:
        return rng.random() < failing["rate"]

    started = time.monotonic()
    with LoopbackCaller(
        experts, fail=fail, optimizer_factory=lambda m: torch.optim.Adam(m.parameters(), lr=args.lr)
    ) as caller:
        model.attach_caller(caller)
        dense = torch.optim.Adam(model.parameters(), lr=args.lr)
        order = torch.Generator().manual_seed(seed)
        for step in range(args.steps):
            lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))  # cosine to 0: a settled final model
            for opt in (dense, *caller.optimizers.values()):
                for group in opt.param_groups:
                    group["lr"] = lr
            rows = torch.randint(len(x_train), (args.batch,), generator=order)
            batch = torch.cat([x_train[rows], y_train[rows, None].float()], 1)
            dense.zero_grad(set_to_none=True)
            model.loss(batch).backward()
            dense.step()
        own = accuracy(model, x_val, y_val)
        failing["rate"] = 0.0
        clean = accuracy(model, x_val, y_val)
    stats = [m.stats for m in model.moe]
    calls = sum(s.calls + s.backward_calls for s in stats)
    failed = sum(s.failures + s.backward_failures for s in stats)
    return {
        "accuracy": own,
        "accuracy_clean": clean,
        "seconds": round(time.monotonic() - started, 1),
        "failed_fraction": round(failed / max(calls, 1), 4),
        "dropped_rows": sum(s.dropped_rows for s in stats),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds")
    parser.add_argument("--steps", type=int, default=3000, help="training steps per run")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--fail-rate", type=float, default=0.1, help="probability that an expert call fails")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument(
        "--grid",
        type=lambda s: [int(v) for v in s.split("x")],
        default=[2, 4],
        help="experts per layer as a grid, e.g. 2x4 (8 experts)",
    )
    parser.add_argument("--k", type=int, default=4, help="experts per row (the paper's 4)")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--expert-hidden", type=int, default=32)
    parser.add_argument(
        "--lr",
        type=float,
        default=3e-3,
        help="Adam's peak rate, dense parts and experts alike (cosine decay to 0 over the steps)",
    )
    parser.add_argument("--clusters", type=int, default=8)
    parser.add_argument("--train", type=int, default=20000)
    parser.add_argument("--val", type=int, default=10000)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = make_task(args.clusters, args.train, args.val)
    per_seed = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        base, failing = run(seed, 0.0, data, args), run(seed, args.fail_rate, data, args)
        row = {
            "seed": seed,
            "no_failures": base,
            "failures": failing,
            "drop_points": round(100 * (base["accuracy"] - failing["accuracy"]), 2),
            "drop_points_clean": round(100 * (base["accuracy_clean"] - failing["accuracy_clean"]), 2),
        }
        per_seed.append(row)
        print(
            f"seed {seed}: accuracy {base['accuracy']:.4f} with no failures, {failing['accuracy']:.4f} with "
            f"{args.fail_rate:.0%} (clean eval {failing['accuracy_clean']:.4f}; {failing['failed_fraction']:.1%} "
            f"of calls failed); {base['seconds']} s + {failing['seconds']} s",
            flush=True,
        )
    drops = [r["drop_points"] for r in per_seed]
    clean_drops = [r["drop_points_clean"] for r in per_seed]

    def acc(key: str, field: str = "accuracy") -> list[float]:
        return [r[key][field] for r in per_seed]

    summary = {
        "accuracy_drop_points": round(statistics.fmean(drops), 2),
        "accuracy_drop_points_clean": round(statistics.fmean(clean_drops), 2),
        "drop_points_per_seed": drops,
        "accuracy": {
            "no_failures": round(statistics.fmean(acc("no_failures")), 4),
            "failures": round(statistics.fmean(acc("failures")), 4),
            "no_failures_std": round(statistics.stdev(acc("no_failures")), 4) if len(drops) > 1 else 0.0,
            "failures_std": round(statistics.stdev(acc("failures")), 4) if len(drops) > 1 else 0.0,
        },
        "fail_rate": args.fail_rate,
        "steps": args.steps,
        "batch": args.batch,
        "max_run_seconds": max(max(r["no_failures"]["seconds"], r["failures"]["seconds"]) for r in per_seed),
        "per_seed": per_seed,
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
