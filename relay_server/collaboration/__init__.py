"""The collaboration's state machine (:mod:`.machine`): peers join and leave, rounds open when the
target batch is reached and close on delivery or deadline, the optimizer steps, versions are
published and observers told. It composes rounds, backbone, planning and observers; it knows
nothing of HTTP beyond the typed errors of :mod:`relay_server.core.errors`."""
