"""What tests read from an in-process relay, and the runs they start it with.

The in-process relay itself is the package's :class:`relay_server.harness.thread.RelayThread`
(the demo's relay too): the relay's real app and its own ``serve`` (data-dir lock, connection
guard, port 0 and the port it bound read back) from an event loop on a thread of this process:
real HTTP on 127.0.0.1 without a second torch import per relay. Tests that need a relay process
(restarts, kills, its log) use conftest's ``start_relay`` instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import requests

from relay_server.api.context import COLLAB
from relay_server.api.shards import SHARD_POOL
from relay_server.core.config import load_config
from relay_server.harness.thread import RelayThread
from relay_server.moe.feature import EXPERTS
from tests.support.peers import ALLOWED
from tests.support.processes import merged, write_config
from tests.support.training import write_shards


def status(url: str) -> dict[str, Any]:
    return requests.get(url + "/api/status", timeout=10).json()


# The demo run (relay_server/defaults/demo.toml) with a model small enough for quick CPU steps.
TINY_LM = {
    "model": {"kwargs": {"seq_len": 32, "d_model": 32, "n_layer": 1, "n_head": 2, "d_ff": 64}},
    # strict large-batch steps (max_staleness 0 turns delayed updates off): a lone peer's
    # accounting is then exact, which these tests check sample for sample
    "run": {"target_batch": 16, "max_staleness": 0},
}


@contextmanager
def running_relay(directory: Path, overrides: dict[str, dict[str, Any]] | None = None) -> Iterator[RelayThread]:
    """The demo run with :data:`TINY_LM` (and ``overrides``) on an in-process relay, stopped on exit."""
    sections = {"server": {"host": "127.0.0.1", "port": 0, "data_dir": str(directory / "relay-data")}}
    for name, values in {**TINY_LM, **(overrides or {})}.items():
        sections.setdefault(name, {}).update(values)
    with RelayThread(load_config(None, overrides=sections)).start() as relay:
        yield relay


def hf_config(tmp_path: Path, hub_url: str, **sections: dict) -> Any:
    """An hf-mode run (SGD, lr 1: a step is exactly minus the mean gradient) with shard leases."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    shards = write_shards(tmp_path / "shards", 3, 5)
    base = merged(
        {
            "server": {"data_dir": str(tmp_path / "data"), "port": 0},
            "auth": {"mode": "hf", "hf_endpoint": hub_url, "allow_users": ALLOWED},
            "optimizer": {"name": "sgd", "lr": 1.0, "weight_decay": 0.0, "momentum": 0.0},
            "run": {"target_batch": 10, "max_staleness": 0, "precision": ""},
            "rounds": {
                "heartbeat_interval_s": 1.0,
                "peer_ttl_s": 600.0,
                "deadline_initial_s": 600.0,
                "deadline_floor_s": 600.0,
                "deadline_ceiling_s": 600.0,
            },
            **sections,
        }
    )
    path = write_config(tmp_path / "relay.toml", base)
    with open(path, "a") as f:  # [dataset] is free-form: written as TOML, as an organizer would
        f.write(
            f'\n[dataset]\nkind = "stream"\ncache_dir = {json.dumps(str(tmp_path / "cache"))}\n'
            f'\n[[dataset.sources]]\nname = "web"\ndata_files = {json.dumps(shards)}\n'
        )
    return load_config(path)


def plain(value: Any, depth: int = 0) -> Any:
    """Any relay object as comparable data: dataclasses and objects by their fields, arrays by hash."""
    if depth > 6:
        return repr(value)
    if isinstance(value, np.ndarray):
        return hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()
    if isinstance(value, dict):
        return {str(k): plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)) or type(value).__name__ == "deque":
        items = [plain(v, depth + 1) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)}
    if hasattr(value, "__dict__") and not callable(value):
        return {k: plain(v, depth + 1) for k, v in vars(value).items() if not k.startswith("__")}
    return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)


def snapshot(relay: RelayThread) -> dict[str, Any]:
    """Everything a peer-scoped request could touch (taken on the relay's loop)."""

    def take() -> dict[str, Any]:
        collab = relay.app[COLLAB]
        pool = relay.app.get(SHARD_POOL)
        experts = relay.app.get(EXPERTS)
        known = [row[0] for row in collab.store.db.execute("SELECT peer_id FROM peers ORDER BY peer_id")]
        registry = plain(collab.registry.peers)  # last_seen, samples, claimable, inflight...
        for peer in registry.values():
            # A stall of the relay's own loop moves every last_seen on by its length (the relay
            # excuses the silence it caused: a loaded CI machine's 0.9 s once did, between two
            # snapshots); a request that touched the peer sets it to its time instead.
            peer["last_seen"] = round(peer["last_seen"] - collab.loop_clock.stalled_s, 4)
        return {
            "registry": registry,
            "departed": [p for p in known if p not in collab.registry.peers],
            "round": plain(collab.rounds.round),
            "sum": plain(collab.reducer.sum),
            "weights": plain(collab.reducer.weights),
            "rounds_logged": collab.store.recent_rounds(),
            "contributions": collab.store.contributions(),
            "leases": None
            if pool is None
            else plain(
                {
                    "held": pool._held_by,
                    "granted": pool._granted,
                    "reported": pool._reported,
                    "coverage": pool.coverage().to_json(),
                }
            ),
            "rates": plain(collab.backbone.planning.peer_rates),
            "step": collab.step,
            "experts": None
            if experts is None
            else plain(
                {
                    "hosts": experts.directory._host,
                    "version": experts.directory.version,
                    "tasks": experts.broker.tasks,
                    "stats": experts.broker.stats,
                    "checkpoints": sorted(str(f) for f in experts.checkpoints.root.rglob("*")),
                }
            ),
        }

    return relay.call(take)
