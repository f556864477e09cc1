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
from functools import lru_cache
from typing import Iterator, Sequence

import numpy as np

from relay_server.pipeline.partition import minmax_layers, plan_partition
from relay_server.pipeline.partition_model import Evaluator, Instance, Partition
from relay_server.pipeline.timemodel import boundary_time


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
            yield part[:i] + [[first] + part[i]] + part[i + 1:]
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

    A depth-first walk over ordered clusterings, pruned by a bound that never exceeds a stage's
    true time: its boundary transfers plus its layer on the compute of its servers and every
    client. The planner's plan (or ``incumbent``) is the first best; pruning only skips orders that cannot beat
    the best found, so the result is the exhaustive optimum."""
    ev = Evaluator(inst)
    plan = incumbent if incumbent is not None else plan_partition(inst)
    best = [plan.seconds_per_batch, [frozenset(c.servers) for c in plan.stages], [c.layers for c in plan.stages]]
    clients = float(ev.cu.sum())

    @lru_cache(maxsize=None)
    def bound(prev: frozenset | None, cur: frozenset, nxt: frozenset | None) -> float:
        edge = boundary_time(ev.link(prev, cur) if prev else None, ev.link(nxt, cur) if nxt else None, ev.t)
        power = float(ev.cs[list(cur)].sum()) + clients
        return inst.microbatches * (edge + (inst.microbatch / power if power > 0 else math.inf))

    def walk(order: list[frozenset], remaining: frozenset, floor: float) -> None:
        if not remaining:
            alloc, value = minmax_layers(ev.vectors(order), inst.layers)
            if value * inst.steps(len(order)) < best[0]:
                best[:] = [value * inst.steps(len(order)), list(order), alloc]
            return
        if len(order) == inst.layers:
            return
        members = sorted(remaining)
        for size in range(1, len(members) + 1):
            for chosen in itertools.combinations(members, size):
                nxt = frozenset(chosen)
                rest = remaining - nxt
                prev = order[-2] if len(order) > 1 else None
                low = max(floor, bound(prev, order[-1], nxt) if order else 0.0)
                if not rest:
                    low = max(low, bound(order[-1] if order else None, nxt, None))
                if low < best[0]:
                    walk(order + [nxt], rest, low)

    walk([], frozenset(range(len(inst.server_compute))), 0.0)
    return ev.partition(best[1], best[2])
