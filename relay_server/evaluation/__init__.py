"""Held-out evaluation on the relay (``[evaluation]``), the feature's folder: its config section
and the checks it carries (:mod:`.evaluation_config`: the validation source, never a training
one; bounded prompts) and the ``FEATURE`` the app plugs in (:mod:`.feature`: the Evaluation
panel's records in ``GET /api/status``).

The evaluator itself is an observer of published steps (:mod:`relay_server.observers.evaluation`,
scoring in a process of its own): built with the other observers before the collaboration, fed by
their thread, and heard by the Hub checkpointer, so it lives with them; this folder's feature
only finds it among them and reads its records.

The folder's two heights are two units (``relay_server/__init__.py`` lists them): the config
section may import only ``relay_server.core``'s sections; the feature sits over the app's feature
contract (:mod:`relay_server.api.feature`).
"""
