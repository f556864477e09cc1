"""The relay's lowest layer: the run's configuration (:mod:`.config`, its ``[tokenizer]`` and
``[objective]`` checks in :mod:`.run_data`, the generic TOML + environment machinery in
:mod:`.typed`), the reproducible wheel of the installed toolkit that the relay serves
(:mod:`.distribution`), the typed API errors every layer raises (:mod:`.errors`) and the aiohttp
helpers for reading and answering requests (:mod:`.http`). Imports nothing from ``relay_server``
above it; from the peer side only ``toolkit.errors``, ``toolkit.wire`` and ``toolkit.data``'s typed configs."""
