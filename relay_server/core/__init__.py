"""The relay's lowest layer: the run's configuration (:mod:`.config`), the typed API errors every
layer raises (:mod:`.errors`) and the aiohttp helpers for reading and answering requests
(:mod:`.http`). Imports nothing from ``relay_server``; from the peer side only ``toolkit.errors``
and ``toolkit.wire``."""
