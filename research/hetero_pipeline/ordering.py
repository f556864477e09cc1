"""Stage order as an open travelling-salesman path (heterogeneous-pipeline seed, section 3.3.3 step
3): visit every cluster once, starting and ending anywhere, with the least total edge weight, so
that adjacent stages are the clusters nearest each other. Exact by dynamic programming over
subsets (Held-Karp, as DT-FM's scheduler does) up to :data:`DP_LIMIT` clusters; simulated annealing
for the paper's fidelity and for more clusters. Pure numpy; the brute force the tests compare both
with is :func:`research.hetero_pipeline.exhaustive.open_tsp_brute`."""

from __future__ import annotations

import math
import random
from typing import Iterator, Sequence

import numpy as np

DP_LIMIT = 12
"""Held-Karp holds 2^n * n partial paths: 49k at 12 clusters, instant; 20 would be 21M."""


def path_cost(dist: np.ndarray, path: Sequence[int]) -> float:
    """Total weight of the open path (no edge back to the start)."""
    return float(sum(dist[a, b] for a, b in zip(path, path[1:])))


def open_tsp_dp(dist: np.ndarray) -> tuple[list[int], float]:
    """The optimal open path by Held-Karp: ``best[S][j]`` is the cheapest path over the subset S
    ending at j, any start, filled one subset size at a time (each grown subset has exactly one
    predecessor per last node, so a size's updates never collide)."""
    d = np.asarray(dist, float)
    n = len(d)
    if n == 0:
        return [], 0.0
    if n > DP_LIMIT:
        raise ValueError(f"open_tsp_dp is exact up to {DP_LIMIT} clusters; use open_tsp_anneal for {n}")
    full = 1 << n
    best = np.full((full, n), math.inf)
    parent = np.full((full, n), -1, dtype=int)
    for j in range(n):
        best[1 << j, j] = 0.0
    subsets = np.arange(full)
    sizes = np.array([bin(x).count("1") for x in range(full)])
    for size in range(1, n):
        grown_from = subsets[sizes == size]
        via = best[grown_from][:, :, None] + d[None, :, :]
        arrive = np.argmin(via, axis=1)
        cost = np.take_along_axis(via, arrive[:, None, :], axis=1)[:, 0, :]
        for nxt in range(n):
            free = (grown_from >> nxt) & 1 == 0
            grown = grown_from[free] | (1 << nxt)
            best[grown, nxt] = cost[free, nxt]
            parent[grown, nxt] = arrive[free, nxt]
    end = int(np.argmin(best[full - 1]))
    path, subset = [end], full - 1
    while parent[subset, path[-1]] >= 0:
        prev = int(parent[subset, path[-1]])
        subset &= ~(1 << path[-1])
        path.append(prev)
    path.reverse()
    return path, float(best[full - 1, end])


def open_tsp_anneal(
    dist: np.ndarray, seed: int = 0, steps: int = 400, restarts: int = 5, start_temp: float | None = None
) -> tuple[list[int], float]:
    """Simulated annealing over 2-opt reversals and single moves, geometric cooling, a seeded RNG
    (the same seed gives the same path), each run polished by descent to a local optimum.
    Restarts from random paths keep the best; the paper gives no schedule, so the defaults are
    sized to reach within 1% of the optimum of 10 clusters almost always (tested)."""
    d = np.asarray(dist, float)
    n = len(d)
    if n <= 2:
        return list(range(n)), path_cost(d, list(range(n)))
    rng = random.Random(seed)
    rows = d.tolist()
    temp0 = start_temp if start_temp is not None else float(np.mean(d)) or 1.0
    best_path: list[int] = []
    best_cost = math.inf
    for _ in range(restarts):
        path = list(range(n))
        rng.shuffle(path)
        cost = path_cost(d, path)
        for step in range(steps):
            temp = temp0 * (1e-4 ** (step / steps))
            i, j = sorted(rng.sample(range(n), 2))
            if rng.random() < 0.5:
                cand = path[:i] + path[i : j + 1][::-1] + path[j + 1 :]
            else:
                cand = path[:i] + path[i + 1 :]
                cand.insert(j, path[i])
            new = sum(rows[a][b] for a, b in zip(cand, cand[1:]))
            if new <= cost or rng.random() < math.exp((cost - new) / temp):
                path, cost = cand, new
        path, cost = _descend(rows, path, cost)
        if cost < best_cost - 1e-15:
            best_path, best_cost = path, cost
    return best_path, best_cost


def path_neighbours(path: list) -> Iterator[list]:
    """Every 2-opt reversal and every single move of ``path``."""
    n = len(path)
    for i in range(n):
        for j in range(i + 1, n):
            yield path[:i] + path[i : j + 1][::-1] + path[j + 1 :]
            moved = path[:i] + path[i + 1 :]
            moved.insert(j, path[i])
            yield moved


def _descend(rows: list[list[float]], path: list[int], cost: float) -> tuple[list[int], float]:
    """Polish an annealed path: take improving neighbours until none is left (a local optimum)."""
    improved = True
    while improved:
        improved = False
        for cand in path_neighbours(path):
            new = sum(rows[a][b] for a, b in zip(cand, cand[1:]))
            if new < cost - 1e-12:
                path, cost, improved = cand, new, True
                break
    return path, cost
