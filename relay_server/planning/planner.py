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
of whichever optimal vertex HiGHS returns first. The paper's relaxed LP stays available as
:func:`solve_plan_reference` (literal O(n^3) or compact O(n^2) form, proved equal in tests).

Semantics (issue 3): aggregators are the peers with ``can_receive=True``; nothing exists for a
client-mode peer as aggregator, not even its own share. A peer with ``samples_per_s == 0`` (an
auxiliary server) needs no parameters back; nor does a peer that does not compute in this plan
(it sits the plan out and downloads the latest parameters when it is let back in, DESIGN section
3), so a slow-download peer can be left out instead of capping everyone. Self-traffic is free.

Units: inside the LPs every rate is in vectors per second (bytes/s over ``num_params *
bytes_per_param``; compute as steps/s = samples/s / B), divided by the fastest link so all
matrix coefficients are O(1) (bytes/s near 1e8 against P near 1e8 would leave HiGHS comparing
numbers 16 orders apart; compute only bounds xi). ``Plan.steps_per_s`` is in steps/s,
``predicted_round_s`` in seconds.

Errors: malformed input and swarms with no plan (nobody can receive, nobody computes, no
bandwidth) raise :class:`PlanError` saying what to change. No silent fallback: a wrong plan would
stall every round.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

logger = logging.getLogger(__name__)

Pairwise = Mapping[tuple[str, str], float]

# c_k at or above this counts as "computes" in the relaxed reference LP (HiGHS tolerance ~1e-7).
COMPUTE_THRESHOLD = 1.0 - 1e-6
# Shares below this fraction of the total are solver noise, not a role.
_MIN_SHARE = 1e-9


class PlanError(ValueError):
    """No valid plan for these inputs; the message says which input to change."""


@dataclass(frozen=True)
class PeerCapacity:
    """One peer as the planner sees it: measured compute and link rates.

    ``upload``/``download`` in bytes/s. ``can_receive=False`` is a client-mode peer (behind NAT):
    it can never aggregate. ``computes`` None lets the planner choose; True/False pins it.
    """

    peer_id: str
    samples_per_s: float
    upload: float
    download: float
    can_receive: bool
    computes: bool | None = None


@dataclass(frozen=True)
class Plan:
    """A solved plan. ``aggregators`` (sorted by peer id) is also the order of the contiguous
    slices, so every process derives the same slices from the same plan."""

    steps_per_s: float
    fractions: dict[str, float]  # aggregator -> share of the vector, sums to 1
    computes: dict[str, float]  # every peer -> c_i
    version: str
    num_params: int
    predicted_round_s: float  # averaging seconds per round (time model below)
    aggregators: tuple[str, ...] = field(default=())
    computing: tuple[str, ...] = field(default=())  # peers that send gradients and get parameters

    def slices(self, num_params: int | None = None) -> list[tuple[str, int, int]]:
        """``(peer_id, start, end)`` half-open ranges covering ``[0, num_params)`` with no gaps;
        sizes from ``fractions`` by largest remainder (exact integer sum). Empty slices are
        left out."""
        n = self.num_params if num_params is None else int(num_params)
        if n < 0:
            raise PlanError(f"num_params must be >= 0, got {n}")
        sizes = _apportion(n, [self.fractions[p] for p in self.aggregators])
        out, start = [], 0
        for peer_id, size in zip(self.aggregators, sizes):
            if size:
                out.append((peer_id, start, start + size))
                start += size
        return out

    def to_dict(self) -> dict:
        """JSON-ready form for the API and the dashboard."""
        return {
            "version": self.version,
            "steps_per_s": self.steps_per_s,
            "predicted_round_s": self.predicted_round_s,
            "num_params": self.num_params,
            "aggregators": list(self.aggregators),
            "fractions": dict(self.fractions),
            "computes": dict(self.computes),
            "computing": list(self.computing),
            "slices": [list(s) for s in self.slices()],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, allow_nan=False)


# --------------------------------------------------------------------------------------------
# Input normalization


@dataclass(frozen=True)
class _Problem:
    """Validated inputs in LP units (see module docstring). Arrays are indexed like ``ids``."""

    ids: tuple[str, ...]  # sorted peer ids
    peers: tuple[PeerCapacity, ...]  # same order
    s: np.ndarray  # [n] steps/s each peer adds when computing (s_i / B), LP units
    u: np.ndarray  # [n] upload, LP units
    d: np.ndarray  # [n] download, LP units
    recv: np.ndarray  # [n] bool, may aggregate
    pin: np.ndarray  # [n] int8: -1 free, 0 pinned off, 1 pinned on
    pairs: dict[tuple[int, int], float]  # (sender idx, receiver idx) -> limit, LP units
    unit: float  # one LP rate unit in vectors/s (= steps/s)
    vector_bytes: float
    num_params: int
    target_batch: float
    bytes_per_param: float
    pairwise_raw: tuple[tuple[str, str, float], ...]

    @property
    def aggregators(self) -> np.ndarray:
        return np.flatnonzero(self.recv)

    @property
    def participants(self) -> np.ndarray:
        return np.flatnonzero((self.s > 0) & (self.pin != 0))

    @property
    def xi_cap(self) -> float:
        return float(self.s[self.participants].sum())


def _finite_nonneg(value: float, what: str) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise PlanError(f"{what} must be a finite number >= 0, got {value!r}")
    return value


def _normalize(peers: Sequence[PeerCapacity], num_params: int, target_batch: float,
               bytes_per_param: float, pairwise: Pairwise | None) -> _Problem:
    if not peers:
        raise PlanError("no peers: a plan needs at least one peer")
    if int(num_params) != num_params or num_params < 1:
        raise PlanError(f"num_params must be a positive integer, got {num_params!r}")
    for what, value in (("target_batch", target_batch), ("bytes_per_param", bytes_per_param)):
        if not (math.isfinite(float(value)) and value > 0):
            raise PlanError(f"{what} must be a finite number > 0, got {value!r}")
    ordered = sorted(peers, key=lambda p: p.peer_id)
    ids = tuple(p.peer_id for p in ordered)
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise PlanError(f"duplicate peer ids: {dup[:5]}")
    for p in ordered:
        for what in ("samples_per_s", "upload", "download"):
            _finite_nonneg(getattr(p, what), f"{p.peer_id}.{what}")
        if p.computes is True and p.samples_per_s == 0:
            raise PlanError(f"{p.peer_id} is pinned computes=True but has samples_per_s == 0")
    vector_bytes = float(num_params) * float(bytes_per_param)
    s = np.array([p.samples_per_s for p in ordered], float) / float(target_batch)
    u = np.array([p.upload for p in ordered], float) / vector_bytes
    d = np.array([p.download for p in ordered], float) / vector_bytes
    pin = np.array([-1 if p.computes is None else int(p.computes) for p in ordered], np.int8)
    index = {pid: k for k, pid in enumerate(ids)}
    pairs_raw: dict[tuple[int, int], float] = {}  # bytes/s
    for (src, dst), limit in sorted((pairwise or {}).items()):
        if src not in index or dst not in index:
            raise PlanError(f"pairwise limit {(src, dst)} names an unknown peer")
        if src == dst:
            raise PlanError(f"pairwise limit {(src, dst)}: self-traffic is free, drop it")
        pairs_raw[(index[src], index[dst])] = _finite_nonneg(limit, f"pairwise{(src, dst)}")
    # One LP unit = the fastest link (compute enters only as a bound on xi, whatever its size;
    # scaling by it would push every link below HiGHS's 1e-7 tolerance when compute is huge).
    links = np.concatenate([u, d, np.array(list(pairs_raw.values())) / vector_bytes])
    unit = float(links.max()) if links.size else 0.0
    if unit <= 0:
        unit = float(s[(s > 0) & (pin != 0)].sum())
    if unit <= 0:
        raise PlanError("every rate is zero: no compute and no bandwidth measured yet")
    return _Problem(
        ids=ids, peers=tuple(ordered), s=s / unit, u=u / unit, d=d / unit,
        recv=np.array([p.can_receive for p in ordered], bool), pin=pin,
        pairs={k: v / vector_bytes / unit for k, v in pairs_raw.items()}, unit=unit,
        vector_bytes=vector_bytes, num_params=int(num_params), target_batch=float(target_batch),
        bytes_per_param=float(bytes_per_param),
        pairwise_raw=tuple((ids[a], ids[b], t) for (a, b), t in pairs_raw.items()),
    )


def _check_solvable(prob: _Problem) -> None:
    if not prob.recv.any():
        raise PlanError("no peer can receive connections, so nobody can aggregate: start the relay "
                        "or an aggregator server with a reachable address")
    if prob.participants.size == 0:
        raise PlanError("no peer computes (all have samples_per_s == 0 or are pinned "
                        "computes=False): wait for a peer with an accelerator")


# --------------------------------------------------------------------------------------------
# LP plumbing


def _linprog(cost: np.ndarray, a_ub: sp.csr_array, b_ub: np.ndarray, lb: np.ndarray,
             ub: np.ndarray, what: str, a_eq: sp.csr_array | None = None,
             b_eq: np.ndarray | None = None) -> np.ndarray:
    # Dual simplex with HiGHS defaults: serial and deterministic (same inputs, same vertex).
    res = linprog(cost, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq,
                  bounds=np.column_stack([lb, ub]), method="highs-ds")
    if res.status != 0 or res.x is None:
        raise PlanError(f"the {what} LP failed ({res.status}: {res.message}); the inputs are "
                        "probably degenerate (check for zero or absurd bandwidths)")
    return np.asarray(res.x)


class _Rows:
    """Accumulates ``A x <= b`` (or ``= b``) as COO triplets, one block of rows at a time."""

    def __init__(self) -> None:
        self.r: list[np.ndarray] = []
        self.c: list[np.ndarray] = []
        self.v: list[np.ndarray] = []
        self.b: list[np.ndarray] = []
        self.count = 0

    def add(self, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray | float,
            rhs: np.ndarray | float) -> None:
        """``rows`` index into this block (0 .. len(rhs)-1)."""
        rows, cols = np.asarray(rows, np.int64), np.asarray(cols, np.int64)
        self.r.append(rows + self.count)
        self.c.append(cols)
        self.v.append(np.broadcast_to(np.asarray(vals, float), rows.shape))
        rhs = np.atleast_1d(np.asarray(rhs, float))
        self.b.append(rhs)
        self.count += rhs.size

    def matrix(self, n_vars: int) -> tuple[sp.csr_array, np.ndarray]:
        if not self.r:
            return sp.csr_array((0, n_vars)), np.zeros(0)
        a = sp.coo_array((np.concatenate(self.v), (np.concatenate(self.r), np.concatenate(self.c))),
                         shape=(self.count, n_vars))
        return a.tocsr(), np.concatenate(self.b)


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
    rows, cols, vals, rhs = [], [], [], []
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
    rows = _Rows()
    rows.add(np.r_[np.arange(n_agg), np.arange(n_agg)], np.r_[m, np.zeros(n_agg)],
             np.r_[part.k, part.own], part.cap)
    p_rows, p_cols, p_vals, p_rhs = part.pairs
    rows.add(p_rows, 1 + p_cols, p_vals, p_rhs)
    a_ub, b_ub = rows.matrix(1 + n_agg)
    a_eq = sp.csr_array((np.r_[-1.0, np.ones(n_agg)], (np.zeros(n_agg + 1, np.int64),
                         np.arange(n_agg + 1))), shape=(1, 1 + n_agg))  # sum_i m_i = xi
    ub = np.full(1 + n_agg, part.xi_ub)
    cost = np.zeros(1 + n_agg)
    cost[0] = -1.0
    return float(_linprog(cost, a_ub, b_ub, np.zeros(1 + n_agg), ub, "plan", a_eq, np.zeros(1))[0])


def _spread(part: _Partition, xi: float) -> np.ndarray:
    """Phase 2: shares m at the optimal xi using the same fraction tau of every aggregator's
    spare capacity where possible (min tau with k_x m_x <= tau * spare_x), so the plan leaves
    headroom everywhere rather than whichever vertex HiGHS finds first.
    Variables [tau, m_1..m_nA]; returns m."""
    n_agg = part.agg.size
    spare = np.maximum(part.cap - part.own * xi, 0.0)
    rows = _Rows()
    pos = np.flatnonzero(part.k > 0)
    rows.add(np.r_[np.arange(pos.size), np.arange(pos.size)], np.r_[1 + pos, np.zeros(pos.size)],
             np.r_[part.k[pos], -spare[pos]], np.zeros(pos.size))
    neg = np.flatnonzero(part.k < 0)  # a lone computing aggregator: m_x >= xi - cap_x
    rows.add(np.arange(neg.size), 1 + neg, part.k[neg], part.cap[neg] - part.own[neg] * xi)
    p_rows, p_cols, p_vals, p_rhs = part.pairs
    rows.add(p_rows, 1 + p_cols, p_vals, p_rhs)
    a_ub, b_ub = rows.matrix(1 + n_agg)
    a_eq = sp.csr_array((np.ones(n_agg), (np.zeros(n_agg, np.int64), 1 + np.arange(n_agg))),
                        shape=(1, 1 + n_agg))
    ub = np.r_[math.inf, np.full(n_agg, xi)]
    cost = np.zeros(1 + n_agg)
    cost[0] = 1.0
    return _linprog(cost, a_ub, b_ub, np.zeros(1 + n_agg), ub, "share", a_eq, np.array([xi]))[1:]


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
            count = 0 if need <= 0 else int(np.searchsorted(np.cumsum(prob.s[elig]),
                                                            need * (1 - 1e-12))) + 1
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
    logger.debug("computing set: %d of %d participants, %d sets tried", chosen.size, part.size,
                 len(values))
    return chosen, xi


def solve_plan(peers: Sequence[PeerCapacity], num_params: int, target_batch: float,
               bytes_per_param: float = 4.0, pairwise: Pairwise | None = None) -> Plan:
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
        raise PlanError("no plan makes progress: every aggregator or every computing peer has "
                        "zero bandwidth; check the measured rates")
    shares = _spread(part, xi)
    computes = np.zeros(len(prob.ids))
    computes[chosen] = 1.0
    return _make_plan(prob, xi, shares, computes, chosen, chosen)


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


def _build(prob: _Problem, lay: _Layout, form: str) -> tuple[sp.csr_array, np.ndarray,
                                                              np.ndarray, np.ndarray]:
    """Rows ``A x <= b`` and bounds of eq. 5; the caller adds the objective."""
    n = len(prob.ids)
    cap, big = _caps(prob)
    part, agg = lay.receivers, lay.agg
    rows = _Rows()
    free = part[prob.pin[part] == -1]
    # xi <= sum_k s_k c_k (pinned-on peers are constants on the right-hand side)
    rows.add(np.zeros(free.size + 1), np.r_[0, lay.c_col[free]], np.r_[1.0, -prob.s[free]],
             prob.s[part[prob.pin[part] == 1]].sum())
    # xi <= sum_i g_ij for every participant j
    pos = np.full(n, -1, np.int64)
    pos[part] = np.arange(part.size)
    rows.add(np.r_[np.arange(part.size), pos[lay.g_j]], np.r_[np.zeros(part.size), lay.g_col],
             np.r_[np.ones(part.size), -np.ones(lay.g_col.size)], np.zeros(part.size))
    # g_ij <= a_ki + (1 - c_k) M_i: literally, or through one rate m_i per aggregator
    if form == "literal":
        _triple_rows(rows, prob, lay, big)
    else:
        r = np.arange(lay.g_col.size)
        rows.add(np.r_[r, r], np.r_[lay.g_col, lay.m_col[lay.g_i]],
                 np.r_[np.ones(r.size), -np.ones(r.size)], np.zeros(r.size))
        free_k = lay.c_col[lay.a_k] >= 0
        r = np.arange(lay.a_col.size)
        rows.add(np.r_[r, r, r[free_k]],
                 np.r_[lay.m_col[lay.a_i], lay.a_col, lay.c_col[lay.a_k[free_k]]],
                 np.r_[np.ones(r.size), -np.ones(r.size), big[lay.a_i[free_k]]],
                 np.where(free_k, big[lay.a_i], 0.0))
    # upload and download budgets; self-traffic g_ii is in neither
    cross = lay.g_i != lay.g_j
    ones_a, ones_g = np.ones(lay.a_col.size), np.ones(int(cross.sum()))
    rows.add(np.r_[lay.a_k, lay.g_i[cross]], np.r_[lay.a_col, lay.g_col[cross]],
             np.r_[ones_a, ones_g], prob.u)
    rows.add(np.r_[lay.a_i, lay.g_j[cross]], np.r_[lay.a_col, lay.g_col[cross]],
             np.r_[ones_a, ones_g], prob.d)
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
    ub[lay.g_col] = np.where(cross, np.minimum(np.minimum(prob.u[lay.g_i], prob.d[lay.g_j]),
                                               cap[lay.g_i]), cap[lay.g_i])
    a_ub, b_ub = rows.matrix(lay.n_vars)
    return a_ub, b_ub, lb, ub


def _triple_rows(rows: _Rows, prob: _Problem, lay: _Layout, big: np.ndarray) -> None:
    """The literal O(n^3) constraint g_ij <= a_ki + (1 - c_k) M_i, one row per (i, j, k)."""
    for i in lay.agg:
        g_cols = lay.g_col[lay.g_i == i]
        sel = lay.a_i == i
        a_cols, senders = lay.a_col[sel], lay.a_k[sel]
        gg, aa = (x.ravel() for x in np.meshgrid(g_cols, np.arange(a_cols.size), indexing="ij"))
        c_cols = lay.c_col[senders[aa]]
        free = c_cols >= 0
        r = np.arange(gg.size)
        rows.add(np.r_[r, r, r[free]], np.r_[gg, a_cols[aa], c_cols[free]],
                 np.r_[np.ones(r.size), -np.ones(r.size), np.full(int(free.sum()), big[i])],
                 np.where(free, big[i], 0.0))


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
    x = _linprog(cost, a_ub, b_ub, lb, ub, "eq. 5")
    xi = float(x[0])
    if sliced and xi > 0:
        x = _max_sliced(prob, lay, a_ub, b_ub, lb, ub, xi * (1 - 1e-7))[0]
    return _Relaxed(prob, lay, x, xi)


def _served(lay: _Layout, x: np.ndarray) -> np.ndarray:
    """[nA] eq. 6's min_j g_ij per aggregator (LP units)."""
    return x[lay.g_col].reshape(lay.agg.size, lay.receivers.size).min(axis=1)


def _max_sliced(prob: _Problem, lay: _Layout, a_ub: sp.csr_array, b_ub: np.ndarray,
                lb: np.ndarray, ub: np.ndarray, xi_min: float) -> tuple[np.ndarray, float]:
    """Max sum_i w_i, w_i <= g_ij for every receiver j, over eq. 5 solutions with xi >= xi_min:
    the fastest sliced plan among them. Returns (x without w, sum w)."""
    n_agg, nv = lay.agg.size, lay.n_vars
    w = nv + np.arange(n_agg)
    rows = _Rows()
    r = np.arange(lay.g_col.size)
    rows.add(np.r_[r, r], np.r_[w[np.repeat(np.arange(n_agg), lay.receivers.size)], lay.g_col],
             np.r_[np.ones(r.size), -np.ones(r.size)], np.zeros(r.size))
    extra, b_extra = rows.matrix(nv + n_agg)
    a2 = sp.vstack([sp.hstack([a_ub, sp.csr_array((a_ub.shape[0], n_agg))]), extra]).tocsr()
    cap, _ = _caps(prob)
    lb2, ub2 = np.r_[lb, np.zeros(n_agg)], np.r_[ub, cap[lay.agg]]
    lb2[0] = xi_min
    cost = np.r_[np.zeros(nv), -np.ones(n_agg)]
    x = _linprog(cost, a2, np.r_[b_ub, b_extra], lb2, ub2, "sliced (phase 2)")
    return x[:nv], float(x[nv:].sum())


def solve_plan_reference(peers: Sequence[PeerCapacity], num_params: int, target_batch: float,
                         bytes_per_param: float = 4.0, pairwise: Pairwise | None = None,
                         form: str = "literal") -> Plan:
    """The paper's own LP (eq. 5 with continuous c, then eq. 6), literal O(n^3) rows or the
    compact O(n^2) form. For comparison and tests, small n only: its c is degenerate (see
    the module docstring); ``steps_per_s`` is its xi, an upper bound, not a promise."""
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
    return _make_plan(prob, sol.xi, np.maximum(_served(lay, sol.x), 0.0), c, computing,
                      lay.receivers)


# --------------------------------------------------------------------------------------------
# Plan assembly


def _make_plan(prob: _Problem, xi: float, served: np.ndarray, computes: np.ndarray,
               senders: np.ndarray, receivers: np.ndarray) -> Plan:
    """``served``: [nA] rate per aggregator (LP units) -> fractions; ``computes``: [n] c_i."""
    agg_ids = [prob.ids[i] for i in prob.aggregators]
    total = float(served.sum())
    if total <= 0:
        raise PlanError("no aggregator can serve every computing peer; check the pairwise "
                        "limits and the aggregators' upload")
    keep = served > _MIN_SHARE * total
    share = served[keep] / served[keep].sum()
    fractions = dict(zip([p for p, k in zip(agg_ids, keep) if k], map(float, share)))
    computes_by_id = {pid: float(c) for pid, c in zip(prob.ids, computes)}
    computing = tuple(prob.ids[k] for k in senders)
    pairwise = {(a, b): t for a, b, t in prob.pairwise_raw}
    round_s = predict_round_s(prob.peers, fractions, prob.num_params, prob.bytes_per_param,
                              pairwise, senders=computing,
                              receivers=[prob.ids[j] for j in receivers])
    steps = xi * prob.unit
    return Plan(steps_per_s=steps, fractions=fractions, computes=computes_by_id,
                version=_version(prob, steps, fractions, computes_by_id),
                num_params=prob.num_params, predicted_round_s=round_s,
                aggregators=tuple(fractions), computing=computing)


def _version(prob: _Problem, steps: float, fractions: dict[str, float],
             computes: dict[str, float]) -> str:
    """sha256 over the canonical inputs and the rounded solution: equal plans, equal versions,
    in any process (float repr is exact; rounding to 9 digits hides last-bit solver noise)."""
    def r(v: float) -> str:
        return f"{v:.9g}"
    doc = {
        "peers": [[p.peer_id, repr(float(p.samples_per_s)), repr(float(p.upload)),
                   repr(float(p.download)), p.can_receive, p.computes] for p in prob.peers],
        "num_params": prob.num_params, "target_batch": repr(prob.target_batch),
        "bytes_per_param": repr(prob.bytes_per_param),
        "pairwise": [[a, b, repr(t)] for a, b, t in prob.pairwise_raw],
        "steps_per_s": r(steps),
        "fractions": [[k, r(v)] for k, v in fractions.items()],
        "computes": [[k, r(v)] for k, v in computes.items()],
    }
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Time model: seconds per averaging round for a slicing (used by plans and benchmarks)


def _participant_ids(peers: Iterable[PeerCapacity]) -> tuple[str, ...]:
    return tuple(p.peer_id for p in peers if p.samples_per_s > 0 and p.computes is not False)


def predict_round_s(peers: Sequence[PeerCapacity], fractions: Mapping[str, float],
                    num_params: int, bytes_per_param: float = 4.0,
                    pairwise: Pairwise | None = None, senders: Iterable[str] | None = None,
                    receivers: Iterable[str] | None = None) -> float:
    """Seconds per averaging round when aggregator i owns ``fractions[i]`` of the vector.

    Every sender sends its gradient part f_i V to each aggregator i but itself; every
    aggregator sends its updated part f_i V to each receiver but itself (V = num_params *
    bytes_per_param). Transfers are pipelined and links full duplex, so the round lasts as long
    as the busiest link: the max over peers of upload bytes / upload and download bytes /
    download, and over pairs of bytes / t_ij. Latency, protocol overhead and compute are not
    modeled: this is the bandwidth bound the LP optimizes. Senders and receivers default to the
    peers with samples_per_s > 0 not pinned off. ``inf`` when a needed link has zero rate.
    """
    by_id = {p.peer_id: p for p in peers}
    default = _participant_ids(peers)
    send = set(default if senders is None else senders)
    recv = set(default if receivers is None else receivers)
    for pid, f in fractions.items():
        if pid not in by_id or not by_id[pid].can_receive:
            raise PlanError(f"{pid!r} has a share but is unknown or cannot receive")
        if not (math.isfinite(f) and f >= 0):
            raise PlanError(f"fraction of {pid!r} must be finite and >= 0, got {f!r}")
    total = float(sum(fractions.values()))
    if total <= 0:
        raise PlanError("fractions sum to zero: nobody aggregates")
    vec = float(num_params) * float(bytes_per_param)
    share = {pid: v / total for pid, v in fractions.items()}
    worst = 0.0
    for p in peers:
        f, sends, gets = share.get(p.peer_id, 0.0), p.peer_id in send, p.peer_id in recv
        up = (1.0 - f if sends else 0.0) + f * (len(recv) - gets)
        down = f * (len(send) - sends) + (1.0 - f if gets else 0.0)
        worst = max(worst, _seconds(up * vec, p.upload), _seconds(down * vec, p.download))
    for (src, dst), limit in (pairwise or {}).items():
        sent = (share.get(dst, 0.0) if src in send else 0.0) + \
            (share.get(src, 0.0) if dst in recv else 0.0)
        worst = max(worst, _seconds(sent * vec, limit))
    return worst


def _seconds(nbytes: float, rate: float) -> float:
    if nbytes <= 1e-9:  # less than a byte: float noise from 1 - f
        return 0.0
    return math.inf if rate <= 0 else nbytes / rate


def allreduce_round_s(peers: Sequence[PeerCapacity], num_params: int,
                      bytes_per_param: float = 4.0, pairwise: Pairwise | None = None) -> float:
    """Butterfly all-reduce: every participant that can receive owns an equal share."""
    participants = set(_participant_ids(peers))
    owners = [p.peer_id for p in peers if p.can_receive and p.peer_id in participants]
    if not owners:
        raise PlanError("all-reduce needs a participant that can receive connections")
    return predict_round_s(peers, dict.fromkeys(owners, 1.0), num_params, bytes_per_param, pairwise)


def parameter_server_round_s(peers: Sequence[PeerCapacity], num_params: int,
                             bytes_per_param: float = 4.0,
                             pairwise: Pairwise | None = None) -> tuple[str, float]:
    """The best single parameter server: ``(peer_id, seconds)`` over the peers that can receive."""
    best: tuple[str, float] | None = None
    for p in sorted(peers, key=lambda q: q.peer_id):
        if p.can_receive:
            t = predict_round_s(peers, {p.peer_id: 1.0}, num_params, bytes_per_param, pairwise)
            if best is None or t < best[1]:
                best = (p.peer_id, t)
    if best is None:
        raise PlanError("a parameter server needs a peer that can receive connections")
    return best


def _apportion(total: int, shares: Sequence[float]) -> list[int]:
    """Largest-remainder split of ``total`` items by ``shares``; exact sum, ties to the earlier."""
    if not shares:
        return []
    w = np.asarray(shares, float)
    raw = w / w.sum() * total
    base = np.floor(raw).astype(np.int64)
    short = total - int(base.sum())
    order = np.lexsort((np.arange(w.size), -(raw - base)))  # biggest remainder first
    base[order[:short]] += 1
    return [int(v) for v in base]
