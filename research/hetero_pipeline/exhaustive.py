"""Brute-force references for the planner: what the heuristics of :mod:`.ordering` and
:mod:`.partition` are measured against on small instances. Exponential on purpose; nothing on the
relay's path calls them.

:func:`brute_force_partition` enumerates every number of stages, every clustering of the servers
into that many stages and every order of them, and for each takes the best layer allocation.
The allocation is exact without enumerating compositions: every stage's time is nondecreasing in
its layers, so adding layers one at a time to the stage that stays fastest reaches the least
possible maximum (:func:`minmax_layers`; :func:`best_layers_by_enumeration` is the literal
enumeration it is tested against). Frontal/backward servers and clients are placed by the
paper's rules (steps 4 and 5) in both the brute force and the planner, so the comparison measures
the planner's clustering, ordering and allocation, the three searches the paper makes."""

from __future__ import annotations

import itertools
import math
from typing import Iterator, Sequence

import numpy as np

from research.hetero_pipeline.partition import minmax_layers, plan_partition
from research.hetero_pipeline.partition_model import Instance, Partition, PartitionEvaluator


def open_tsp_brute(dist: np.ndarray) -> tuple[list[int], float]:
    """The optimal open path by trying every permutation (n <= 9 is practical)."""
    d = np.asarray(dist, float)
    n = len(d)
    if n <= 1:
        return list(range(n)), 0.0
    perms = np.array(list(itertools.permutations(range(n))))
    costs = d[perms[:, :-1], perms[:, 1:]].sum(axis=1)
    best = int(np.argmin(costs))
    return perms[best].tolist(), float(costs[best])


def set_partitions(items: Sequence[int]) -> Iterator[list[list[int]]]:
    """Every partition of ``items`` into non-empty blocks (Bell(n) of them)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1 :]
        yield [[first]] + part


def best_layers_by_enumeration(vectors: Sequence[np.ndarray], layers: int) -> tuple[list[int], float]:
    """:func:`minmax_layers` the slow way: every composition of ``layers`` into ``len(vectors)``
    positive parts."""
    k = len(vectors)
    best: tuple[list[int], float] = ([], math.inf)
    for cuts in itertools.combinations(range(1, layers), k - 1):
        alloc = [b - a for a, b in zip((0,) + cuts, cuts + (layers,))]
        value = max(float(v[h - 1]) for v, h in zip(vectors, alloc))
        if value < best[1]:
            best = (alloc, value)
    return best


def brute_force_partition(inst: Instance, incumbent: Partition | None = None) -> Partition:
    """The optimum over stages, clusterings, orders and layer allocations (see the module
    docstring for what is enumerated and what follows the paper's rules).

    Every clustering, and for each a depth-first walk over its orders, pruned when the stages
    placed so far already cost at least the best plan found with one layer each (a stage's time
    never falls with more layers, so the bound never exceeds the true time). The planner's plan
    (or ``incumbent``) is the first best; pruning only skips orders that cannot beat the best
    found, so the result is the exhaustive optimum."""
    ev = PartitionEvaluator.of(inst)
    plan = incumbent if incumbent is not None else plan_partition(inst)
    best = [plan.seconds_per_batch, [frozenset(c.servers) for c in plan.stages], [c.layers for c in plan.stages]]

    def walk(order: list[frozenset], rest: list[frozenset], clients: dict, steps: int, floor: float) -> None:
        if not rest:
            last = ev.stage_floor(order[-2] if len(order) > 1 else None, order[-1], None, clients[order[-1]])
            if max(floor, steps * last) >= best[0]:
                return
            alloc, value = minmax_layers(ev.vectors(order), inst.layers)
            if value * steps < best[0]:
                best[:] = [value * steps, list(order), alloc]
            return
        for i, nxt in enumerate(rest):
            low = floor
            if order:
                prev = order[-2] if len(order) > 1 else None
                low = max(low, steps * ev.stage_floor(prev, order[-1], nxt, clients[order[-1]]))
            if low < best[0]:
                walk(order + [nxt], rest[:i] + rest[i + 1 :], clients, steps, low)

    for part in set_partitions(list(range(len(inst.server_compute)))):
        if len(part) <= inst.layers:
            blocks = [frozenset(b) for b in part]
            walk([], blocks, ev.clients_of(frozenset(blocks)), inst.steps(len(blocks)), 0.0)
    return ev.partition(best[1], best[2])
