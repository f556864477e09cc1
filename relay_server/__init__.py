"""collabtrain's relay: the backbone a collaboration's peers talk to.

Subpackages, lowest first; a package imports only from those listed before it (and from
``toolkit.errors``, ``toolkit.wire``, ``toolkit.models``, ``toolkit.data.config``, the peer side's
shared layers). ``tests/test_layout.py`` walks every import, lazy ones included, and holds this.

* :mod:`relay_server.core`          configuration, error types, HTTP helpers every layer uses
* :mod:`relay_server.auth`          who is asking: relay key, HF identity, access passes, signed requests
* :mod:`relay_server.rounds`        one averaging round: registry, membership, reduction, master state, versions, store
* :mod:`relay_server.planning`      DeDLOC's LP, the measurements it is solved from, when to re-plan
* :mod:`relay_server.observers`     W&B and Hub checkpoints, fed step events off the round's path
* :mod:`relay_server.data`          the shard-lease pool (the data task pool)
* :mod:`relay_server.backbone`      slices of the vector owned by the relay and aggregators, tickets, recovery
* :mod:`relay_server.collaboration` the state machine composing rounds, backbone, planning and observers
* :mod:`relay_server.api`           the aiohttp app: each concern's routes, auth, rate limits, moderation, dashboard
* entry points: :mod:`relay_server.cli`, :mod:`relay_server.aggregator`, :mod:`relay_server.demo`
"""
