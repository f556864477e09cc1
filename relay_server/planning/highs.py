"""LP plumbing every plan LP uses: one deterministic HiGHS call and sparse rows built a block at a time.

:mod:`.planner` solves its partition and share LPs through these; the paper's own relaxed LP
(``research.dedloc_lp``, not run by the relay) is written on them too, so that the tests comparing
the two compare formulations, not solver settings.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

from relay_server.planning.problem import PlanError


def solve_lp(
    cost: np.ndarray,
    a_ub: sp.csr_array,
    b_ub: np.ndarray,
    lb: np.ndarray,
    ub: np.ndarray,
    what: str,
    a_eq: sp.csr_array | None = None,
    b_eq: np.ndarray | None = None,
) -> np.ndarray:
    """Minimize ``cost @ x`` subject to the rows and bounds; a failure is a :class:`PlanError` naming ``what``."""
    # Dual simplex with HiGHS defaults: serial and deterministic (same inputs, same vertex).
    res = linprog(
        cost, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=np.column_stack([lb, ub]), method="highs-ds"
    )
    if res.status != 0 or res.x is None:
        raise PlanError(
            f"the {what} LP failed ({res.status}: {res.message}); the inputs are "
            "probably degenerate (check for zero or absurd bandwidths)"
        )
    return np.asarray(res.x)


class SparseRows:
    """Accumulates ``A x <= b`` (or ``= b``) as COO triplets, one block of rows at a time."""

    def __init__(self) -> None:
        self.r: list[np.ndarray] = []
        self.c: list[np.ndarray] = []
        self.v: list[np.ndarray] = []
        self.b: list[np.ndarray] = []
        self.count = 0

    def add(self, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray | float, rhs: np.ndarray | float) -> None:
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
        a = sp.coo_array(
            (np.concatenate(self.v), (np.concatenate(self.r), np.concatenate(self.c))), shape=(self.count, n_vars)
        )
        return a.tocsr(), np.concatenate(self.b)
