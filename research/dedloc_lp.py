"""DeDLOC's own LP (Appendix B), kept for reference; the relay never solves it.

Eq. 5 of the paper with continuous c, in its literal O(n^3) form and a compact O(n^2) one
(proved equal in tests), solved through :mod:`relay_server.planning.highs` like every plan LP;
:mod:`relay_server.planning.planner` explains why the published plan does not come from it, and
tests use it to check that the plan it does publish is exactly the best eq. 5 + eq. 6 can deploy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from relay_server.planning.averaging_plan import Plan, _make_plan
from relay_server.planning.highs import SparseRows, solve_lp
from relay_server.planning.problem import (
    Pairwise,
    PeerCapacity,
    PlanError,
    _check_solvable,
    _normalize,
    _Problem,
)

# c_k at or above this counts as "computes" in the relaxed reference LP (HiGHS tolerance ~1e-7).
COMPUTE_THRESHOLD = 1.0 - 1e-6


# --------------------------------------------------------------------------------------------
# The paper's LP (eq. 5, continuous c): literal O(n^3) and compact O(n^2) forms, for reference


@dataclass(frozen=True)
class _Layout:
    """Column of each eq. 5 variable; arrays over routes use sorted peer indices."""

    n_vars: int
    c_col: np.ndarray  # [n] column of c_k, -1 where c is fixed
    m_col: np.ndarray  # [n] column of m_i (compact form), else -1
    a_k: np.ndarray  # [na] sender of each gradient route k -> i (no a_ii: self-traffic is free)
    a_i: np.ndarray  # [na] its aggregator
    a_col: np.ndarray
    g_i: np.ndarray  # [nA * nR] aggregator of each result route i -> j, in blocks per aggregator
    g_j: np.ndarray  # receiver (a participant)
    g_col: np.ndarray
    agg: np.ndarray  # aggregator indices
    receivers: np.ndarray  # participant indices


def _make_layout(prob: _Problem, form: str) -> _Layout:
    n = len(prob.ids)
    agg, part = prob.aggregators, prob.participants
    col = 1  # column 0 is xi
    c_col = np.full(n, -1, np.int64)
    free = part[prob.pin[part] == -1]
    c_col[free] = col + np.arange(free.size)
    col += free.size
    m_col = np.full(n, -1, np.int64)
    if form == "compact":
        m_col[agg] = col + np.arange(agg.size)
        col += agg.size
    a_k, a_i = (x.ravel() for x in np.meshgrid(part, agg, indexing="ij"))
    keep = a_k != a_i
    a_k, a_i = a_k[keep], a_i[keep]
    a_col = col + np.arange(a_k.size)
    col += a_k.size
    g_i, g_j = (x.ravel() for x in np.meshgrid(agg, part, indexing="ij"))
    g_col = col + np.arange(g_i.size)
    col += g_i.size
    return _Layout(col, c_col, m_col, a_k, a_i, a_col, g_i, g_j, g_col, agg, part)


def _caps(prob: _Problem) -> tuple[np.ndarray, np.ndarray]:
    """Per-peer (result-rate cap, big-M), LP units. Useful g_ij is at most u_i (j != i) or
    xi_cap = sum s / B (j == i, free self-traffic), so with M_i = max(cap_i, d_i) a peer with
    c_k = 0 never binds, as the paper asks of its constant (its M_i = d_i fails that when an
    aggregator is the only one computing). The caps are variable bounds: no optimum changes."""
    cap = np.maximum(prob.u, prob.xi_cap)
    return cap, np.maximum(cap, prob.d)


def _build(prob: _Problem, lay: _Layout, form: str) -> tuple[sp.csr_array, np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``A x <= b`` and bounds of eq. 5; the caller adds the objective."""
    n = len(prob.ids)
    cap, big = _caps(prob)
    part, agg = lay.receivers, lay.agg
    rows = SparseRows()
    free = part[prob.pin[part] == -1]
    # xi <= sum_k s_k c_k (pinned-on peers are constants on the right-hand side)
    rows.add(
        np.zeros(free.size + 1),
        np.r_[0, lay.c_col[free]],
        np.r_[1.0, -prob.s[free]],
        prob.s[part[prob.pin[part] == 1]].sum(),
    )
    # xi <= sum_i g_ij for every participant j
    pos = np.full(n, -1, np.int64)
    pos[part] = np.arange(part.size)
    rows.add(
        np.r_[np.arange(part.size), pos[lay.g_j]],
        np.r_[np.zeros(part.size), lay.g_col],
        np.r_[np.ones(part.size), -np.ones(lay.g_col.size)],
        np.zeros(part.size),
    )
    # g_ij <= a_ki + (1 - c_k) M_i: literally, or through one rate m_i per aggregator
    if form == "literal":
        _triple_rows(rows, prob, lay, big)
    else:
        r = np.arange(lay.g_col.size)
        rows.add(
            np.r_[r, r],
            np.r_[lay.g_col, lay.m_col[lay.g_i]],
            np.r_[np.ones(r.size), -np.ones(r.size)],
            np.zeros(r.size),
        )
        free_k = lay.c_col[lay.a_k] >= 0
        r = np.arange(lay.a_col.size)
        rows.add(
            np.r_[r, r, r[free_k]],
            np.r_[lay.m_col[lay.a_i], lay.a_col, lay.c_col[lay.a_k[free_k]]],
            np.r_[np.ones(r.size), -np.ones(r.size), big[lay.a_i[free_k]]],
            np.where(free_k, big[lay.a_i], 0.0),
        )
    # upload and download budgets; self-traffic g_ii is in neither
    cross = lay.g_i != lay.g_j
    ones_a, ones_g = np.ones(lay.a_col.size), np.ones(int(cross.sum()))
    rows.add(np.r_[lay.a_k, lay.g_i[cross]], np.r_[lay.a_col, lay.g_col[cross]], np.r_[ones_a, ones_g], prob.u)
    rows.add(np.r_[lay.a_i, lay.g_j[cross]], np.r_[lay.a_col, lay.g_col[cross]], np.r_[ones_a, ones_g], prob.d)
    # pairwise limits: a_xy + g_xy <= t_xy
    a_at = {(int(k), int(i)): int(c) for k, i, c in zip(lay.a_k, lay.a_i, lay.a_col)}
    g_at = {(int(i), int(j)): int(c) for i, j, c in zip(lay.g_i, lay.g_j, lay.g_col)}
    for (src, dst), limit in prob.pairs.items():
        cols = [c for c in (a_at.get((src, dst)), g_at.get((src, dst))) if c is not None]
        if cols:
            rows.add(np.zeros(len(cols)), np.array(cols), 1.0, limit)
    lb, ub = np.zeros(lay.n_vars), np.zeros(lay.n_vars)
    ub[0] = prob.xi_cap
    ub[lay.c_col[lay.c_col >= 0]] = 1.0
    if form == "compact":
        ub[lay.m_col[agg]] = cap[agg]
    ub[lay.a_col] = np.minimum(prob.u[lay.a_k], prob.d[lay.a_i])
    ub[lay.g_col] = np.where(
        cross, np.minimum(np.minimum(prob.u[lay.g_i], prob.d[lay.g_j]), cap[lay.g_i]), cap[lay.g_i]
    )
    a_ub, b_ub = rows.matrix(lay.n_vars)
    return a_ub, b_ub, lb, ub


def _triple_rows(rows: SparseRows, prob: _Problem, lay: _Layout, big: np.ndarray) -> None:
    """The literal O(n^3) constraint g_ij <= a_ki + (1 - c_k) M_i, one row per (i, j, k)."""
    for i in lay.agg:
        g_cols = lay.g_col[lay.g_i == i]
        sel = lay.a_i == i
        a_cols, senders = lay.a_col[sel], lay.a_k[sel]
        gg, aa = (x.ravel() for x in np.meshgrid(g_cols, np.arange(a_cols.size), indexing="ij"))
        c_cols = lay.c_col[senders[aa]]
        free = c_cols >= 0
        r = np.arange(gg.size)
        rows.add(
            np.r_[r, r, r[free]],
            np.r_[gg, a_cols[aa], c_cols[free]],
            np.r_[np.ones(r.size), -np.ones(r.size), np.full(int(free.sum()), big[i])],
            np.where(free, big[i], 0.0),
        )


@dataclass(frozen=True)
class _Relaxed:
    """A solution of eq. 5. ``x`` in LP units; ``xi`` is phase 1's optimum."""

    prob: _Problem
    lay: _Layout
    x: np.ndarray
    xi: float


def _solve_relaxed(prob: _Problem, form: str, sliced: bool = True) -> _Relaxed:
    """Phase 1: max xi. With ``sliced``, phase 2 keeps xi and maximizes eq. 6's total
    sum_i min_j g_ij, since eq. 6 on an arbitrary optimal vertex can even be 0/0."""
    if form not in ("literal", "compact"):
        raise ValueError("form must be 'literal' or 'compact'")
    _check_solvable(prob)
    lay = _make_layout(prob, form)
    a_ub, b_ub, lb, ub = _build(prob, lay, form)
    cost = np.zeros(lay.n_vars)
    cost[0] = -1.0
    x = solve_lp(cost, a_ub, b_ub, lb, ub, "eq. 5")
    xi = float(x[0])
    if sliced and xi > 0:
        x = _max_sliced(prob, lay, a_ub, b_ub, lb, ub, xi * (1 - 1e-7))[0]
    return _Relaxed(prob, lay, x, xi)


def _served(lay: _Layout, x: np.ndarray) -> np.ndarray:
    """[nA] eq. 6's min_j g_ij per aggregator (LP units)."""
    return x[lay.g_col].reshape(lay.agg.size, lay.receivers.size).min(axis=1)


def _max_sliced(
    prob: _Problem, lay: _Layout, a_ub: sp.csr_array, b_ub: np.ndarray, lb: np.ndarray, ub: np.ndarray, xi_min: float
) -> tuple[np.ndarray, float]:
    """Max sum_i w_i, w_i <= g_ij for every receiver j, over eq. 5 solutions with xi >= xi_min:
    the fastest sliced plan among them. Returns (x without w, sum w)."""
    n_agg, nv = lay.agg.size, lay.n_vars
    w = nv + np.arange(n_agg)
    rows = SparseRows()
    r = np.arange(lay.g_col.size)
    rows.add(
        np.r_[r, r],
        np.r_[w[np.repeat(np.arange(n_agg), lay.receivers.size)], lay.g_col],
        np.r_[np.ones(r.size), -np.ones(r.size)],
        np.zeros(r.size),
    )
    extra, b_extra = rows.matrix(nv + n_agg)
    a2 = sp.vstack([sp.hstack([a_ub, sp.csr_array((a_ub.shape[0], n_agg))]), extra]).tocsr()
    cap, _ = _caps(prob)
    lb2, ub2 = np.r_[lb, np.zeros(n_agg)], np.r_[ub, cap[lay.agg]]
    lb2[0] = xi_min
    cost = np.r_[np.zeros(nv), -np.ones(n_agg)]
    x = solve_lp(cost, a2, np.r_[b_ub, b_extra], lb2, ub2, "sliced (phase 2)")
    return x[:nv], float(x[nv:].sum())


def solve_plan_reference(
    peers: Sequence[PeerCapacity],
    num_params: int,
    target_batch: float,
    bytes_per_param: float = 4.0,
    pairwise: Pairwise | None = None,
    form: str = "literal",
) -> Plan:
    """The paper's own LP (eq. 5 with continuous c, then eq. 6), literal O(n^3) rows or the
    compact O(n^2) form. For comparison and tests, small n only: its c is degenerate (see
    :mod:`relay_server.planning.planner`); ``steps_per_s`` is its xi, an upper bound, not a promise."""
    prob = _normalize(peers, num_params, target_batch, bytes_per_param, pairwise)
    sol = _solve_relaxed(prob, form)
    if sol.xi <= 1e-12:
        raise PlanError("the best plan makes no progress: check the measured rates")
    lay = sol.lay
    c = np.zeros(len(prob.ids))
    c[lay.receivers] = np.where(prob.pin[lay.receivers] == 1, 1.0, 0.0)
    free = lay.c_col >= 0
    c[free] = np.clip(sol.x[lay.c_col[free]], 0.0, 1.0)
    computing = np.flatnonzero(c >= COMPUTE_THRESHOLD)  # paper: c != 1 drops local gradients
    return _make_plan(prob, sol.xi, np.maximum(_served(lay, sol.x), 0.0), c, computing, lay.receivers)
