"""The heterogeneous-pipeline paper's planning (section 3.3), reproduced in its general setting.

Reliable servers S and unreliable clients U, each stage a parameter-server group: :mod:`.timemodel`
the paper's Eq. 1-3, :mod:`.ordering` the open-TSP stage order, :mod:`.partition_model` /
:mod:`.partition` its graph-clustering partition, :mod:`.exhaustive` the brute-force references
the tests compare them with. Pure computation (no I/O, no torch). On collabtrain's outbound-only
star the relay holds every boundary, so the planning degenerates to
:mod:`relay_server.pipeline.star`, which is what runs; this package is kept to show the general
form is reproduced and to measure it (``tests/research/test_hetero_pipeline.py``).
"""
