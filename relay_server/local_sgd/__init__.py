"""Local SGD on the relay (``run.mode = "local_sgd"``), the feature's folder: its config section
and the checks it carries (:mod:`.local_sgd_config`, ``[local_sgd]``: the inner budget and the
outer optimizer), when an outer round opens (:mod:`.outer_rounds`), the outer loop's figures it
adds to the relay's report (:mod:`.outer_status`) and the ``FEATURE`` the app plugs in
(:mod:`.feature`).

Everything else of an outer round is sync mode's own: the upload, the reduction, the master's
(outer) optimizer step, the after-publish sequence.

The folder's three heights are three units (``relay_server/__init__.py`` lists them): the config
section may import only ``relay_server.core``'s sections; the opening rule and the figures may
import the collaboration (the peer registry and round cycle they read); the feature sits over the app's feature
contract (:mod:`relay_server.api.feature`).
"""
