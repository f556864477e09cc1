"""The collaboration's state machine (:mod:`.machine`): peers join and leave, rounds open when the
target batch is reached and close on delivery or deadline (the round lifecycle, :mod:`.round_cycle`),
peers' gradients for the round are checked and counted (:mod:`.intake`), the optimizer steps,
versions are published and observers told; what it reports about itself is
:mod:`.status`, the version it serves first (version 0, or the one it resumes) :mod:`.starting_version`. It composes rounds, backbone, planning and observers; it knows nothing of HTTP
beyond the typed errors of :mod:`relay_server.core.errors`."""
