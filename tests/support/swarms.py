"""Swarms the plan-LP tests share: random and equal peers, whether a swarm has a plan at all, and the
best rate any 0/1 choice of computing peers reaches (a brute force over the planner's partition
LP), for tests/test_planner.py and tests/research/test_dedloc_lp.py."""

from __future__ import annotations

import itertools

import numpy as np

from relay_server.planning import planner as pm
from relay_server.planning import problem as pbm
from relay_server.planning.problem import PeerCapacity

MB = 1e6  # bytes/s


def random_swarm(
    rng: np.random.Generator, n: int, *, p_recv: float = 0.5, pins: bool = True, aux: bool = True
) -> list[PeerCapacity]:
    """n peers: links 1-1000 MB/s, compute 1-100 samples/s, some auxiliary (s = 0), some pinned."""
    peers = []
    for i in range(n):
        speed = 0.0 if aux and rng.random() < 0.15 else float(rng.uniform(1, 100))
        pin = None
        if pins and rng.random() < 0.3:
            pin = bool(rng.random() < 0.5) if speed > 0 else False
        peers.append(
            PeerCapacity(
                f"p{i}",
                speed,
                float(10 ** rng.uniform(6, 9)),
                float(10 ** rng.uniform(6, 9)),
                bool(rng.random() < p_recv),
                pin,
            )
        )
    return peers


def random_pairwise(rng: np.random.Generator, n: int) -> dict[tuple[str, str], float]:
    out = {}
    for _ in range(int(rng.integers(0, 4))):
        a, b = rng.choice(n, 2, replace=False)
        out[(f"p{a}", f"p{b}")] = float(10 ** rng.uniform(5, 9))
    return out


def equal_peers(n: int, computes: bool | None = True, speed: float = 100.0) -> list[PeerCapacity]:
    return [PeerCapacity(f"p{i}", speed, 125 * MB, 125 * MB, True, computes) for i in range(n)]


def solvable(peers: list[PeerCapacity]) -> bool:
    return any(p.can_receive for p in peers) and any(p.samples_per_s > 0 and p.computes is not False for p in peers)


def brute_force_best(prob: pbm._Problem) -> float:
    part = prob.participants
    on, free = part[prob.pin[part] == 1], part[prob.pin[part] == -1]
    best = 0.0
    for r in range(free.size + 1):
        for subset in itertools.combinations(free, r):
            chosen = np.sort(np.r_[on, np.array(subset, np.int64)]).astype(np.int64)
            if chosen.size:
                part = pm._partition(prob, chosen)
                best = max(best, pm._max_xi(part) if prob.pairs else pm._max_xi_closed(part))
    return best * prob.unit
