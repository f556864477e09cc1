"""DeDLOC's own LP (Appendix B, eq. 5 with continuous c), reproduced in ``research.dedloc_lp``: its
literal O(n^3) and compact O(n^2) forms agree and are feasible, it gives all-reduce on equal peers,
its relaxation of c is degenerate (why the relay's planner fixes c in {0, 1}), and the relay's
partition LP equals the best sliced plan it allows.

Random instances are seeded (deterministic). "Eq. 5" below is checked by an independent, plain
Python evaluation of the paper's constraints (``eq5_violation``), not by the code under test.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from relay_server.planning import planner as pm
from relay_server.planning import problem as pbm
from relay_server.planning.planner import solve_plan
from relay_server.planning.problem import PeerCapacity
from relay_server.planning.round_time import allreduce_round_s
from research import dedloc_lp as lpm
from research.dedloc_lp import solve_plan_reference
from tests.support.swarms import MB, brute_force_best, equal_peers, random_pairwise, random_swarm, solvable

REL = 1e-6  # HiGHS works to ~1e-7 on O(1) numbers


def as_dicts(sol: lpm._Relaxed) -> dict:
    """An eq. 5 solution in original units: xi steps/s, a and g bytes/s, keyed by peer id."""
    prob, lay, x = sol.prob, sol.lay, sol.x
    ids, rate = prob.ids, prob.unit * prob.vector_bytes
    c = {ids[k]: (1.0 if prob.pin[k] == 1 else float(x[lay.c_col[k]])) for k in lay.receivers}
    return {
        "xi": float(x[0]) * prob.unit,
        "c": c,
        "a": {(ids[k], ids[i]): float(x[col]) * rate for k, i, col in zip(lay.a_k, lay.a_i, lay.a_col)},
        "g": {(ids[i], ids[j]): float(x[col]) * rate for i, j, col in zip(lay.g_i, lay.g_j, lay.g_col)},
    }


def eq5_violation(peers: list[PeerCapacity], num_params: int, batch: float, pairwise: dict, sol: dict) -> float:
    """Largest violation of eq. 5 (our semantics, see planner docstring), relative to the
    fastest link; written from the paper's statement, independently of the LP builders."""
    vec = num_params * 4.0
    parts = [p for p in peers if p.samples_per_s > 0 and p.computes is not False]
    aggs = [p for p in peers if p.can_receive]
    scale = max(max(p.upload, p.download) for p in peers)
    xi_cap_bytes = sum(p.samples_per_s for p in parts) / batch * vec
    a, g, c, xi = sol["a"], sol["g"], sol["c"], sol["xi"]
    worst = [0.0]

    def le(lhs: float, rhs: float, unit: float = scale) -> None:
        worst.append((lhs - rhs) / unit)

    le(xi, sum(p.samples_per_s * c[p.peer_id] for p in parts) / batch, xi_cap_bytes / vec or 1)
    for j in parts:
        le(xi * vec, sum(g[(i.peer_id, j.peer_id)] for i in aggs))
    for i in aggs:
        big = max(i.download, i.upload, xi_cap_bytes)
        for j in parts:
            for k in parts:
                if k.peer_id != i.peer_id:
                    le(g[(i.peer_id, j.peer_id)], a[(k.peer_id, i.peer_id)] + (1 - c[k.peer_id]) * big)
    for p in peers:
        pid = p.peer_id
        le(
            sum(v for (s, r), v in a.items() if s == pid) + sum(v for (s, r), v in g.items() if s == pid and r != pid),
            p.upload,
        )
        le(
            sum(v for (s, r), v in a.items() if r == pid) + sum(v for (s, r), v in g.items() if r == pid and s != pid),
            p.download,
        )
    for (src, dst), limit in pairwise.items():
        le(a.get((src, dst), 0.0) + g.get((src, dst), 0.0), limit)
    worst += [-v / scale for v in itertools.chain(a.values(), g.values())]
    worst += [-v for v in c.values()] + [v - 1 for v in c.values()]
    return max(worst)


def test_literal_and_compact_eq5_have_equal_optimum_and_both_solutions_are_feasible():
    rng = np.random.default_rng(0)
    checked = 0
    while checked < 40:
        n = int(rng.integers(1, 7))
        peers, pairwise = random_swarm(rng, n), random_pairwise(rng, n) if n > 1 else {}
        if not solvable(peers):
            continue
        params, batch = int(10 ** rng.uniform(6, 8)), float(rng.uniform(50, 2000))
        prob = pbm._normalize(peers, params, batch, 4.0, pairwise)
        literal = lpm._solve_relaxed(prob, "literal", sliced=False)
        compact = lpm._solve_relaxed(prob, "compact", sliced=False)
        assert compact.xi == pytest.approx(literal.xi, rel=REL, abs=1e-9), (checked, peers)
        for sol in (literal, compact):
            assert eq5_violation(peers, params, batch, pairwise, as_dicts(sol)) < 1e-6
        # the literal solution with m_i = min_j g_ij satisfies the compact rows m_i <= a_ki + ...
        lit = as_dicts(literal)
        for i in (p for p in peers if p.can_receive):
            parts = [p.peer_id for p in peers if p.samples_per_s > 0 and p.computes is not False]
            m_i = min(lit["g"][(i.peer_id, j)] for j in parts)
            big = max(
                i.download, i.upload, sum(p.samples_per_s for p in peers if p.peer_id in parts) / batch * params * 4
            )
            for k in parts:
                if k != i.peer_id:
                    slack = lit["a"][(k, i.peer_id)] + (1 - lit["c"][k]) * big - m_i
                    assert slack > -1e-6 * max(big, 1.0)
        checked += 1


def test_reference_plan_from_the_paper_lp():
    """With c pinned the paper's LP is sound: equal peers -> butterfly all-reduce, in both forms."""
    peers = equal_peers(4)
    literal = solve_plan_reference(peers, 25_600_000, 1.0, form="literal")
    compact = solve_plan_reference(peers, 25_600_000, 1.0, form="compact")
    assert literal.steps_per_s == pytest.approx(compact.steps_per_s, rel=REL)
    assert literal.fractions == pytest.approx(dict.fromkeys(literal.fractions, 0.25), abs=1e-6)
    assert len(literal.fractions) == 4
    assert literal.steps_per_s == pytest.approx(1 / allreduce_round_s(peers, 25_600_000), rel=REL)
    with pytest.raises(ValueError):
        solve_plan_reference(peers, 10, 1.0, form="nope")


def test_paper_relaxation_of_c_is_degenerate():
    """Why solve_plan fixes c in {0, 1}: with continuous c, 8 equal peers 'compute' partly,
    send no gradients and claim far more than all-reduce can physically do."""
    peers = [PeerCapacity(f"p{i}", 1000.0, 125 * MB, 125 * MB, True) for i in range(8)]
    prob = pbm._normalize(peers, 25_600_000, 1000, 4.0, None)
    sol = lpm._solve_relaxed(prob, "compact", sliced=False)
    sent = as_dicts(sol)["a"]
    assert max(sent.values()) < 1e-6 * 125 * MB  # no gradient traffic at all
    assert all(c < 0.9 for c in as_dicts(sol)["c"].values())
    best = brute_force_best(prob)  # the best any 0/1 choice of computing peers can do
    assert sol.xi * prob.unit > 1.5 * best
    assert solve_plan(peers, 25_600_000, 1000).steps_per_s == pytest.approx(best, rel=REL)


def test_partition_lp_equals_best_sliced_eq5_plan():
    """For a fixed computing set C, the one-variable-per-aggregator LP gives exactly the best
    rate any eq. 5 solution achieves once eq. 6 slices it (sum_i min_j g_ij, capped by C's
    compute)."""
    rng = np.random.default_rng(1)
    checked = 0
    while checked < 30:
        n = int(rng.integers(1, 7))
        peers, pairwise = random_swarm(rng, n, pins=False), random_pairwise(rng, n) if n > 1 else {}
        if not solvable(peers):
            continue
        computing = {p.peer_id for p in peers if p.samples_per_s > 0 and rng.random() < 0.7}
        if not computing:
            continue
        pinned = [
            PeerCapacity(
                p.peer_id,
                p.samples_per_s,
                p.upload,
                p.download,
                p.can_receive,
                p.peer_id in computing if p.samples_per_s > 0 else None,
            )
            for p in peers
        ]
        prob = pbm._normalize(pinned, 10_000_000, 500.0, 4.0, pairwise)
        chosen = np.flatnonzero([pid in computing for pid in prob.ids])
        fast = pm._max_xi(pm._partition(prob, chosen))
        lay = lpm._make_layout(prob, "compact")
        a_ub, b_ub, lb, ub = lpm._build(prob, lay, "compact")
        _, sliced = lpm._max_sliced(prob, lay, a_ub, b_ub, lb, ub, 0.0)
        assert fast == pytest.approx(min(prob.xi_cap, sliced), rel=1e-5, abs=1e-9), checked
        checked += 1
