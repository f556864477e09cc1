"""collabtrain's peer side: join a collaborative training run from a notebook with one call.

    import toolkit
    toolkit.join("https://relay.example.org")

Public names are imported lazily so that ``import toolkit`` stays cheap and the wire protocol
(``toolkit.wire.protocol``) is usable without torch.

Units, lowest first: a unit imports only from the units listed before it and from its own
modules (a unit is a subpackage or module; the longest name that matches a module is its unit, so
``toolkit.moe.host`` is a unit of its own inside ``toolkit.moe``). This list is the one statement
of the toolkit's layering: ``tests/test_layout.py`` reads it from here, and checks that
ARCHITECTURE.md's drawing and docs/layout.md follow the same order.

The shared layer, what both sides build on and all the relay may import from the toolkit (no
HTTP client, no peer's process in it):

* :mod:`toolkit.errors`           every error, each with the words that say what to do
* :mod:`toolkit.wire`             what crosses the network: messages, routes, tensor containers and messages, codecs
* :mod:`toolkit.runtime`          where a process runs: device, precision, 8-bit kernels, child processes
* :mod:`toolkit.corpus`           the demo text the toolkit ships
* :mod:`toolkit.data`             a run's data: shards, streams, its tokenizer and objective
* :mod:`toolkit.moe`              the mixture-of-experts math: grid, gate, beam search, layers, what an expert is
* :mod:`toolkit.models`           the models a run may build, from its spec
* :mod:`toolkit.pipeline`         a model cut into stages, each built alone

The peer side, which only peers run (the relay never imports it):

* :mod:`toolkit.signing`          the peer's keys and access pass
* :mod:`toolkit.transfer`         slice bodies to and from slice owners
* :mod:`toolkit.client`           the HTTP client of the relay
* :mod:`toolkit.run_membership`   a peer's place in the run: join, heartbeat, rejoin, backoff, leave
* :mod:`toolkit.moe.remote`       expert calls through the relay
* :mod:`toolkit.moe.host`         the expert host (``python -m toolkit.moe.host``)
* :mod:`toolkit.pipeline.worker`  the stage worker
* :mod:`toolkit.data.input_pipeline` a peer's batches, made on a worker thread, shards leased from the relay
* :mod:`toolkit.accumulator`      the gradient sum
* :mod:`toolkit.peer_worker`           the optimizer's background thread
* :mod:`toolkit.optim_base`       what makes CollaborativeOptimizer a torch optimizer
* :mod:`toolkit.optimizer`        CollaborativeOptimizer, local SGD
* :mod:`toolkit.integrations`     HF Trainer, Lightning, Accelerate
* :mod:`toolkit.notebook`         secrets and hints, the live panel, the peer's W&B run
* :mod:`toolkit.roles`            what a peer plays (trainer, stage worker, expert host), each with its own options
* :mod:`toolkit.session`          ``join()``
* :mod:`toolkit.peer`             ``python -m toolkit.peer``
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "join": "toolkit.session",
    "JoinResult": "toolkit.roles.result",
    "CollaborativeOptimizer": "toolkit.optimizer",
    "run_model": "toolkit.optimizer",
    "RelayClient": "toolkit.client",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'toolkit' has no attribute {name!r}")
