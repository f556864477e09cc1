"""Appendix C: optimal group size against the paper's Figure 8."""

from __future__ import annotations

import math

import numpy as np
import pytest

from research.dedloc_group_size import (
    expected_iterations,
    group_size_candidates,
    optimal_group_size,
    steps_for,
)

# Figure 8 as printed in the seed (shared/seeds/dedloc-paper.txt, the lines before its caption):
# columns are p = 0.0% .. 2.5% (labels 0.0, 0.2, 0.4, 0.5, 0.7, ... = linspace(0, 0.025, 15)),
# rows are n = 10, 21, 46, ..., 10000 (logspace(1, 4, 10) rounded).
FAILURE_RATES = np.linspace(0.0, 0.025, 15)
SIZES = [10, 21, 46, 100, 215, 464, 1000, 2154, 4641, 10000]
FIGURE_8 = """
10 10 10 10 10 10 10 10 10 10 10 10 10 10 10
21 21 21 21 21 21 21 21 21 21 21 21 21 21 21
46 46 46 46 46 46 46 46 46 46 46 46 46 46 46
100 100 100 100 100 100 100 10 10 10 10 10 10 10 10
215 215 215 215 15 15 15 15 15 15 15 15 15 15 15
464 464 22 22 22 22 22 22 22 22 22 8 8 8 8
1000 32 32 32 32 32 32 10 10 10 10 10 10 10 10
2154 47 47 47 47 13 13 13 13 13 13 13 13 7 7
4641 69 69 17 17 17 17 17 17 17 17 9 9 9 9
10000 100 22 22 22 22 10 10 10 10 10 10 10 10 10
"""
FIGURE = np.array([line.split() for line in FIGURE_8.strip().splitlines()], dtype=int)
# (row, column) cells where our model disagrees, each next to a boundary (see research/dedloc_group_size.py)
KNOWN_DIFFERENCES = {(2, 12), (2, 13), (2, 14), (3, 5), (3, 6), (4, 3), (5, 1), (7, 13), (8, 10)}


def model_grid() -> np.ndarray:
    return np.array([[optimal_group_size(n, p) for p in FAILURE_RATES] for n in SIZES])


@pytest.mark.parametrize(
    "n, column, expected",
    [
        (10, 14, 10),
        (100, 0, 100),
        (100, 9, 10),
        (215, 8, 15),
        (464, 5, 22),
        (464, 13, 8),
        (1000, 3, 32),
        (1000, 12, 10),
        (2154, 2, 47),
        (2154, 9, 13),
        (4641, 6, 17),
        (4641, 14, 9),
        (10000, 1, 100),
        (10000, 3, 22),
        (10000, 14, 10),
    ],
)
def test_figure8_cells(n, column, expected):
    assert FIGURE[SIZES.index(n), column] == expected  # the cell as printed
    assert optimal_group_size(n, FAILURE_RATES[column]) == expected


def test_figure8_agreement_is_141_of_150_cells():
    grid = model_grid()
    diff = {tuple(map(int, cell)) for cell in np.argwhere(grid != FIGURE)}
    assert diff == KNOWN_DIFFERENCES
    for row, col in diff:  # only a boundary moved: the two choices are one step count apart
        n = SIZES[row]
        assert abs(steps_for(n, grid[row, col]) - steps_for(n, FIGURE[row, col])) == 1


def test_no_failures_means_one_global_all_reduce():
    for n in (1, 2, 7, 100, 4641, 10**6):
        assert optimal_group_size(n, 0.0) == n


def test_group_shrinks_as_failures_grow():
    grid = model_grid()
    assert (np.diff(grid, axis=1) <= 0).all()


def test_expected_iterations():
    assert expected_iterations(100, 100, 0.01) == pytest.approx(1 / 0.99**100)  # global restarts
    # 2 steps of groups of 10: a contribution meets 1 + 2 * 9 = 19 peers
    assert expected_iterations(100, 10, 0.01) == pytest.approx(2 / 0.99**19)
    assert expected_iterations(1, 1, 0.5) == 1.0
    assert expected_iterations(8, 3, 0.0) == 2.0


def test_steps_and_candidates_use_exact_integer_roots():
    assert steps_for(1000, 10) == 3 and steps_for(1001, 10) == 4 and steps_for(1, 7) == 1
    assert steps_for(1024, 2) == 10 and steps_for(5, 5) == 1 and steps_for(5, 9) == 1
    assert group_size_candidates(1000) == [1000, 32, 10, 6, 4, 3, 2]
    assert group_size_candidates(10000)[:4] == [10000, 100, 22, 10]
    for n in (2, 3, 17, 125, 4641):
        for m in group_size_candidates(n):
            k = steps_for(n, m)
            assert m**k >= n and (k == 1 or (m - 1) ** k < n)


@pytest.mark.parametrize("n, p", [(0, 0.1), (2.5, 0.1), (10, -0.1), (10, 1.0), (10, math.nan)])
def test_bad_inputs(n, p):
    with pytest.raises(ValueError):
        optimal_group_size(n, p)
    with pytest.raises(ValueError):
        steps_for(10, 1)
