"""``[moe]``: a run whose model has decentralized mixture-of-experts layers (Learning@home).

Experts live on volunteer hosts; the relay brokers their calls and keeps the expert directory and
each expert's latest checkpoint (:mod:`relay_server.moe`). Expert uids are ``{uid_prefix}{layer}``
followed by one grid coordinate per dimension: ``ffn0.3.1`` is layer 0's expert at (3, 1).
Hosts build experts from :data:`EXPERT_KINDS` only: the network never chooses code to run.
"""

from __future__ import annotations

import inspect
import itertools
import math
import re
from dataclasses import dataclass, field
from typing import Any

from toolkit.wire.protocol import MAX_JSON_BODY, MoeSpec

EXPERT_KINDS = ("ffn",)
"""Expert architectures a host builds (``toolkit.moe.experts``): ``ffn`` is the paper's block."""
OPTIMIZERS = ("none", "sgd", "adam")
"""``none``: frozen experts (a backward call returns d loss / d x and changes nothing)."""


@dataclass(kw_only=True)
class MoeSection:
    """``[moe]``: the run's mixture-of-experts layers and how their experts are hosted and called."""

    enabled: bool = False
    """Turn the DMoE machinery on (the expert directory, broker and checkpoints)."""
    uid_prefix: str = "ffn"
    """Expert uids start with this, then the layer: ``ffn0.3.1``."""
    layers: int = 1
    """DMoE layers in the trainers' model; each has its own grid of experts."""
    grid: list[int] = field(default_factory=lambda: [4, 4])
    """Experts per grid dimension (the product-key grid): [4, 4] = 16 experts per layer."""
    k: int = 2
    """Experts each row is sent to."""
    k_min: int = 1
    """A call layer waits for at least this many experts per row (up to the timeouts)."""
    expert: dict[str, Any] = field(default_factory=lambda: {"kind": "ffn", "d": 32, "hidden": 64})
    """The expert architecture: ``kind`` (one of EXPERT_KINDS) and its arguments."""
    optimizer: dict[str, Any] = field(default_factory=lambda: {"name": "sgd", "lr": 0.01})
    """How hosts update their experts after each backward call: ``name`` sgd|adam|none, ``lr``
    (not for none),
    ``momentum`` (sgd), ``betas`` (adam). Hosts keep this optimizer's state for the experts they
    host: the one exception to "volunteers hold no optimizer state"; the relay keeps checkpoints."""
    seed: int = 0
    """Fresh experts are initialized from (seed, uid), so any host builds the same expert."""
    forward_timeout_s: float = 10.0
    """A forward call waits this long for an expert's result before counting the expert as failed."""
    backward_timeout_s: float = 20.0
    """The same for a backward call (which also updates the expert)."""
    checkpoint_every_s: float = 5.0
    """Hosts upload each expert's parameters and optimizer state this often (at most this much
    training is lost with a host)."""
    keep_checkpoints: int = 3
    """Checkpoints the relay keeps per expert."""
    max_queued_rows: int = 4096
    """Rows queued per expert before calls are refused (429 ``queue_busy``: the caller treats the
    expert as failed for those rows, as the paper does)."""
    max_rows_per_call: int = 512
    """Rows one call carries; x (and g) must fit one signed request (256 KiB)."""
    task_memory_mb: int = 256
    """Call payloads the relay keeps in memory; beyond it they spill to ``data_dir/tasks``."""
    codec: str = "none"
    """Activations and their gradients on the wire: none (float32), float16 (half the bytes) or
    int8 (blockwise, about a quarter); the experts compute in float32 either way."""
    check_share: float = 0.0
    """The share of expert calls the relay spot-checks (0..1) against its own copy of the expert,
    computed from the host's checkpoint of the version the result says it was computed at (fresh
    experts: from the seed); chosen by a secret seed, so a host cannot tell a checked call from
    another. A host caught lying is banned and its experts go to other hosts (docs/experts.md,
    "Trusting expert hosts"). Costs this share of one expert forward (or backward) on the relay."""

    def uids(self) -> list[str]:
        return [
            f"{self.uid_prefix}{layer}." + ".".join(map(str, coords))
            for layer in range(self.layers)
            for coords in itertools.product(*(range(m) for m in self.grid))
        ]

    def width(self) -> int:
        """Features in and out of every expert."""
        return int(self.expert.get("d", 0))

    def checks(self, model: Any = None) -> list[tuple[bool, str]]:
        """(holds, message) pairs for :meth:`RelayConfig.validate`; ``model`` (the [model]
        section) must then describe the same mixture as this section."""
        experts = self.layers * math.prod(self.grid) if self.grid else 0
        return [
            *self._model_checks(model),
            (
                self.max_rows_per_call * self.width() * 4 * 2 + 4096 <= MAX_JSON_BODY,
                f"moe.max_rows_per_call x moe.expert.d x 8 bytes must fit a {MAX_JSON_BODY}-byte request: "
                "lower max_rows_per_call",
            ),
            (
                bool(re.fullmatch(r"[a-z][a-z0-9_]{0,15}", self.uid_prefix)),
                "moe.uid_prefix must be 1-16 lowercase letters, digits or _ (starting with a letter)",
            ),
            (
                1 <= self.layers <= 64 and 1 <= len(self.grid) <= 3 and all(1 <= m <= 256 for m in self.grid),
                "moe.layers must be 1..64 and moe.grid 1-3 dimensions of 1..256 experts",
            ),
            (experts <= 100_000, f"moe: {experts} experts; at most 100000"),
            (1 <= self.k_min <= self.k <= 64, "moe needs 1 <= k_min <= k <= 64"),
            (self.expert.get("kind") in EXPERT_KINDS, f"moe.expert.kind must be one of {EXPERT_KINDS}"),
            (
                isinstance(self.expert.get("d"), int)
                and 1 <= self.expert["d"] <= 65536
                and isinstance(self.expert.get("hidden"), int)
                and 1 <= self.expert["hidden"] <= 262144,
                "moe.expert needs integer d (1..65536) and hidden (1..262144)",
            ),
            (
                self.optimizer.get("name") in OPTIMIZERS
                and (
                    self.optimizer["name"] == "none"
                    or (isinstance(self.optimizer.get("lr"), (int, float)) and self.optimizer["lr"] > 0)
                ),
                f"moe.optimizer needs name in {OPTIMIZERS} and lr > 0 (none: experts are not trained)",
            ),
            (
                min(self.forward_timeout_s, self.backward_timeout_s, self.checkpoint_every_s) > 0,
                "moe timeouts and checkpoint_every_s must be > 0",
            ),
            (
                self.codec in ("none", "float16", "int8"),
                f"moe.codec must be none, float16 or int8 (a dense codec: "
                f"got {self.codec!r}; topk2-<K> is for run.compression only)",
            ),
            (
                0.0 <= self.check_share <= 1.0,
                f"moe.check_share must be 0..1 (the share of expert calls spot-checked), got {self.check_share!r}",
            ),
            (
                self.keep_checkpoints >= 1
                and self.max_queued_rows >= 1
                and self.max_rows_per_call >= 1
                and self.task_memory_mb >= 1,
                "moe.keep_checkpoints, max_queued_rows, max_rows_per_call and task_memory_mb must be >= 1",
            ),
        ]

    def _model_checks(self, model: Any) -> list[tuple[bool, str]]:
        """A DMoE model and this section describe one mixture: the same names, widths, grid, k
        and seed, or trainers would call experts the hosts do not have (or route rows to k
        experts the run did not size for). Compared on the model's EFFECTIVE values: its class's
        defaults overlaid with ``model.kwargs`` (a kwarg left out is the class's default, not a
        match)."""
        name = str(getattr(model, "factory", "")).rpartition(":")[2] if model is not None else ""
        if name not in DMOE_MODELS:
            return []
        if not self.enabled:
            return [(False, f"model.factory {name} needs [moe] enabled = true (its experts live on hosts)")]
        effective = {**_defaults(name), **model.kwargs}
        expected = {
            "hidden": self.expert.get("d"),
            "expert_hidden": self.expert.get("hidden"),
            "layers": self.layers,
            "grid": list(self.grid),
            "k": self.k,
            "uid_prefix": self.uid_prefix,
            "expert_seed": self.seed,
        }
        wrong = [
            f"model.kwargs.{k} = {effective[k]!r}{'' if k in model.kwargs else ' (the default of ' + name + ')'} "
            f"but [moe] says {v!r}: set both to one value"
            for k, v in expected.items()
            if k in effective and _plain(effective[k]) != v
        ]
        return [(not wrong, "the model's mixture differs from [moe]: " + "; ".join(wrong))]

    def spec(self) -> MoeSpec:
        """What trainers and hosts need to know (``GET /api/moe/spec``)."""
        return MoeSpec(
            uid_prefix=self.uid_prefix,
            layers=self.layers,
            grid=list(self.grid),
            k=self.k,
            k_min=self.k_min,
            expert=dict(self.expert),
            optimizer=dict(self.optimizer),
            seed=self.seed,
            forward_timeout_s=self.forward_timeout_s,
            backward_timeout_s=self.backward_timeout_s,
            checkpoint_every_s=self.checkpoint_every_s,
            max_rows_per_call=self.max_rows_per_call,
            codec=self.codec,
        )


DMOE_MODELS = ("DMoEMLP", "DMoEByteLM")
"""The toolkit's models whose layers are DMoE mixtures (``toolkit.models``); each takes the
mixture kwargs hidden, expert_hidden, layers, grid, k, uid_prefix and expert_seed."""


def _defaults(name: str) -> dict[str, Any]:
    """The keyword defaults of ``toolkit.models.<name>`` (imported only for a DMoE run: torch).
    A toolkit without that class yet compares the given kwargs only: its factory is refused by
    the model checks anyway, with the close matches it has."""
    import toolkit.models

    cls = getattr(toolkit.models, name, None)
    if cls is None:
        return {}
    return {
        p.name: p.default
        for p in inspect.signature(cls).parameters.values()
        if p.default is not inspect.Parameter.empty
    }


def _plain(value: Any) -> Any:
    """A grid as a list whatever its type (a class default is a tuple, TOML gives a list)."""
    return list(value) if isinstance(value, (list, tuple)) else value
