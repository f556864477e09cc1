"""A partition of the paper's general setting (heterogeneous-pipeline seed, section 3.3.3) as
data, and its predicted time: the measured :class:`Instance`, the :class:`Cluster` stages of a
:class:`Partition`, and the :class:`PartitionEvaluator` that scores an ordered clustering with
Eq. 1-2 (:mod:`.timemodel`), placing frontal/backward servers (step 4) and clients (step 5) by the
paper's rules. :mod:`.partition` searches with it; :mod:`.exhaustive` enumerates with it.

Where the paper is silent: adjacent stages exchange through all server pairs evenly (the section
3.2.1 segmentation), so a boundary costs the mean pair time; a device's share of a micro-batch is
balanced so that all finish together (a task pool's effect) rather than split by compute alone;
the first stage's devices read their own data and the last stage's compute the loss in place, so
those hops are free; and a device can hold only so many layers (the paper has no memory; memory is
why one pipelines at all, and without it corrected Eq. 1-2 always prefer one stage)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from research.hetero_pipeline.timemodel import Hop, boundary_time, water_levels


@dataclass(frozen=True)
class Instance:
    """Measured inputs: servers' compute (layer-samples/s, 0 for a server that only relays), delay
    (s) and bandwidth (bytes/s) between servers (``alpha[i][j]`` from i to j) and from each client
    to each server (symmetric), the model's layers, the batch: ``microbatches`` (d) of
    ``microbatch`` samples with ``bytes_per_sample`` of activation at every boundary, and
    optionally how many layers each device can hold; ``warmup`` counts 1F1B's fill and drain
    (:func:`~research.hetero_pipeline.timemodel.pipeline_time`)."""

    server_compute: tuple[float, ...]
    server_alpha: tuple[tuple[float, ...], ...]
    server_beta: tuple[tuple[float, ...], ...]
    client_compute: tuple[float, ...]
    client_alpha: tuple[tuple[float, ...], ...]
    client_beta: tuple[tuple[float, ...], ...]
    layers: int
    microbatch: float
    bytes_per_sample: float
    microbatches: int
    server_capacity: tuple[float, ...] = ()
    client_capacity: tuple[float, ...] = ()
    warmup: bool = True

    def steps(self, num_stages: int) -> int:
        """Bottleneck steps per batch: ``d``, plus the 1F1B fill ``K - 1`` with ``warmup``."""
        return self.microbatches + (num_stages - 1 if self.warmup else 0)

    def capacity(self, server: bool, index: int) -> float:
        """The most layers a device can hold (its memory over a layer's training bytes); no entry
        means unbounded. The paper's Table 1 has no memory, but memory is why one pipelines."""
        caps = self.server_capacity if server else self.client_capacity
        return caps[index] if caps else math.inf

    @property
    def microbatch_bytes(self) -> float:
        return self.microbatch * self.bytes_per_sample


@dataclass(frozen=True)
class Cluster:
    """One stage: its servers split into frontal (receive from the previous stage) and backward
    (send to the next) servers, the clients assigned to it, and its layers."""

    servers: tuple[int, ...]
    frontal: tuple[int, ...]
    backward: tuple[int, ...]
    clients: tuple[int, ...]
    layers: int


@dataclass(frozen=True)
class Partition:
    """A plan: the stages in pipeline order and its predicted seconds per batch (Eq. 2)."""

    stages: tuple[Cluster, ...]
    seconds_per_batch: float


class PartitionEvaluator:
    """Eq. 1-2 for one instance, with every per-stage quantity cached: the search and the brute
    force ask for the same (previous, cluster, next) triples many times. :meth:`of` shares one
    evaluator per instance between them."""

    @staticmethod
    @lru_cache(maxsize=4)
    def of(inst: "Instance") -> "PartitionEvaluator":
        """The shared evaluator of ``inst`` (instances are frozen, so its answers never change)."""
        return PartitionEvaluator(inst)

    def __init__(self, inst: Instance) -> None:
        self.inst = inst
        self.t = inst.microbatch_bytes
        self.cs = np.asarray(inst.server_compute, float)
        self.cs_list = list(inst.server_compute)
        self.sa, self.sb = np.asarray(inst.server_alpha, float), np.asarray(inst.server_beta, float)
        self.cu = np.asarray(inst.client_compute, float)
        self.ua, self.ub = np.asarray(inst.client_alpha, float), np.asarray(inst.client_beta, float)
        self.pair = self.sa + self.t / self.sb
        np.fill_diagonal(self.pair, 0.0)
        self.pair_rows = self.pair.tolist()
        self.alpha_rows, self.beta_rows = self.sa.tolist(), self.sb.tolist()
        self.ua_rows, self.ub_rows = self.ua.tolist(), self.ub.tolist()
        self.client_cost = (self.ua + self.t / self.ub) if len(self.cu) else np.zeros((0, len(self.cs)))
        self.client_rows = self.client_cost.tolist()
        self.stage_vector = lru_cache(maxsize=None)(self._stage_vector)
        self.stage_setup = lru_cache(maxsize=None)(self._stage_setup)
        self.link = lru_cache(maxsize=None)(self._link)
        self.clients_of = lru_cache(maxsize=None)(self._clients_of)

    def graph(self) -> np.ndarray:
        """Step 1: graph G over the servers, edge weight alpha_ij + alpha_ji + t/beta_ij + t/beta_ji."""
        return self.pair + self.pair.T

    def _link(self, src: frozenset, dst: frozenset) -> Hop:
        """The hop of a whole micro-batch from cluster ``src`` to ``dst``: the mean pair's delay
        and the bandwidth that gives the mean pair's time."""
        n = len(src) * len(dst)
        alpha = sum(self.alpha_rows[i][j] for i in src for j in dst) / n
        total = sum(self.pair_rows[i][j] for i in src for j in dst) / n
        return Hop(alpha, self.t / (total - alpha)) if total > alpha else Hop(alpha, math.inf)

    def split_frontal_backward(
        self, cluster: frozenset, prev: frozenset | None, nxt: frozenset | None
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Step 4: a server is frontal when it is nearer (mean pair time) the previous stage than
        the next, else backward; an empty side takes the slowest server of the other. A lone
        server is both. A missing neighbour is infinitely far: the first stage's servers are all
        backward servers but its slowest, the last stage's all frontal but its slowest."""
        members = sorted(cluster)
        if len(members) == 1:
            return tuple(members), tuple(members)
        rows = self.pair_rows
        near_prev = {j: sum(rows[p][j] for p in prev) / len(prev) if prev else math.inf for j in members}
        near_next = {j: sum(rows[j][n] for n in nxt) / len(nxt) if nxt else math.inf for j in members}
        front = [j for j in members if near_prev[j] <= near_next[j]]
        back = [j for j in members if j not in front]
        if not back:
            slowest = min(front, key=lambda j: (self.cs[j], -j))
            front.remove(slowest)
            back.append(slowest)
        elif not front:
            slowest = min(back, key=lambda j: (self.cs[j], -j))
            back.remove(slowest)
            front.append(slowest)
        return tuple(front), tuple(sorted(back))

    def _clients_of(self, clusters: frozenset) -> dict[frozenset, tuple[int, ...]]:
        """Step 5: each client to the cluster with the smallest mean alpha + t/beta to its servers
        (ties to the cluster holding the lowest server)."""
        ranked = sorted(clusters, key=min)
        means = np.stack([self.client_cost[:, sorted(c)].mean(axis=1) for c in ranked], axis=1)
        pick = np.argmin(means, axis=1) if len(self.cu) else np.zeros(0, int)
        return {c: tuple(int(i) for i in np.flatnonzero(pick == k)) for k, c in enumerate(ranked)}

    def _server_hop(self, j: int, side: Sequence[int], incoming: bool) -> tuple[float, float]:
        """(delay, seconds per byte) of server j's hop from its nearest frontal server or to its
        nearest backward server; nothing when it is one itself."""
        if j in side:
            return 0.0, 0.0
        pair = self.pair_rows
        if incoming:
            f = min(side, key=lambda f: pair[f][j])
            return self.alpha_rows[f][j], 1.0 / self.beta_rows[f][j]
        b = min(side, key=lambda b: pair[j][b])
        return self.alpha_rows[j][b], 1.0 / self.beta_rows[j][b]

    def _stage_setup(
        self, prev: frozenset | None, cluster: frozenset, nxt: frozenset | None, clients: tuple[int, ...]
    ) -> tuple[float, list, list, list, list]:
        """A stage's boundary time and, per computing device, its fixed delay, seconds moved per
        sample, seconds per sample-layer and layer capacity (:meth:`stage_vector` turns them into
        times). A server computes between its nearest frontal and backward server (itself if it is one),
        a client between the frontal and backward server nearest it. The first stage's devices
        read their own data and the last stage's compute the loss where they are, so those hops
        are local; a device takes part only in layer counts it can hold."""
        front, back = self.split_frontal_backward(cluster, prev, nxt)
        a = self.inst.bytes_per_sample
        fixed, moved, inv, caps = [], [], [], []
        for j in sorted(cluster):
            if self.cs_list[j] > 0:
                a_in, s_in = self._server_hop(j, front, True) if prev else (0.0, 0.0)
                a_out, s_out = self._server_hop(j, back, False) if nxt else (0.0, 0.0)
                fixed.append(a_in + a_out)
                moved.append(a * (s_in + s_out))
                inv.append(1.0 / self.cs_list[j])
                caps.append(self.inst.capacity(True, j))
        for i in clients:
            cost, ua, ub = self.client_rows[i], self.ua_rows[i], self.ub_rows[i]
            f_in = min(front, key=lambda f: cost[f])
            b_out = min(back, key=lambda b: cost[b])
            fixed.append((ua[f_in] if prev else 0.0) + (ua[b_out] if nxt else 0.0))
            moved.append((a / ub[f_in] if prev else 0.0) + (a / ub[b_out] if nxt else 0.0))
            inv.append(1.0 / self.cu[i])
            caps.append(self.inst.capacity(False, i))
        edge = boundary_time(
            self.link(prev, cluster) if prev else None, self.link(nxt, cluster) if nxt else None, self.t
        )
        return edge, fixed, moved, inv, caps

    def _stage_vector(
        self, prev: frozenset | None, cluster: frozenset, nxt: frozenset | None, clients: tuple[int, ...]
    ) -> np.ndarray:
        """Boundary plus Eq. 1 time of a stage for 1..L layers (index h-1), shares balanced."""
        edge, fixed, moved, inv, caps = self.stage_setup(prev, cluster, nxt, clients)
        return edge + water_levels(fixed, moved, inv, self.inst.microbatch, self.inst.layers, caps)

    def stage_floor(
        self, prev: frozenset | None, cluster: frozenset, nxt: frozenset | None, clients: tuple[int, ...]
    ) -> float:
        """The stage's time with one layer: a bound no allocation goes below (the brute force's
        pruning needs only this, not the whole vector)."""
        edge, fixed, moved, inv, caps = self.stage_setup(prev, cluster, nxt, clients)
        return edge + float(water_levels(fixed, moved, inv, self.inst.microbatch, 1, caps)[0])

    def vectors(self, order: Sequence[frozenset]) -> list[np.ndarray]:
        """Per-stage time vectors (index h-1) of an ordered clustering, clients placed by step 5."""
        clusters = tuple(order)
        clients = self.clients_of(frozenset(clusters))
        return [
            self.stage_vector(
                clusters[k - 1] if k else None, c, clusters[k + 1] if k + 1 < len(clusters) else None, clients[c]
            )
            for k, c in enumerate(clusters)
        ]

    def compute_of(self, order: Sequence[frozenset]) -> list[float]:
        """Total compute of each stage: its servers' plus its clients'."""
        clients = self.clients_of(frozenset(order))
        return [float(self.cs[list(c)].sum() + self.cu[list(clients[c])].sum()) for c in order]

    def time(self, order: Sequence[frozenset], layers: Sequence[int]) -> float:
        """Eq. 2 of an ordered clustering with a layer allocation."""
        vecs = self.vectors(order)
        return self.inst.steps(len(vecs)) * max(float(v[h - 1]) for v, h in zip(vecs, layers))

    def partition(self, order: Sequence[frozenset], layers: Sequence[int]) -> Partition:
        """The plan as data: clusters with their frontal/backward servers, clients and layers."""
        order = list(order)
        clients = self.clients_of(frozenset(order))
        stages = []
        for k, c in enumerate(order):
            front, back = self.split_frontal_backward(
                c, order[k - 1] if k else None, order[k + 1] if k + 1 < len(order) else None
            )
            stages.append(Cluster(tuple(sorted(c)), front, back, clients[c], int(layers[k])))
        return Partition(tuple(stages), self.time(order, layers))
