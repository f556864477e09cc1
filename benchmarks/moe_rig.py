"""What the DMoE benchmarks share: a relay with ``[moe]``, expert host processes whose compute can
be emulated, and a registered trainer whose calls may go through another address (a proxy).

    python benchmarks/moe_rig.py host --relay URL --capacity 8 --compute-ms 20   # one host process
    python benchmarks/moe_rig.py host --relay URL --capacity 8 --echo            # answers x (or g)
    python benchmarks/moe_rig.py host --relay URL --capacity 8 --fail-rate 0.1   # drops 10% of its tasks

The host is the real :class:`toolkit.moe.host.ExpertHost` (join, heartbeats, leases, task long
polls, results, checkpoints) with its runtime swapped for :class:`EmulatedRuntime`, which sleeps
``compute_ms`` per task before the real expert runs (a stand-in for a GPU's time on a big expert
that costs no CPU here: on a shared 2-core machine real compute would measure the CPU, not the
system), or, with ``echo``, returns the call's ``x`` (forward) or ``g`` (backward) untouched: the
broker's overhead alone. With ``fail_rate`` it drops that fraction of its tasks (seeded per host):
the real host then sends no result, as one preempted mid-task would, and the relay times the call
out (``[moe] forward_timeout_s`` / ``backward_timeout_s``), so the trainer sees a failed expert.
Everything between the trainer and the expert is the production path.

The relay runs as ``relay-server serve --port 0`` (``relay_server.harness.process.start_relay``), on the run of
``tests/support/moe.py`` resized (:func:`relay_overrides`). Benchmarks import no test module and
no conftest (the one helper they share with the tests is the HF stand-in, ``tests/hf_standin.py``,
for hf-mode runs); the hand-driven peer both use is the harness's
(:class:`relay_server.harness.manual_peer.ManualPeer`).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import requests
import torch
from requests.auth import AuthBase

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from relay_server.harness.manual_peer import ManualPeer  # noqa: E402
from relay_server.harness.process import wait_until  # noqa: E402
from toolkit.client import RelayClient  # noqa: E402
from toolkit.moe.calls import ExpertFailed, LoopbackCaller  # noqa: E402
from toolkit.moe.remote import RelayExpertCaller  # noqa: E402
from toolkit.wire.protocol import MAX_JSON_BODY, ROUTES  # noqa: E402

__all__ = [
    "EmulatedRuntime",
    "Member",
    "caller_for",
    "directory",
    "relay_overrides",
    "start_hosts",
    "stop_all",
    "wait_until",
]

# The run of tests/support/moe.py, which relay_overrides resizes: strict large-batch SGD steps,
# one DMoE model, open auth on 127.0.0.1 (a benchmark turns hf mode on in its [auth]).
BASE_RUN: dict[str, dict[str, Any]] = {
    "run": {"name": "moe-bench", "target_batch": 16, "total_steps": 0, "max_staleness": 0, "seed": 0},
    "optimizer": {"name": "sgd", "lr": 0.05, "weight_decay": 0.0, "clip_grad_norm": 0.0, "schedule": "constant"},
    "rounds": {
        "heartbeat_interval_s": 0.3,
        "peer_ttl_s": 2.0,
        "deadline_floor_s": 2.0,
        "deadline_ceiling_s": 60.0,
        "deadline_initial_s": 30.0,
    },
    "server": {"host": "127.0.0.1", "keep_checkpoints": 1000},
    "auth": {"mode": "open"},
}
MOE = {"enabled": True, "uid_prefix": "ffn", "seed": 0}
KWARGS = {"out_features": 1, "uid_prefix": "ffn", "expert_seed": 0, "balancing_coef": 0.01}


def relay_overrides(
    *,
    d: int,
    expert_hidden: int,
    layers: int,
    grid: list[int],
    k: int,
    max_rows_per_call: int | None = None,
    timeout_s: float = 30.0,
    expert_lr: float = 1e-4,
) -> dict[str, dict[str, Any]]:
    """:data:`BASE_RUN` (the run of ``tests/support/moe.py``) resized: ``layers`` mixtures of ``grid`` experts of width
    ``d``; checkpoints rare (they are not what is measured); rate limits out of the way (every
    process here is one loopback address, and the benchmark is the only client). Hosts still
    take an SGD step per backward call, with a small ``expert_lr``: throughput runs push random
    data through many concurrent stale updates, which at a training rate would diverge to NaN
    (and the relay rightly refuses NaN results)."""
    base = {name: dict(values) for name, values in BASE_RUN.items()}
    if max_rows_per_call is None:  # as many as one signed request holds (x and g, float32)
        max_rows_per_call = min(512, (MAX_JSON_BODY - 4096) // (8 * d))
    base["moe"] = {
        **MOE,
        "layers": layers,
        "grid": grid,
        "k": k,
        "expert": {"kind": "ffn", "d": d, "hidden": expert_hidden},
        "checkpoint_every_s": 3600.0,
        "forward_timeout_s": timeout_s,
        "backward_timeout_s": timeout_s,
        "max_rows_per_call": max_rows_per_call,
        "max_queued_rows": 1 << 20,
        "optimizer": {"name": "sgd", "lr": expert_lr},
    }
    base["model"] = {
        "factory": "toolkit.models:DMoEMLP",
        "kwargs": {
            **KWARGS,
            "in_features": d,
            "hidden": d,
            "layers": layers,
            "grid": grid,
            "k": k,
            "expert_hidden": expert_hidden,
            "timeout_s": timeout_s,
        },
    }
    base["limits"] = {"tasks_per_s": 1e6, "tasks_burst": 1e6}
    return base


def directory(url: str) -> dict:
    return requests.get(url + ROUTES["moe_directory"], timeout=10).json()


class Member(ManualPeer):
    """A registered trainer driven by hand (the harness's :class:`ManualPeer`), through a client of
    its own, logged in with ``token`` on an hf-mode run."""

    def __init__(self, url: str, name: str, token: str | None = None) -> None:
        client = RelayClient(url, retries=0)
        if token:
            client.login(token)
        super().__init__(client, name)


class EmulatedRuntime(LoopbackCaller):
    """A host's runtime that sleeps ``compute_ms`` per task, then computes (or echoes), dropping
    ``fail_rate`` of its tasks (drawn from ``seed``)."""

    def __init__(
        self,
        *args: Any,
        compute_ms: float = 0.0,
        echo: bool = False,
        fail_rate: float = 0.0,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.compute_s, self.echo = compute_ms / 1000, echo
        self.fail_rate, self._draw = fail_rate, random.Random(seed)

    def _run(self, kind: str, uid: str, x: torch.Tensor, grad_y: torch.Tensor | None) -> torch.Tensor:
        if self.fail_rate and self._draw.random() < self.fail_rate:
            raise ExpertFailed("task_dropped", f"{kind} task for {uid} dropped (--fail-rate {self.fail_rate})")
        if self.compute_s:
            time.sleep(self.compute_s)
        if self.echo:
            return x if grad_y is None else grad_y
        return super()._run(kind, uid, x, grad_y)


def start_hosts(
    relay_url: str,
    count: int,
    capacity: int,
    logs: Path,
    *,
    compute_ms: float = 0.0,
    echo: bool = False,
    env: dict[str, str] | None = None,
    fail_rate: float = 0.0,
    batching: bool = True,
) -> list[subprocess.Popen]:
    """``count`` host processes of this file, each leasing up to ``capacity`` experts (``env``:
    extra variables, e.g. ``HF_TOKEN`` for a run with logins), each dropping ``fail_rate`` of its
    tasks (``batching=False``: every call run alone)."""
    extra = (
        (["--echo"] if echo else [])
        + (["--fail-rate", str(fail_rate)] if fail_rate else [])
        + ([] if batching else ["--no-batching"])
    )
    return [
        subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "host",
                "--relay",
                relay_url,
                "--capacity",
                str(capacity),
                "--compute-ms",
                str(compute_ms),
                "--name",
                f"host{i}",
                *extra,
            ],
            cwd=REPO,
            stdout=open(logs / f"host{i}.log", "w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        for i in range(count)
    ]


def stop_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def caller_for(url: str, peer_id: str, max_workers: int, auth: AuthBase | None = None) -> RelayExpertCaller:
    """A caller whose requests go to ``url`` (the relay, or a proxy in front of it) on behalf of
    the registered peer ``peer_id`` (``auth``: the peer's signer in a run with logins; signatures
    cover the path, not the address). Its connection pool holds ``max_workers`` connections."""
    return RelayExpertCaller(RelayClient(url, retries=0, auth=auth), peer_id, max_workers=max_workers)


def _host_main(argv: list[str]) -> int:
    from toolkit.moe.host import ExpertHost

    parser = argparse.ArgumentParser(
        prog="python benchmarks/moe_rig.py host",
        description="an expert host with emulated compute (see the module docstring)",
    )
    parser.add_argument("--relay", required=True)
    parser.add_argument("--capacity", type=int, default=8)
    parser.add_argument("--compute-ms", type=float, default=0.0, help="sleep per task before computing")
    parser.add_argument("--echo", action="store_true", help="answer x (forward) or g (backward) as they came")
    parser.add_argument("--fail-rate", type=float, default=0.0, help="drop this fraction of tasks (no result sent)")
    parser.add_argument("--name", default="bench-host")
    parser.add_argument("--no-batching", action="store_true", help="run every call alone")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    host = ExpertHost(
        args.relay,
        capacity=args.capacity,
        name=args.name,
        token=os.environ.get("HF_TOKEN") or None,
        batching=not args.no_batching,
    )
    runtime = host.runtime
    host.runtime = EmulatedRuntime(
        {},
        optimizer_factory=runtime.optimizer_factory,
        compute_ms=args.compute_ms,
        echo=args.echo,
        fail_rate=args.fail_rate,
        seed=zlib.crc32(args.name.encode()),
    )
    runtime.close()
    signal.signal(signal.SIGTERM, lambda *_: host.stop())
    host.run()
    print(f"{args.name}: {host.tasks_done} tasks in {host.batches_done} batches", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["host"]:
        print("usage: python benchmarks/moe_rig.py host --relay URL [--capacity N] [--compute-ms MS] [--echo]")
        raise SystemExit(2)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(_host_main(sys.argv[2:]))
