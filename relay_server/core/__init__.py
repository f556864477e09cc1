"""The relay's lowest layer: the run's configuration (:mod:`.config` loads it and says where each
section lives: :mod:`.training_config`, :mod:`.service_config`, :mod:`.run_data` for
``[tokenizer]`` and ``[objective]``, :mod:`.connections`; a feature's section lives in its folder,
``[moe]`` in :mod:`relay_server.moe.moe_config`, and :mod:`.config`, a unit of its own, sits over
them; the generic typed
TOML + environment machinery in :mod:`.typed` and :mod:`.overrides`), the reproducible wheel of
the installed toolkit that the relay serves (:mod:`.distribution`), the typed API errors every
layer raises (:mod:`.errors`) and the aiohttp helpers for reading and answering requests
(:mod:`.http`). Imports nothing from ``relay_server`` above it; from the peer side only
``toolkit.errors``, ``toolkit.wire`` and ``toolkit.data``'s typed configs."""
