"""Spot checks of stage workers' results, through the real relay: how often each dishonest worker
is caught, whether an honest one ever is, and what the checks cost.

    python benchmarks/trust.py                      # ~15 minutes on 2 shared cores
    python benchmarks/trust.py --share 0.05 --batches 12
    python benchmarks/trust.py --tolerance 1000     # honest distances per precision, no relay

Processes per run: one ``relay-server serve`` with ``[pipeline]`` (a ByteTransformer of 4 blocks
cut into 2 stages) and 4 stage workers (``benchmarks/trust_rig.py``: the toolkit's StageWorker),
placed in a fixed order so that the dishonest one serves the stage its attack needs: ``scale``
and ``noise`` (its activations x1.3, or plus noise of 10% of their norm) on stage 0, ``flip``
(every tenth stage gradient's sign flipped) on stage 1, ``upload`` (every result honest, every
stage gradient it uploads at a round sign-flipped: only the audits of uploads find it) on stage 1, ``stale`` (every batch computed on the
parameters of the first it served: honest in that batch, lying from the next) on stage 0. Runs,
on the same seeds:

* ``honest@0``: four honest workers, ``check_share = 0`` (the baseline's seconds per batch);
* ``honest@share``: four honest workers, ``check_share = --share`` (false bans; the throughput cost);
* one run per attack at ``--share``, until ``--batches`` batches or the liar's ban.

Detection is counted per run: a true positive when the liar was banned within the run, a false
positive for every honest worker banned in any run, a false negative for a liar never banned;
F1 over all runs. Extra compute is the tasks computed only to check others (re-issued tasks
answered, plus tasks the relay computed itself, plus the backwards it computed to audit stage-gradient
uploads) over the tasks the batches needed. The monitors'
cost is measured in this process: one result's validation (:func:`relay_server.pipeline.results.read_result`,
what every result costs the relay today) against the monitor's scoring of it.

Last line: one JSON object with ``f1``, ``extra_compute``, ``false_bans``, ``batches_to_ban`` per
attack, the liar's tasks and corrupted results until its ban (``liars``; for the patient liar
against ``1 / (p * share)``), ``throughput_ratio`` (seconds per batch with checks over without), ``monitor_cost``
(the scoring's share of the validation's time, at this run's boundary and at a GPT-2-small
micro-batch's) and the settings.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_rig import REPO, stop_all, wait_until  # noqa: E402

from relay_server.harness.process import start_relay  # noqa: E402

RIG = Path(__file__).resolve().parent / "trust_rig.py"
LIAR_STAGE = {"scale": 0, "noise": 0, "flip": 1, "flip-late": 1, "stale": 0, "upload": 1}
PATIENT = {"flip-late"}
"""Attacks that wait out a new worker's probation: reported on their own, not in the F1 (the base
share catches them at about ``1 / (p * share)`` of their tasks: beyond a benchmark's batches)."""


def relay_config(args, share: float) -> dict:
    return {
        "run": {"name": "trust-bench", "target_batch": 2 * args.microbatches, "max_staleness": 0, "seed": 0},
        "model": {
            "factory": "toolkit.models:ByteTransformer",
            "kwargs": {
                "d_model": args.width,
                "n_layer": 4,
                "n_head": 2,
                "d_ff": 2 * args.width,
                "seq_len": 16,
                "tie_embeddings": False,
            },
        },
        "optimizer": {"name": "sgd", "lr": 0.05, "weight_decay": 0.0, "clip_grad_norm": 0.0, "schedule": "constant"},
        "rounds": {"heartbeat_interval_s": 0.3, "peer_ttl_s": 600.0},
        "server": {"host": "127.0.0.1"},
        "auth": {"mode": "open"},
        "pipeline": {
            "enabled": True,
            "stages": 2,
            "microbatch_size": 2,
            "microbatches_per_batch": args.microbatches,
            "initial_lease_s": 10.0,
            "check_share": share,
        },
    }


def run_once(name: str, attack: str, share: float, args, folder: Path, batches: int) -> dict:
    folder.mkdir(parents=True)
    relay = start_relay(folder, relay_config(args, share))
    procs, liar = [], LIAR_STAGE.get(attack, -1)
    started = time.monotonic()
    try:
        for i in range(4):
            extra = ["--corrupt", attack] if i == liar else []
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(RIG), "--relay", relay.url, "--name", f"w{i}", "--seed", str(args.seed + i)]
                    + ["--until-step", str(batches), "--ready", str(folder / f"w{i}.ready"), *extra]
                    + (["--after", str(folder / f"w{i - 1}.ready")] if i else []),
                    cwd=REPO,
                    stdout=open(folder / f"w{i}.log", "w"),
                    stderr=subprocess.STDOUT,
                )
            )

        def over() -> bool:
            trust = pipeline(relay.url)["trust"]
            return status(relay.url)["step"] >= batches or (liar >= 0 and bool(trust["bans"]))

        try:
            wait_until(over, args.run_limit_s, f"{batches} batches")
            completed = True
        except TimeoutError:
            completed = False
        pipe, stat = pipeline(relay.url), status(relay.url)
        if liar >= 0 and completed:  # banned or at the last step, it ends by itself: its counts are its last line
            try:
                procs[liar].wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
    finally:
        stop_all(procs)
        relay.stop()
    ids = {i: (folder / f"w{i}.ready").read_text() for i in range(4) if (folder / f"w{i}.ready").exists()}
    trust = pipe["trust"]
    banned = {b["worker"]: b["batch"] for b in trust["bans"]}
    rounds = sorted((r for r in stat["recent_rounds"] if r["finalized_by"] == "pipeline"), key=lambda r: r["step"])
    times = [r["duration_s"] for r in rounds][1:]  # the first batch: downloads and first measurements
    tasks = (stat["step"] + trust["batches_restarted"]) * pipe["tasks_total"] + pipe["tasks_done"]
    # tasks computed only to check others: re-issued tasks answered, tasks the relay computed itself,
    # and the backwards the relay computed to audit stage-gradient uploads
    extra = trust["agreed"] + trust["disagreed"] + trust["refereed"] + trust["gradient_audit_microbatches"]
    out = {
        "attack": attack or None,
        "share": share,
        "completed": completed,
        "steps": stat["step"],
        "caught": liar >= 0 and ids.get(liar) in banned,
        "batch_of_ban": banned.get(ids.get(liar)) if liar >= 0 else None,
        "false_bans": sum(1 for i, w in ids.items() if i != liar and w in banned),
        "checks": trust["checks"],
        "agreed": trust["agreed"],
        "disagreed": trust["disagreed"],
        "refereed": trust["refereed"],
        "unserved": trust["unserved"],
        "probation_checks": trust["probation_checks"],
        "gradient_audits": trust["gradient_audits"],
        "gradient_audits_agreed": trust["gradient_audits_agreed"],
        "gradient_lies": trust["gradient_lies"],
        "gradient_audit_microbatches": trust["gradient_audit_microbatches"],
        "gradient_audit_probation_microbatches": trust["gradient_audit_probation_microbatches"],
        "max_audit_distance": trust["max_audit_distance"],
        "tasks": tasks,
        "extra_compute": round(extra / tasks, 4) if tasks else None,
        # past the workers' probation: what the run pays per batch from then on
        "extra_compute_after_probation": round(
            max(0, extra - trust["probation_checks"] - trust["gradient_audit_probation_microbatches"]) / tasks, 4
        )
        if tasks
        else None,
        "liar": liar_counts(folder / f"w{liar}.log") if liar >= 0 else None,
        "max_agreeing_distance": trust["max_agreeing_distance"],
        "tolerance": trust["tolerance"],
        "seconds_per_batch": round(sum(times) / len(times), 3) if times else None,
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(f"{name}: {json.dumps(out)}", flush=True)
    return out


def liar_counts(log: Path) -> dict | None:
    """The liar's own last line (``trust_rig.py``): tasks done, stage gradients sent, results
    corrupted; None when it printed none (killed at the run's limit)."""
    lines = log.read_text().strip().splitlines() if log.exists() else []
    try:
        return json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None


def pipeline(url: str) -> dict:
    return requests.get(url + "/api/pipeline", timeout=10).json()


def status(url: str) -> dict:
    return requests.get(url + "/api/status", timeout=10).json()


def monitor_cost(rows: int, width: int, repeats: int) -> dict:
    """Seconds per result of the relay's validation against the monitors' scoring of it, for a
    boundary of ``rows`` x ``width`` (the scoring's cost does not grow with it: it reads the norm
    the validation computed)."""
    from relay_server.pipeline.ledger import FORWARD, Step
    from relay_server.pipeline.results import Shapes, read_result
    from relay_server.trust.monitor import ResultMonitor
    from toolkit.wire import payloads
    from toolkit.wire.compression import get_codec
    from toolkit.wire.protocol import PipelineResult

    codec = get_codec("none")
    shapes = Shapes(width=width, microbatch_size=2, max_positions=rows, vocab=256)
    y = np.random.default_rng(0).normal(size=(rows, width)).astype(np.float32)
    body = payloads.encode(
        payloads.encode_rows("y", y, codec), {"result": PipelineResult(task_id="t1").dumps().decode()}
    )
    step, monitor = Step(FORWARD, 1, 0), ResultMonitor()
    t0 = time.perf_counter()
    for _ in range(repeats):
        accepted = read_result(body, step, rows, shapes, codec)
    validate = (time.perf_counter() - t0) / repeats
    norm, size = accepted.norms["a"]
    t0 = time.perf_counter()
    for i in range(repeats):
        monitor.observe("a1", f"w{i % 4}", norm * (1 + 1e-3 * (i % 7)), size)
    score = (time.perf_counter() - t0) / repeats
    return {
        "validate_us": round(validate * 1e6, 1),
        "score_us": round(score * 1e6, 1),
        "ratio": round(score / validate, 3),
    }


def tolerances(args) -> dict:
    """``--tolerance N``: N honest checked results per precision (:mod:`relay_server.trust.calibrate`,
    on this run's model cut into its 2 stages): the distances honest recomputations differ by, the
    tolerance derived from them, the tolerance the relay uses, and how many honest results it
    would have called lies (false bans)."""
    import math

    from relay_server.trust.calibrate import MARGIN, measure
    from relay_server.trust.compare import tolerance
    from toolkit.wire.protocol import ModelSpec

    model = relay_config(args, 0.0)["model"]
    spec = ModelSpec(factory=model["factory"], kwargs=model["kwargs"])
    out = {}
    for precision in ("fp32", "fp16", "bf16"):
        started = time.monotonic()
        measured = measure(spec, [2, 2], precision, math.ceil(args.tolerance / 2), seed=args.seed)  # 2 results each
        used = tolerance(precision, "none")
        out[precision] = {
            **measured.summary(),
            "tolerance": used,
            "false_bans": measured.beyond(used),
            "seconds": round(time.monotonic() - started, 1),
        }
        print(f"{precision}: {json.dumps(out[precision])}", flush=True)
    return {"margin": MARGIN, "false_bans": sum(p["false_bans"] for p in out.values()), "precisions": out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--share", type=float, default=0.02, help="pipeline.check_share (the base share) of the checked runs"
    )
    parser.add_argument("--batches", type=int, default=6, help="batches of each attack's run (it ends at the ban)")
    parser.add_argument(
        "--honest-batches",
        type=int,
        default=16,
        help="batches of the two honest runs (extra compute and seconds per batch: probation is a cost per "
        "joining worker, so a longer run shows what a run pays); 0: no honest runs (a patient liar's run)",
    )
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument(
        "--attacks",
        default="scale,noise,flip,stale,upload",
        help="also: flip-late (the patient liar, not in the F1)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-limit-s", type=float, default=240.0)
    parser.add_argument("--logs", help="keep every process's log in this folder (default: a temporary one)")
    parser.add_argument(
        "--tolerance",
        type=int,
        default=0,
        metavar="N",
        help="only measure honest distances: N checked results per precision (fp32, fp16, bf16), no relay",
    )
    args = parser.parse_args(argv)
    if args.tolerance:
        print(json.dumps(tolerances(args)))
        return 0
    attacks = [a for a in args.attacks.split(",") if a]
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="trust-bench-") as tmp:
        logs = Path(args.logs) if args.logs else Path(tmp)
        if args.honest_batches:
            runs["honest@0"] = run_once("honest@0", "", 0.0, args, logs / "honest-0", args.honest_batches)
            runs["honest@share"] = run_once(
                "honest@share", "", args.share, args, logs / "honest-share", args.honest_batches
            )
        for attack in attacks:
            runs[attack] = run_once(attack, attack, args.share, args, logs / attack, args.batches)
    scored = [a for a in attacks if a not in PATIENT]
    tp = sum(runs[a]["caught"] for a in scored)
    fn = len(scored) - tp
    fp = sum(r["false_bans"] for r in runs.values())
    honest = runs.get("honest@share", {})
    base, checked = runs.get("honest@0", {}).get("seconds_per_batch"), honest.get("seconds_per_batch")
    summary = {
        "f1": round(2 * tp / (2 * tp + fp + fn), 3) if scored else None,
        "extra_compute": honest.get("extra_compute"),
        "extra_compute_after_probation": honest.get("extra_compute_after_probation"),
        "false_bans": fp,
        "batches_to_ban": {a: runs[a]["batch_of_ban"] for a in attacks},
        "throughput_ratio": round(checked / base, 3) if base and checked else None,
        "monitor_cost": {
            "this_run": monitor_cost(2 * 16, args.width, 2000),
            # a GPT-2-small micro-batch: 4 samples x 512 tokens, width 768
            "gpt2_microbatch": monitor_cost(4 * 512, 768, 50),
        },
        "max_agreeing_distance": honest.get("max_agreeing_distance"),
        "tolerance": honest.get("tolerance"),
        "liars": {a: runs[a]["liar"] for a in attacks},
        "patient": {
            a: {
                "batch_of_ban": runs[a]["batch_of_ban"] if runs[a]["caught"] else None,
                "steps": runs[a]["steps"],
                "liar": runs[a]["liar"],
                # each lie checked at the base share: about 1 / share lies, 1 / (p * share) results
                # after its first 20 (p = 0.1: every tenth a lie)
                "predicted_lies": round(1 / args.share),
                "predicted_results": round(1 / (0.1 * args.share)),
            }
            for a in attacks
            if a in PATIENT
        },
        "settings": {
            "share": args.share,
            "batches": args.batches,
            "honest_batches": args.honest_batches,
            "microbatches": args.microbatches,
            "width": args.width,
            "stages": 2,
            "workers": 4,
        },
        "runs": runs,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
