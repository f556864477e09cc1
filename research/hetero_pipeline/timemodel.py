"""The paper's time model (heterogeneous-pipeline seed, section 3.3): Eq. 1 the time of one
pipeline stage for one micro-batch, Eq. 2 the 1F1B pipeline time of a batch, Eq. 3 the balanced
approximation used while searching. Pure functions; the partition search (:mod:`.partition`) is
written on them, and the relay's star planner (:mod:`relay_server.pipeline.star_model`) is what
they reduce to on collabtrain's star.

Units, and how the paper's inconsistencies are resolved here:

* The paper's ``t`` is both a byte count (``t_i / beta``) and an amount of work (``t_i |h_k| /
  c_i``). Here a device's share of a micro-batch is ``n`` *samples*; it moves ``n *
  bytes_per_sample`` bytes and does ``n * layers`` layer-samples of work at ``compute``
  layer-samples per second. Whole micro-batches are ``microbatch`` samples.
* Eq. 1 reuses ``k`` as the stage and as the index of a server, and divides by ``beta_{0,j}``.
  Here every computing device of a stage (a client, or a collocated server with compute) has one
  hop *in* (from the frontal server it receives from) and one hop *out* (to the backward server
  it sends to), each an ``alpha`` plus bytes over a ``beta``; a hop to itself is :data:`LOCAL`
  (zero). That is the paper's first line for clients and its second line for servers.
* Eq. 3 writes ``B`` for the batch that section 3.1.3 calls ``D``, and divides by the number of
  clusters ``p`` once too often: a balanced stage holds ``|H|/p`` layers and ``sum(C)/p`` of the
  compute, so its time per micro-batch is ``(D/d) * |H| / sum(C)``, independent of ``p``. With the
  extra ``p`` the estimate would fall as ``1/p`` forever and would not equal Eq. 2 on a balanced
  plan; without it, it does (tested to 1e-9).
* Eq. 2 takes, per stage, ``alpha_kf + t/beta_kf`` as the hop that brings the stage its input
  activation from stage k-1 and ``alpha_kb + t/beta_kb`` as the hop that brings it its output
  gradient from stage k+1 (absent at the ends), both for a whole micro-batch; warm-up and drain
  are ignored as in the paper unless asked for (``warmup``; the planners ask).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Hop:
    """One transfer: a fixed delay ``alpha`` (seconds) plus bytes over ``beta`` (bytes/s)."""

    alpha: float
    beta: float

    def time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` (zero bytes still pay ``alpha``)."""
        return self.alpha + (nbytes / self.beta if nbytes else 0.0)


LOCAL = Hop(0.0, math.inf)
"""A hop a device makes to itself: a server that is its own frontal or backward server."""


@dataclass(frozen=True)
class DeviceLoad:
    """A computing device of a stage with its share of a micro-batch (samples): one line of Eq. 1."""

    share: float
    compute: float
    hop_in: Hop = LOCAL
    hop_out: Hop = LOCAL


def device_time(load: DeviceLoad, layers: int, bytes_per_sample: float) -> float:
    """Eq. 1, one line: receive the share, run ``layers`` layers on it, send the result on."""
    nbytes = load.share * bytes_per_sample
    return load.hop_in.time(nbytes) + load.hop_out.time(nbytes) + load.share * layers / load.compute


def stage_time(loads: Sequence[DeviceLoad], layers: int, bytes_per_sample: float) -> float:
    """Eq. 1: a stage finishes a micro-batch when its slowest working device does. Devices with no
    share are idle for this micro-batch and do not count (the paper's max runs over the clients the
    frontal server hands work to). A stage with no working device never finishes: ``inf``."""
    times = [device_time(load, layers, bytes_per_sample) for load in loads if load.share > 0]
    return max(times) if times else math.inf


def compute_shares(computes: Sequence[float], microbatch: float) -> tuple[float, ...]:
    """The paper's split of a micro-batch: in proportion to each device's compute (section 3.2.1)."""
    total = sum(computes)
    return tuple(microbatch * c / total for c in computes)


def balanced_shares(
    devices: Sequence[tuple[float, Hop, Hop]], microbatch: float, layers: int, bytes_per_sample: float
) -> tuple[float, ...]:
    """Shares of a micro-batch that make every working device of Eq. 1 finish at the same time
    (water filling). The paper splits by compute alone, which lets one device behind a slow link
    hold the whole stage; a task pool instead hands such a device less work, down to none when its
    fixed delays alone exceed the others' finishing time. ``devices`` are (compute, hop in, hop
    out); with all-local hops the result equals :func:`compute_shares`."""
    fixed = [h_in.alpha + h_out.alpha for _, h_in, h_out in devices]
    per = [bytes_per_sample / h_in.beta + bytes_per_sample / h_out.beta + layers / c for c, h_in, h_out in devices]
    order = sorted(range(len(devices)), key=lambda i: fixed[i])
    level, inv, weighted = math.inf, 0.0, 0.0
    for rank, i in enumerate(order):
        inv += 1.0 / per[i]
        weighted += fixed[i] / per[i]
        level = (microbatch + weighted) / inv
        if rank + 1 == len(order) or level <= fixed[order[rank + 1]]:
            break
    return tuple(max(0.0, (level - f) / p) for f, p in zip(fixed, per))


def boundary_time(forward: Hop | None, backward: Hop | None, microbatch_bytes: float) -> float:
    """Eq. 2's inter-stage terms of one stage: its input activation arriving from stage k-1 and its
    output gradient arriving from stage k+1 (``None`` where the stage is the first or the last)."""
    return sum(h.time(microbatch_bytes) for h in (forward, backward) if h is not None)


def pipeline_time(
    stage_times: Sequence[float], boundary_times: Sequence[float], microbatches: int, warmup: bool = False
) -> float:
    """Eq. 2: under 1F1B the batch's ``d`` micro-batches pass the slowest stage one after another,
    so a batch takes ``d * max_k (boundary_k + DT_k)``. The paper drops warm-up and drain; with
    ``warmup`` they are kept as DAPPLE counts them, ``(d + K - 1)`` bottleneck steps: the first
    micro-batch crosses K - 1 stages before the last stage starts. That term is what makes a
    stage cost something when its boundaries are cheap, so the planners keep it."""
    if len(stage_times) != len(boundary_times) or not stage_times:
        raise ValueError("pipeline_time needs one boundary time per stage and at least one stage")
    steps = microbatches + (len(stage_times) - 1 if warmup else 0)
    return steps * max(b + s for b, s in zip(boundary_times, stage_times))


def balanced_stage_time(microbatch: float, total_layers: int, total_compute: float) -> float:
    """Eq. 3, corrected (see the module docstring): a stage's time for one micro-batch when layers
    follow compute exactly and intra-stage transfers are free, ``(D/d) * |H| / sum(C)``."""
    return microbatch * total_layers / total_compute


def balanced_pipeline_time(
    boundary_times: Sequence[float],
    microbatch: float,
    total_layers: int,
    total_compute: float,
    microbatches: int,
    warmup: bool = False,
) -> float:
    """Eq. 2 with every stage's DT_k replaced by Eq. 3: the estimate the clustering search can make
    before it has placed clients or layers."""
    dt = balanced_stage_time(microbatch, total_layers, total_compute)
    return pipeline_time([dt] * len(boundary_times), boundary_times, microbatches, warmup)


def balanced_stage_times(
    devices: Sequence[tuple[float, Hop, Hop]], microbatch: float, max_layers: int, bytes_per_sample: float
) -> np.ndarray:
    """Eq. 1 under :func:`balanced_shares` for 1..``max_layers`` layers at once (index h-1): every
    working device finishes at the water level, so the stage time is the level. Using only the
    ``r`` devices with the smallest fixed delays gives a level ``T_r`` that is never below the true
    one, and the true one is some ``T_r``, so it is their minimum. ``inf`` without devices."""
    if not devices:
        return np.full(max_layers, math.inf)
    fixed = np.array([h_in.alpha + h_out.alpha for _, h_in, h_out in devices])
    moved = np.array([bytes_per_sample / h_in.beta + bytes_per_sample / h_out.beta for _, h_in, h_out in devices])
    return water_levels(fixed, moved, 1.0 / np.array([c for c, _, _ in devices]), microbatch, max_layers)


def water_levels(
    fixed: Sequence[float],
    moved: Sequence[float],
    inv_compute: Sequence[float],
    microbatch: float,
    max_layers: int,
    capacity: Sequence[float] | None = None,
) -> np.ndarray:
    """The arithmetic of :func:`balanced_stage_times`: per device its fixed delay, its transfer
    seconds per sample and its seconds per sample-layer; a device with a ``capacity`` below h
    layers sits out at h (``inf`` where nobody can hold h). Plain floats: the partition's brute
    force calls this thousands of times on a dozen devices, where numpy's per-call cost dominates."""
    caps = capacity if capacity is not None else [math.inf] * len(fixed)
    ranked = sorted(zip(fixed, moved, inv_compute, caps))
    out = []
    for h in range(1, max_layers + 1):
        level, inv, weighted = math.inf, 0.0, 0.0
        for f, mv, ic, cap in ranked:
            if cap < h:
                continue
            if f >= level:
                break  # this device and every later one would start after the others finish
            per = mv + h * ic
            inv += 1.0 / per
            weighted += f / per
            level = (microbatch + weighted) / inv
        out.append(level)
    return np.array(out)
