"""Reproductions of the papers' algorithms, kept to check the product against, not run by the relay.

Nothing in ``toolkit`` or ``relay_server`` imports this package, and the wheel does not ship it
(``pyproject.toml`` packages only ``toolkit*`` and ``relay_server*``). Each module reproduces one
paper's algorithm as published, with the departures measured and explained in its docstring; the
tests under ``tests/research/`` check the reproductions, and tests of the relay's own planners use
them as references.

* :mod:`.dedloc_lp` -- "Distributed Deep Learning in Open Collaborations" (Diskin et al., DeDLOC,
  arXiv:2106.10207), Appendix B: the relaxed linear program (eq. 5 with continuous c, then eq. 6),
  literal and compact forms. The relay solves its own exact reformulation,
  :mod:`relay_server.planning.planner`, and tests compare the two.
* :mod:`.dedloc_group_size` -- the same paper's Appendix C: the optimal group size of group
  all-reduce under peer failures (Figure 8), read as a model of expected iterations; the relay,
  a star per slice, does not need it (``benchmarks/group_size.py`` prints the grid).
* :mod:`.hetero_pipeline` -- the heterogeneous-pipeline paper (an anonymous ICLR 2025 submission,
  "a parameter server per stage, pipeline parallelism and a task pool"; no arXiv id; its text is
  seed 004, ``heterogeneous-pipeline-taskpool.txt``), section 3.3: the time model (Eq. 1-3), the
  open-TSP stage order, the graph-clustering partition search and the brute force it is measured
  against. The relay runs what that planning reduces to on its star,
  :mod:`relay_server.pipeline.star`.

Imports only go downward: this package may import ``relay_server`` and ``toolkit``, never the
other way (``tests/test_layout.py``).
"""
