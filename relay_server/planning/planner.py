"""The averaging plan: who computes, and which slice of the parameter vector each aggregator owns.

DeDLOC's adaptive averaging (paper section 3.2, Appendix B): from measured compute and bandwidth,
choose the roles that maximize optimizer steps per second. Depending on the swarm this recovers
butterfly all-reduce (equal peers), a parameter server (one fast peer) or a hybrid that beats both.
The relay solves it once and publishes it; peers never solve it (DESIGN section 11).

The paper's LP (Appendix B, eq. 5). Peer i computes ``s_i`` samples/s, uploads ``u_i`` and
downloads ``d_i`` bytes/s, ``t_ij`` optionally limits traffic i -> j; ``a_ki`` is the rate at which
k sends gradient parts to aggregator i, ``g_ij`` the rate at which aggregator i returns results to
j (here *updated parameters*: the aggregator applies the optimizer step, DESIGN section 3)::

    max xi  s.t.  xi <= sum_k s_k c_k / B;   xi <= sum_i g_ij / P   (every j that needs parameters)
                  g_ij <= a_ki + (1 - c_k) M_i   (all i, j, k);   c_k in [0, 1]
                  upload, download and pairwise budgets;   a, g >= 0

Two findings shape this module (demonstrated in tests/test_planner.py):

1. *The continuous relaxation of c is degenerate.* With ``c_k = 1 - eps`` the constraint above
   only asks ``a_ki >= g_ij - eps M_i``, and since an aggregator's result rate is a small part of
   its bandwidth (about 1/n of it in all-reduce), a small ``eps`` lets every peer keep almost all
   of its compute while sending no gradients at all. With the paper's own ``M_i = d_i``, 8 equal
   peers get ``c ~ 0.27`` for all, zero gradient traffic and a predicted throughput 3x above what
   all-reduce can physically do. "Computes" must be decided as a 0/1 choice.
2. *Eq. 5 lets an aggregator return results at different rates to different peers;* eq. 6 then
   turns the solution into contiguous slices, whose real speed is only ``sum_i min_j g_ij``.
   With c pinned and no pairwise limits the two agreed on every random swarm we tried; with
   pairwise limits eq. 5 overstated the sliced plan by up to 1.6x.

So ``solve_plan`` solves eq. 5 with the computing set C fixed (c in {0, 1}) and with eq. 6's
partition made explicit: aggregator i owns a fraction ``m_i / xi`` and serves it at rate ``m_i``
to every computing peer, and a computing k sends exactly ``a_ki = m_i``. For fixed C this is
*exactly* the best plan eq. 5 + eq. 6 can deploy (proof: uniformizing any eq. 5 solution down to
``m_i = min_j g_ij`` only lowers traffic; tested against the full LP). It has one variable per
aggregator: a peer computing and aggregating moves ``xi + (|C| - 2) m_i`` each way (its own part
is self-traffic, which is free), an aggregator that does not compute moves ``|C| m_i``, a client
``xi``. C is chosen by a search over the target rate: at rate xi a peer can compute only if
``min(u, d) >= xi``; among those, the fewest that reach the target batch rate (most samples/s
first; as a second try, peers that also aggregate first, since their own slice is free), because
every extra sender costs the aggregators bandwidth. For client-mode peers this is exact (they
all cost the aggregators the same; brute-force tested); with peers that also aggregate it is a
heuristic (on ~1000 random small swarms without pairwise limits: optimal on all but one, which
got 93%; with pairwise limits 2 of 350 missed, worst 75%). The shares are then spread so that
every aggregator keeps, as far as possible, the same fraction of its spare capacity free, instead
of whichever optimal vertex HiGHS returns first. The paper's relaxed LP is reproduced outside the
product as ``research.dedloc_lp.solve_plan_reference`` (literal O(n^3) or compact O(n^2) form,
proved equal in tests), for tests to compare this one with.

Semantics: aggregators are the peers with ``can_receive=True``; nothing exists for a
client-mode peer as aggregator, not even its own share. A peer with ``samples_per_s == 0`` (an
auxiliary server) needs no parameters back; nor does a peer that does not compute in this plan
(it sits the plan out and downloads the latest parameters when it is let back in, DESIGN section
3), so a slow-download peer can be left out instead of capping everyone. Self-traffic is free.

Units: LP units (rates in vectors/s over the fastest link), see :mod:`.problem`.

Errors: malformed input and swarms with no plan (nobody can receive, nobody computes, no
bandwidth) raise :class:`PlanError` saying what to change. No silent fallback: a wrong plan would
stall every round.

The package's modules, lowest first: :mod:`.problem` (inputs, :class:`PlanError`),
:mod:`.round_time` (seconds per round for any slicing), :mod:`.averaging_plan` (:class:`Plan` and
how a solution becomes one), :mod:`.highs` (HiGHS plumbing) and this one, the entry point.
"""

from __future__ import annotations

import logging
import math
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

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# The plan LP: eq. 5 with the computing set fixed and eq. 6's partition explicit


@dataclass(frozen=True)
class _Partition:
    """Traffic of aggregator x (each way, LP units) is ``k[x] m_x + own[x] xi``."""

    agg: np.ndarray  # [nA] aggregator peer indices; m_x is column 1 + position
    k: np.ndarray  # [nA] |C| - 2 [x computes]: m_x comes in from and goes out to the others
    own: np.ndarray  # [nA] 1.0 where x computes: it also sends xi - m_x and gets xi - m_x back
    cap: np.ndarray  # [nA] min(upload, download): traffic is the same both ways
    xi_ub: float  # compute of C, and the link of every computing client-mode peer
    pairs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # rows, m positions, coef, rhs


def _partition(prob: _Problem, chosen: np.ndarray) -> _Partition:
    """The partition LP's data for computing set ``chosen`` (peer indices)."""
    n_peers = len(prob.ids)
    comp = np.zeros(n_peers, bool)
    comp[chosen] = True
    agg = prob.aggregators
    link = np.minimum(prob.u, prob.d)
    clients = chosen[~prob.recv[chosen]]
    client_link = float(link[clients].min()) if clients.size else math.inf
    xi_ub = min(float(prob.s[chosen].sum()), client_link)
    own = comp[agg].astype(float)
    pos = np.full(n_peers, -1, np.int64)
    pos[agg] = np.arange(agg.size)
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    rhs: list[float] = []
    for (src, dst), limit in prob.pairs.items():
        terms = []
        if comp[src] and pos[dst] >= 0:  # src's gradient part for dst's slice
            terms.append(pos[dst])
        if pos[src] >= 0 and comp[dst]:  # src's slice of parameters for dst
            terms.append(pos[src])
        if terms:
            cols += terms
            rows += [len(rhs)] * len(terms)
            vals += [1.0] * len(terms)
            rhs.append(limit)
    pairs = (np.array(rows, np.int64), np.array(cols, np.int64), np.array(vals), np.array(rhs))
    return _Partition(agg, chosen.size - 2 * own, own, link[agg], xi_ub, pairs)


def _max_xi_closed(part: _Partition) -> float:
    """Phase 1 in closed form (no pairwise limits), for the search over computing sets.

    For a given xi, m_x can go up to (cap_x - own_x xi) / k_x where k_x > 0, and without limit
    where k_x <= 0 (its share costs it nothing: |C| <= 2 and it computes), so xi is feasible iff
    every computing aggregator with k_x >= 0 has xi <= cap_x and, when all k_x > 0,
    sum_x (cap_x - own_x xi) / k_x >= xi. Tested equal to :func:`_max_xi`.
    """
    bound = part.xi_ub
    lone = (part.own > 0) & (part.k >= 0)
    if lone.any():
        bound = min(bound, float(part.cap[lone].min()))
    if (part.k > 0).all():
        bound = min(bound, float((part.cap / part.k).sum() / (1.0 + (part.own / part.k).sum())))
    return max(bound, 0.0)


def _max_xi(part: _Partition) -> float:
    """Phase 1: the most steps/s this computing set allows (variables [xi, m_1..m_nA])."""
    n_agg = part.agg.size
    m = 1 + np.arange(n_agg)
    rows = SparseRows()
    rows.add(np.r_[np.arange(n_agg), np.arange(n_agg)], np.r_[m, np.zeros(n_agg)], np.r_[part.k, part.own], part.cap)
    p_rows, p_cols, p_vals, p_rhs = part.pairs
    rows.add(p_rows, 1 + p_cols, p_vals, p_rhs)
    a_ub, b_ub = rows.matrix(1 + n_agg)
    a_eq = sp.csr_array(
        (np.r_[-1.0, np.ones(n_agg)], (np.zeros(n_agg + 1, np.int64), np.arange(n_agg + 1))), shape=(1, 1 + n_agg)
    )  # sum_i m_i = xi
    ub = np.full(1 + n_agg, part.xi_ub)
    cost = np.zeros(1 + n_agg)
    cost[0] = -1.0
    return float(solve_lp(cost, a_ub, b_ub, np.zeros(1 + n_agg), ub, "plan", a_eq, np.zeros(1))[0])


def _spread(part: _Partition, xi: float) -> np.ndarray:
    """Phase 2: shares m at the optimal xi using the same fraction tau of every aggregator's
    spare capacity where possible (min tau with k_x m_x <= tau * spare_x), so the plan leaves
    headroom everywhere rather than whichever vertex HiGHS finds first.
    Variables [tau, m_1..m_nA]; returns m."""
    n_agg = part.agg.size
    spare = np.maximum(part.cap - part.own * xi, 0.0)
    rows = SparseRows()
    pos = np.flatnonzero(part.k > 0)
    rows.add(
        np.r_[np.arange(pos.size), np.arange(pos.size)],
        np.r_[1 + pos, np.zeros(pos.size)],
        np.r_[part.k[pos], -spare[pos]],
        np.zeros(pos.size),
    )
    neg = np.flatnonzero(part.k < 0)  # a lone computing aggregator: m_x >= xi - cap_x
    rows.add(np.arange(neg.size), 1 + neg, part.k[neg], part.cap[neg] - part.own[neg] * xi)
    p_rows, p_cols, p_vals, p_rhs = part.pairs
    rows.add(p_rows, 1 + p_cols, p_vals, p_rhs)
    a_ub, b_ub = rows.matrix(1 + n_agg)
    a_eq = sp.csr_array((np.ones(n_agg), (np.zeros(n_agg, np.int64), 1 + np.arange(n_agg))), shape=(1, 1 + n_agg))
    ub = np.r_[math.inf, np.full(n_agg, xi)]
    cost = np.zeros(1 + n_agg)
    cost[0] = 1.0
    return solve_lp(cost, a_ub, b_ub, np.zeros(1 + n_agg), ub, "share", a_eq, np.array([xi]))[1:]


def _choose_computing(prob: _Problem) -> tuple[np.ndarray, float]:
    """The computing set (sorted peer indices) and its steps/s (LP units).

    Search over the target rate xi: at xi, a free peer may compute only if min(u, d) >= xi (it
    sends xi - m and receives xi - m, m >= 0); take the fewest of them that reach compute xi,
    most samples/s first. Every client-mode peer costs the aggregators the same, so for them
    feasibility is monotone in xi and bisection finds the best rate. A peer that also
    aggregates is cheaper (its own slice is free), so a second order tries those first; and a
    lone computing aggregator needs no network at all. Every set met is kept as a candidate.
    """
    part = prob.participants
    on = part[prob.pin[part] == 1]
    free = part[prob.pin[part] == -1]
    values: dict[bytes, tuple[float, np.ndarray]] = {}

    def value(chosen: np.ndarray) -> float:
        key = chosen.tobytes()
        if key not in values:
            part_lp = _partition(prob, chosen)
            xi = _max_xi(part_lp) if part_lp.pairs[3].size else _max_xi_closed(part_lp)
            values[key] = (xi, chosen)
        return values[key][0]

    if free.size == 0:
        return on, value(on)
    link = np.minimum(prob.u, prob.d)
    by_speed = free[np.lexsort((free, -prob.s[free]))]  # most samples/s first, then id order
    orders = [by_speed, np.r_[by_speed[prob.recv[by_speed]], by_speed[~prob.recv[by_speed]]]]
    s_on = float(prob.s[on].sum())

    def feasible(xi: float) -> bool:
        for order in orders:
            elig = order[link[order] >= xi]
            need = xi - s_on
            count = 0 if need <= 0 else int(np.searchsorted(np.cumsum(prob.s[elig]), need * (1 - 1e-12))) + 1
            count = max(count, 0 if on.size else 1)
            if count <= elig.size and value(np.sort(np.r_[on, elig[:count]])) >= xi * (1 - 1e-9):
                return True
        return False

    value(np.sort(np.r_[on, free]))
    if on.size == 0:  # a lone computing aggregator keeps its whole slice: no traffic at all
        for x in free[prob.recv[free]]:
            value(np.array([x]))
    lo, hi = 0.0, (s_on + float(prob.s[free].sum())) * (1 + 1e-9)
    for _ in range(64):  # ~1e-9 relative; a set met twice costs nothing (cached)
        if hi - lo <= 1e-9 * hi:
            break
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if feasible(mid) else (lo, mid)
    # best rate; on a tie, more contributors (more compute headroom)
    xi, chosen = max(values.values(), key=lambda v: (v[0], v[1].size))
    logger.debug("computing set: %d of %d participants, %d sets tried", chosen.size, part.size, len(values))
    return chosen, xi


def solve_plan(
    peers: Sequence[PeerCapacity],
    num_params: int,
    target_batch: float,
    bytes_per_param: float = 4.0,
    pairwise: Pairwise | None = None,
) -> Plan:
    """The plan the relay publishes (see the module docstring). Raises :class:`PlanError`.

    ``plan.computing`` send a gradient slice to the owner of each slice in ``plan.slices()`` and
    download the updated slices; the other peers sit this plan out. Rates are in bytes/s and
    samples/s, ``pairwise`` maps (sender, receiver) to a bytes/s limit.
    """
    prob = _normalize(peers, num_params, target_batch, bytes_per_param, pairwise)
    _check_solvable(prob)
    chosen, _ = _choose_computing(prob)
    part = _partition(prob, chosen)
    xi = _max_xi(part)  # the search may use the closed form; the plan's xi comes from HiGHS
    if xi <= 1e-12:
        raise PlanError(
            "no plan makes progress: every aggregator or every computing peer has "
            "zero bandwidth; check the measured rates"
        )
    shares = _spread(part, xi)
    computes = np.zeros(len(prob.ids))
    computes[chosen] = 1.0
    return _make_plan(prob, xi, shares, computes, chosen, chosen)
