"""collabtrain's peer side: join a collaborative training run from a notebook with one call.

    import toolkit
    toolkit.join("https://relay.example.org")

Public names are imported lazily so that ``import toolkit`` stays cheap and the wire protocol
(``toolkit.wire.protocol``) is usable without torch.
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
