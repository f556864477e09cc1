"""collabtrain's relay: the backbone a collaboration's peers talk to.

Units, lowest first; a unit imports only from those listed before it, and from the toolkit only
its shared layer (the units :mod:`toolkit`'s docstring lists under "The shared layer"). This list
is the one statement of the relay's layering: ``tests/test_layout.py`` reads it from here, walks
every import, lazy ones included, and checks that ARCHITECTURE.md's drawing and docs/layout.md
follow the same order.

A feature the relay plugs in (DMoE's experts in ``moe/``, the staged pipeline in ``pipeline/``,
local SGD in ``local_sgd/``, evaluation in ``evaluation/``) is one folder whose modules sit at up to three heights, each listed
below as a unit of its own: its config section with its compatibility checks (``moe/moe_config``),
under the run's whole configuration; its state and service (the folder itself); its routes and
the ``FEATURE`` object the app iterates (``moe/feature``), over the app's feature contract and
under the app.

* :mod:`relay_server.core`          config sections, error types, HTTP helpers every layer uses
* :mod:`relay_server.moe.moe_config` ``[moe]`` and its checks
* :mod:`relay_server.pipeline.pipeline_config` ``[pipeline]`` and its checks
* :mod:`relay_server.local_sgd.local_sgd_config` ``[local_sgd]`` and its checks
* :mod:`relay_server.evaluation.evaluation_config` ``[evaluation]`` and its checks
* :mod:`relay_server.core.config`   the run's whole configuration: every section, loaded and checked
* :mod:`relay_server.auth`          who is asking: relay key, HF identity, access passes, signed requests
* :mod:`relay_server.tasks`         the task broker: payloads posted to keys, pulled by outbound-only workers
* :mod:`relay_server.moe`           the expert directory, expert checkpoints, the relay's DMoE state
* :mod:`relay_server.rounds`        one averaging round: registry, membership, reduction, master state, versions, store
* :mod:`relay_server.planning`      DeDLOC's LP, the measurements it is solved from, when to re-plan
* :mod:`relay_server.observers`     W&B and Hub checkpoints, evaluation, fed step events off the round's path
* :mod:`relay_server.data`          the shard-lease pool (the data task pool), training the run's tokenizer
* :mod:`relay_server.backbone`      slices of the vector owned by the relay and aggregators, tickets, recovery
* :mod:`relay_server.collaboration` the state machine composing rounds, backbone, planning and observers
* :mod:`relay_server.trust`         checking stage workers' and expert hosts' results: spot checks, monitors, the relay's referee, bans
* :mod:`relay_server.local_sgd`     local SGD: when an outer round opens, its outer loop's figures
* :mod:`relay_server.evaluation`    evaluation's folder (its evaluator is one of the observers)
* :mod:`relay_server.pipeline`      the staged pipeline: stage owners, the task pool and its rounds, the ledger
* :mod:`relay_server.api`           the feature contract, each core concern's routes, rate limits, moderation, dashboard
* :mod:`relay_server.moe.feature`   DMoE's routes and FEATURE
* :mod:`relay_server.pipeline.feature` the pipeline's routes and FEATURE
* :mod:`relay_server.local_sgd.feature` local SGD's FEATURE
* :mod:`relay_server.evaluation.feature` evaluation's FEATURE: its panel
* :mod:`relay_server.api.app`       the aiohttp app: the core routes and the features it plugs in, its lifespan
* :mod:`relay_server.api.server`    serving an app: signals, the ready file
* :mod:`relay_server.aggregator`    entry point: an aggregator process
* :mod:`relay_server.harness`       running a relay here (a thread or a process), for the demo, tests and benchmarks
* :mod:`relay_server.demo`          entry point: a relay and peer processes on this machine
* :mod:`relay_server.trial`         entry point: an organizer's own run on this machine, before anyone joins
* :mod:`relay_server.notebooks`     entry point: the notebook templates
* :mod:`relay_server.cli`           entry point: ``relay-server``
"""
