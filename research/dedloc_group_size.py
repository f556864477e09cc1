"""Optimal group size for group all-reduce under peer failures (DeDLOC Appendix C, Figure 8).

``python benchmarks/group_size.py`` prints Figure 8's grid (the optimal group size for
n = logspace(1, 4, 10) peers and failure rates p = linspace(0, 2.5%, 15)) from :data:`SIZES`,
:data:`FAILURE_RATES` and :func:`optimal_group_size` as one JSON line; ``tests/test_group_size.py``
compares it with the paper cell by cell.

Why this is a reproduction and not part of the relay: collabtrain averages through the relay and its
aggregators (a star per slice), not by peer-to-peer group all-reduce, so no decision of the relay
depends on m. A peer that fails costs only its own contribution (the round closes without it),
which is the failure model Appendix C's groups exist to approximate. This reproduction stays as
evidence that we read the appendix correctly, for the day peers average among themselves.

A global all-reduce fails if any of the n peers fails during it, so with per-peer failure
probability p it succeeds with probability (1 - p)^n and large swarms mostly restart. Group
all-reduce (Moshpit / group all-reduce, refs [56, 29]) averages in groups of m peers over
k = ceil(log_m n) steps instead: the exact global average after k steps, and a failure only
hits its own group. Appendix C picks m by "minimizing the expected number of iterations
required to compute the global average, including both restarts from node failures and the
overhead from using Group All-Reduce"; it gives no formula, only Figure 8.

Our reading of that model (the appendix's words, made concrete):

* a peer's contribution reaches the global average through one group per step; over k steps it
  meets 1 + k(m - 1) distinct peers (itself, then m - 1 new partners each step), and the pass
  only counts if none of them fails: probability (1 - p)^(1 + k(m - 1));
* a failed pass is restarted, so the number of passes is geometric and the expected number of
  iterations is ``k / (1 - p)^(1 + k(m - 1))``. For m = n (k = 1) this is the global
  all-reduce's 1 / (1 - p)^n.

For a fixed k the cost grows with m, so the candidates are the smallest m with m^k >= n, one per
k (exactly the values Figure 8 shows: 100 -> 10, 215 -> 15, 4641 -> 69, 17, 9). Figure 8's axes
are p = linspace(0, 2.5%, 15) and n = logspace(1, 4, 10) rounded. This model gives 141 of its
150 cells; each of the other 9 is next to a boundary between two group sizes, which the model
puts 1-3 columns (0.2-0.5 points of p) away from the figure's; 7 of them are the first move away
from m = n, where the figure stays with global all-reduce a little longer
(tests/test_group_size.py lists them). The simpler reading ``k / (1 - p)^m`` (restart only the
failed group) gives 113 cells, and waiting each step for the slowest of the n/m groups gives
134, so we keep the one above.
"""

from __future__ import annotations

import math

__all__ = ["expected_iterations", "group_size_candidates", "optimal_group_size", "steps_for"]


def _check(n: int, failure_rate: float) -> None:
    if int(n) != n or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if not (math.isfinite(failure_rate) and 0.0 <= failure_rate < 1.0):
        raise ValueError(f"failure_rate must be in [0, 1), got {failure_rate!r}")


def steps_for(n: int, m: int) -> int:
    """Group all-reduce steps for n peers in groups of m: the least k with m^k >= n (integers,
    so 1000 with m = 10 is exactly 3)."""
    if n <= 1:
        return 1
    if m < 2:
        raise ValueError(f"group size must be >= 2 for n = {n} peers, got {m}")
    k, reach = 1, m
    while reach < n:
        reach *= m
        k += 1
    return k


def _smallest_root(n: int, k: int) -> int:
    """The least integer m >= 2 with m^k >= n."""
    m = max(2, round(n ** (1.0 / k)))
    while m**k < n:
        m += 1
    while m > 2 and (m - 1) ** k >= n:
        m -= 1
    return m


def group_size_candidates(n: int) -> list[int]:
    """One group size per step count k, largest first: n, ceil(sqrt n), ... down to 2."""
    _check(n, 0.0)
    if n == 1:
        return [1]
    out: list[int] = []
    for k in range(1, steps_for(n, 2) + 1):
        m = _smallest_root(n, k)
        if not out or m < out[-1]:
            out.append(m)
    return out


def expected_iterations(n: int, m: int, failure_rate: float) -> float:
    """Expected iterations to get the exact global average of n peers with groups of m, when
    each peer fails an iteration with probability ``failure_rate`` (see module docstring)."""
    _check(n, failure_rate)
    if n == 1:
        return 1.0
    m = min(int(m), n)
    k = steps_for(n, m)
    touched = 1 + k * (m - 1)  # distinct peers on one contribution's path to the average
    return k / (1.0 - failure_rate) ** touched


def optimal_group_size(n: int, failure_rate: float) -> int:
    """The group size with the fewest expected iterations; on a tie the larger group (fewer
    steps). With no failures that is n itself: one global all-reduce."""
    _check(n, failure_rate)
    return min(group_size_candidates(n), key=lambda m: (expected_iterations(n, m, failure_rate), -m))


SIZES = [10, 21, 46, 100, 215, 464, 1000, 2154, 4641, 10000]
"""Figure 8's rows: logspace(1, 4, 10) as printed."""
FAILURE_RATES = [0.025 * i / 14 for i in range(15)]
"""Figure 8's columns: linspace(0, 2.5%, 15)."""
