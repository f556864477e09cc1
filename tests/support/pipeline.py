"""What the pipeline's integration tests share: a pipeline run's configuration, the data each
accepted micro-batch carried (from the workers' event logs), and the same run replayed in one
process (the exactness reference)."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import requests
import torch

from toolkit.models import build_model, loss_of
from toolkit.models.flat import load_flat
from toolkit.pipeline import compute
from toolkit.pipeline.boundary_codec import through_cuts
from toolkit.pipeline.compute import pipeline_masks
from toolkit.wire.compression import boundary_codec
from toolkit.wire.protocol import ModelSpec

SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0, "clip_grad_norm": 0.0, "schedule": "constant"}


def pipeline_overrides(
    spec: ModelSpec, *, stages: int, microbatch_size: int = 2, microbatches: int = 4, **pipeline: Any
) -> dict[str, dict[str, Any]]:
    model = (
        {"kind": "transformers", "architecture": spec.architecture, "config": spec.config}
        if spec.kind == "transformers"
        else {"factory": spec.factory, "kwargs": spec.kwargs}
    )
    return {
        "run": {"target_batch": microbatch_size * microbatches, "max_staleness": 0},
        "model": model,
        "optimizer": SGD,
        "pipeline": {
            "enabled": True,
            "stages": stages,
            "microbatch_size": microbatch_size,
            "microbatches_per_batch": microbatches,
            **pipeline,
        },
    }


def checked_pipeline(*, microbatches: int, **pipeline: Any) -> dict[str, dict[str, Any]]:
    """The trust tests' relay (dishonest workers, spot checks, rollbacks): two stages of the byte
    model, leases short enough that a banned worker's tasks come back in a second, reports every
    0.3 s, and workers the relay never forgets (a ban, not a timeout, must be what removes one)."""
    from tests.support.pipeline_models import BYTE_SPEC

    return {
        **pipeline_overrides(
            BYTE_SPEC, stages=2, microbatches=microbatches, initial_lease_s=5.0, lease_floor_s=1.0, **pipeline
        ),
        "rounds": {"heartbeat_interval_s": 0.3, "peer_ttl_s": 600.0},
    }


def accepted_batches(workers, *, latest: bool = False) -> dict[int, Any]:
    """micro-batch id -> the data its first stage read (each id from exactly one worker; with
    ``latest``, the last read of an id: a relay restart re-runs the batch it was in)."""
    found: dict[int, tuple[float, Any]] = {}
    for worker in workers:
        for event in worker.events():
            if event["event"] == "first":
                m = event["microbatch"]
                assert latest or m not in found, f"micro-batch {m} was counted twice"
                if m not in found or event["t"] > found[m][0]:
                    found[m] = (event["t"], event["batch"])
    return {m: batch for m, (_, batch) in found.items()}


def as_batch(plain: Any) -> Any:
    if isinstance(plain, dict):
        return {k: torch.tensor(v) for k, v in plain.items()}
    return torch.tensor(plain)


def replay(
    spec: ModelSpec,
    initial: np.ndarray,
    batches: dict[int, Any],
    *,
    steps: int,
    microbatches: int,
    layers: list[int] | None = None,
    precision: str = "",
    delay: int = 0,
    codec: str = "",
) -> np.ndarray:
    """One process, the relay's initial parameters, the same global batches (micro-batches
    ``t * d .. t * d + d - 1`` make batch ``t``), the same SGD: the parameters after ``steps``.
    With ``layers`` (the run's layers per stage) micro-batch ``m`` draws the dropout masks the
    pipeline's tasks draw for it (:func:`toolkit.pipeline.compute.pipeline_masks`); with
    ``precision`` its forward runs under that policy's CPU autocast, as the stage workers' do.
    With ``delay = 1`` (delayed parameter updates) batch ``t``'s gradient is computed at the
    parameters of step ``max(t - 1, 0)`` and applied to those of step ``t``. With ``codec`` (a
    lossy ``[pipeline] boundary_codec``) every cut carries its round trip both ways
    (:func:`toolkit.pipeline.boundary_codec.through_cuts`)."""
    torch.manual_seed(0)
    model = build_model(spec)
    load_flat(model, initial)
    lagged = build_model(spec) if delay else model  # the parameters gradients are computed at
    if delay:
        load_flat(lagged, initial)
    opt = torch.optim.SGD(model.parameters(), lr=SGD["lr"], momentum=SGD["momentum"])
    policy = compute.stage_precision(precision, "cpu")

    def loss(m: int) -> torch.Tensor:
        with (
            pipeline_masks(lagged, layers, m) if layers else contextlib.nullcontext(),
            through_cuts(lagged, layers, boundary_codec(codec)) if codec and layers else contextlib.nullcontext(),
            policy.autocast(),
        ):
            return loss_of(lagged, as_batch(batches[m]))

    for t in range(steps):
        opt.zero_grad()
        lagged.zero_grad()
        ids = range(t * microbatches, (t + 1) * microbatches)
        (sum(loss(m) for m in ids) / microbatches).backward()
        if delay:
            current = [p.detach().clone() for p in model.parameters()]
            for p, q in zip(model.parameters(), lagged.parameters()):
                p.grad = q.grad.clone()
            opt.step()
            with torch.no_grad():  # the next batch's gradient is computed at this step's parameters
                for q, c in zip(lagged.parameters(), current):
                    q.copy_(c)
        else:
            opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def layers_per_stage(relay_url: str) -> list[int]:
    """The run's layers per stage, as ``/api/pipeline`` states them."""
    stages = requests.get(relay_url + "/api/pipeline", timeout=10).json()["stages"]
    return [end - first for first, end in (stage["layers"] for stage in stages)]


def relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
