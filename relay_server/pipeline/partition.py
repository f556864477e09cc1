"""The paper's partition search (heterogeneous-pipeline seed, section 3.3.3), for the general
setting of reliable servers S and unreliable clients U: a communication graph over S, divisive
clustering that adds a stage while the predicted pipeline time falls, an open-TSP order of the
clusters, frontal/backward servers per cluster, each client to its nearest cluster, layers in
proportion to cluster compute. In collabtrain's star this degenerates (one server holds every
boundary; :mod:`.star`), but the general form is what the paper claims, so it is kept exact and
checked against brute force (:mod:`.exhaustive`).

Where the paper is silent: a level of the clustering splits, by DIANA's splinter rule, whichever
cluster gives the lowest predicted time (the paper does not say which cluster to split); each level
is scored with Eq. 1-2 on the completed plan rather than Eq. 3 alone, because corrected Eq. 3 has
no term that falls with the number of stages (:mod:`.timemodel`); adjacent stages exchange through
all server pairs evenly (the section 3.2.1 segmentation), so a boundary costs the mean pair time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from relay_server.pipeline.ordering import open_tsp_anneal, open_tsp_dp
from relay_server.pipeline.timemodel import LOCAL, DeviceLoad, Hop, balanced_shares, boundary_time, stage_time


@dataclass(frozen=True)
class Instance:
    """Measured inputs: servers' compute (layer-samples/s, 0 for a server that only relays), delay
    (s) and bandwidth (bytes/s) between servers (``alpha[i][j]`` from i to j) and from each client
    to each server (symmetric), the model's layers, and the batch: ``microbatches`` (d) of
    ``microbatch`` samples with ``bytes_per_sample`` of activation at every boundary."""

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


class Evaluator:
    """Eq. 1-2 for one instance, with every per-stage quantity cached: the search and the brute
    force ask for the same (previous, cluster, next) triples many times."""

    def __init__(self, inst: Instance) -> None:
        self.inst = inst
        self.t = inst.microbatch_bytes
        self.cs = np.asarray(inst.server_compute, float)
        self.sa, self.sb = np.asarray(inst.server_alpha, float), np.asarray(inst.server_beta, float)
        self.cu = np.asarray(inst.client_compute, float)
        self.ua, self.ub = np.asarray(inst.client_alpha, float), np.asarray(inst.client_beta, float)
        self.pair = self.sa + self.t / self.sb
        np.fill_diagonal(self.pair, 0.0)
        self.stage_vector = lru_cache(maxsize=None)(self._stage_vector)
        self.clients_of = lru_cache(maxsize=None)(self._clients_of)

    def graph(self) -> np.ndarray:
        """Step 1: graph G over the servers, edge weight alpha_ij + alpha_ji + t/beta_ij + t/beta_ji."""
        return self.pair + self.pair.T

    def link(self, src: frozenset, dst: frozenset) -> Hop:
        """The hop of a whole micro-batch from cluster ``src`` to ``dst``: the mean pair's delay
        and the bandwidth that gives the mean pair's time."""
        pairs = [(i, j) for i in src for j in dst]
        alpha = sum(self.sa[i, j] for i, j in pairs) / len(pairs)
        total = sum(self.pair[i, j] for i, j in pairs) / len(pairs)
        return Hop(alpha, self.t / (total - alpha)) if total > alpha else Hop(alpha, math.inf)

    def split_frontal_backward(self, cluster: frozenset, prev: frozenset | None,
                               nxt: frozenset | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Step 4: a server is frontal when it is nearer (mean pair time) the previous stage than
        the next, else backward; an empty side takes the slowest server of the other. A lone
        server is both."""
        members = sorted(cluster)
        if len(members) == 1:
            return tuple(members), tuple(members)
        near_prev = {j: np.mean([self.pair[p, j] for p in prev]) if prev else 0.0 for j in members}
        near_next = {j: np.mean([self.pair[j, n] for n in nxt]) if nxt else 0.0 for j in members}
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

    def _clients_of(self, clusters: tuple[frozenset, ...]) -> tuple[tuple[int, ...], ...]:
        """Step 5: each client to the cluster with the smallest mean alpha + t/beta to its servers."""
        owned: list[list[int]] = [[] for _ in clusters]
        for i in range(len(self.cu)):
            cost = [np.mean([self.ua[i, j] + self.t / self.ub[i, j] for j in c]) for c in clusters]
            owned[int(np.argmin(cost))].append(i)
        return tuple(tuple(o) for o in owned)

    def _best_hop(self, alpha: np.ndarray, beta: np.ndarray, targets: Sequence[int]) -> Hop:
        best = min(targets, key=lambda j: alpha[j] + self.t / beta[j])
        return Hop(float(alpha[best]), float(beta[best]))

    def _stage_vector(self, prev: frozenset | None, cluster: frozenset, nxt: frozenset | None,
                      clients: tuple[int, ...]) -> np.ndarray:
        """Boundary plus Eq. 1 time of a stage for 1..L layers, shares balanced (water filling)."""
        front, back = self.split_frontal_backward(cluster, prev, nxt)
        devices = []
        for j in sorted(cluster):
            if self.cs[j] > 0:
                h_in = LOCAL if j in front else self._best_hop(self.sa[:, j], self.sb[:, j], front)
                h_out = LOCAL if j in back else self._best_hop(self.sa[j], self.sb[j], back)
                devices.append((float(self.cs[j]), h_in, h_out))
        for i in clients:
            devices.append((float(self.cu[i]), self._best_hop(self.ua[i], self.ub[i], front),
                            self._best_hop(self.ua[i], self.ub[i], back)))
        inst = self.inst
        edge = boundary_time(self.link(prev, cluster) if prev else None,
                             self.link(nxt, cluster) if nxt else None, self.t)
        out = np.full(inst.layers, math.inf)
        for h in range(1, inst.layers + 1):
            if devices:
                shares = balanced_shares(devices, inst.microbatch, h, inst.bytes_per_sample)
                loads = [DeviceLoad(s, c, hi, ho) for s, (c, hi, ho) in zip(shares, devices)]
                out[h - 1] = edge + stage_time(loads, h, inst.bytes_per_sample)
        return out

    def vectors(self, order: Sequence[frozenset]) -> list[np.ndarray]:
        """Per-stage time vectors (index h-1) of an ordered clustering, clients placed by step 5."""
        clusters = tuple(order)
        clients = self.clients_of(clusters)
        return [self.stage_vector(clusters[k - 1] if k else None, c,
                                  clusters[k + 1] if k + 1 < len(clusters) else None, clients[k])
                for k, c in enumerate(clusters)]

    def compute_of(self, order: Sequence[frozenset]) -> list[float]:
        """Total compute of each stage: its servers' plus its clients'."""
        clients = self.clients_of(tuple(order))
        return [float(self.cs[list(c)].sum() + self.cu[list(u)].sum()) for c, u in zip(order, clients)]

    def time(self, order: Sequence[frozenset], layers: Sequence[int]) -> float:
        """Eq. 2 of an ordered clustering with a layer allocation."""
        vecs = self.vectors(order)
        return self.inst.microbatches * max(float(v[h - 1]) for v, h in zip(vecs, layers))

    def partition(self, order: Sequence[frozenset], layers: Sequence[int]) -> Partition:
        """The plan as data: clusters with their frontal/backward servers, clients and layers."""
        order = list(order)
        clients = self.clients_of(tuple(order))
        stages = []
        for k, c in enumerate(order):
            front, back = self.split_frontal_backward(c, order[k - 1] if k else None,
                                                      order[k + 1] if k + 1 < len(order) else None)
            stages.append(Cluster(tuple(sorted(c)), front, back, clients[k], int(layers[k])))
        return Partition(tuple(stages), self.time(order, layers))


def allocate_layers(compute: Sequence[float], layers: int) -> list[int]:
    """Step 6: layers in proportion to compute by largest remainder, at least one per stage, summing
    to ``layers`` (the one-layer floor is taken first, the rest shared by compute)."""
    k = len(compute)
    if k > layers:
        raise ValueError(f"{k} stages need at least {k} layers; the model has {layers}")
    total = sum(compute)
    spare = layers - k
    quota = [spare * c / total if total > 0 else spare / k for c in compute]
    alloc = [1 + int(math.floor(q)) for q in quota]
    for i in sorted(range(k), key=lambda i: (-(quota[i] - math.floor(quota[i])), i))[: layers - sum(alloc)]:
        alloc[i] += 1
    return alloc


def diana_split(dist: np.ndarray, cluster: frozenset) -> tuple[frozenset, frozenset]:
    """Divisive analysis: the member farthest (mean distance) from the rest starts a splinter group,
    and members nearer the splinter group than the rest move to it while any is."""
    rest = set(cluster)
    seed = max(sorted(rest), key=lambda i: np.mean([dist[i, j] for j in rest if j != i]))
    splinter = {seed}
    rest.remove(seed)
    while len(rest) > 1:
        gain = {i: np.mean([dist[i, j] for j in rest if j != i]) - np.mean([dist[i, j] for j in splinter])
                for i in sorted(rest)}
        best = max(gain, key=lambda i: (gain[i], -i))
        if gain[best] <= 0:
            break
        splinter.add(best)
        rest.remove(best)
    return frozenset(rest), frozenset(splinter)


def order_clusters(ev: Evaluator, clusters: Sequence[frozenset], method: str, seed: int) -> list[frozenset]:
    """Step 3: the coarse graph H (mean edge weight between clusters) and its open TSP path."""
    g = ev.graph()
    k = len(clusters)
    coarse = np.zeros((k, k))
    for a in range(k):
        for b in range(k):
            if a != b:
                coarse[a, b] = np.mean([g[i, j] for i in clusters[a] for j in clusters[b]])
    path = open_tsp_dp(coarse)[0] if method == "dp" else open_tsp_anneal(coarse, seed=seed)[0]
    return [clusters[i] for i in path]


def plan_partition(inst: Instance, order: str = "dp", seed: int = 0) -> Partition:
    """Steps 1-6: split one cluster per level (the split with the lowest predicted time), order,
    place, allocate; stop at the first level whose time rises and return the level before it."""
    if order not in ("dp", "sa"):
        raise ValueError(f"order must be 'dp' or 'sa', not {order!r}")
    ev = Evaluator(inst)
    g = ev.graph()

    def complete(clusters: Sequence[frozenset]) -> tuple[float, list[frozenset], list[int]]:
        ordered = order_clusters(ev, clusters, order, seed)
        layers = allocate_layers(ev.compute_of(ordered), inst.layers)
        return ev.time(ordered, layers), ordered, layers

    best = complete([frozenset(range(len(inst.server_compute)))])
    while len(best[1]) < min(len(inst.server_compute), inst.layers):
        candidates = []
        for c in best[1]:
            if len(c) > 1:
                rest = [x for x in best[1] if x != c]
                candidates.append(complete(rest + list(diana_split(g, c))))
        nxt = min(candidates, key=lambda r: r[0])
        if nxt[0] > best[0]:
            break
        best = nxt
    return ev.partition(best[1], best[2])
