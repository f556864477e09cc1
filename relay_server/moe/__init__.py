"""Learning@home on the relay, the DMoE feature's folder: its config section, the expert
directory, expert checkpoints, and the routes that broker trainers' expert calls to volunteer
hosts through :mod:`relay_server.tasks`.

The relay never computes an expert. It knows which host holds which expert (:mod:`.directory`,
the paper's DHT table, with leases instead of announcements because hosts cannot be reached),
keeps each expert's latest checkpoint so a dead host's experts resume elsewhere
(:mod:`.checkpoints`), and holds them with the task broker and the call rates in one state that
expires departed hosts every tick (:mod:`.state`); :mod:`.feature` (routes
only) moves call payloads between trainers and hosts through the broker, validating every tensor
against the run's ``[moe]`` section (:mod:`.moe_config`, with its checks) once, when the call
comes, before anyone sees it; its ``FEATURE`` is what the app plugs in.

The folder's three heights are three units (``relay_server/__init__.py`` lists them): the config
section imports nothing of the relay (the run's config imports it); the state may import
``relay_server.core``, ``relay_server.tasks`` and the toolkit's shared layers; the routes sit
over the app's feature contract (:mod:`relay_server.api.feature`).
"""
