"""The staged pipeline on the relay: the model cut into stages that volunteers run, the relay
holding every stage boundary. The package owns the micro-batch task pool, the boundary buffers,
the stage owners and the planner (:mod:`.timemodel` the paper's Eq. 1-3, :mod:`.partition` its
graph-clustering partition, :mod:`.exhaustive` the brute-force references the tests compare it
with, :mod:`.star` what the planning reduces to in our outbound-only star). It may import core,
auth, tasks, rounds, planning, backbone and collaboration; the planner modules are pure
computation (no I/O, no torch)."""
