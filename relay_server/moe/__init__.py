"""Learning@home on the relay: the expert directory, expert checkpoints, and the routes that broker
trainers' expert calls to volunteer hosts through :mod:`relay_server.tasks`.

The relay never computes an expert. It knows which host holds which expert (:mod:`.directory`,
the paper's DHT table, with leases instead of announcements because hosts cannot be reached),
keeps each expert's latest checkpoint so a dead host's experts resume elsewhere
(:mod:`.checkpoints`), and holds them with the task broker and the call rates in one state that
expires departed hosts every tick (:mod:`.state`); :mod:`relay_server.api.experts` (routes
only) moves call payloads between trainers and hosts through the broker, validating every tensor
against the run's ``[moe]`` section once, when the call comes, before anyone sees it.

May import ``relay_server.core``, ``relay_server.tasks`` and the toolkit's shared layers.
"""
